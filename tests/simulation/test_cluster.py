"""The simulated cluster drives the product's policies: sanity of each mode, autoscaler bounds."""

import pytest

from cosine.routing import DOMAINS
from cosine.simulation import config
from cosine.simulation.cluster import RequestSpec, Workload, poisson_requests, simulate


def _setup(mode):
    setup, _ = config.build_setup(config.load_cluster(None), mode=mode)
    return setup


def test_target_only_single_request_matches_roofline():
    setup = _setup("target-only")
    res = simulate(setup, Workload((RequestSpec(0.0, 256, 32, "code"),)))
    expected = setup.verifier.pass_s(256, 0) + sum(setup.verifier.pass_s(1, 256 + i) for i in range(1, 32))
    assert res.summary()["latency_p50_s"] == pytest.approx(expected, rel=1e-6)
    assert res.tokens == 32


@pytest.mark.parametrize("mode", ["vanilla", "cosine"])
def test_speculation_lowers_latency_at_low_load(mode):
    reqs = poisson_requests(0.5, 40.0, 256, 64, DOMAINS, seed=1)
    base = simulate(_setup("target-only"), Workload(reqs)).summary()
    setup = _setup(mode)
    spec = simulate(setup, Workload(reqs)).summary()
    assert spec["tokens"] == base["tokens"] == 64 * len(reqs)  # every request completes, nothing lost
    assert spec["mean_accepted_per_step"] > 0.5
    assert spec["latency_p50_s"] < base["latency_p50_s"]


def test_autoscaler_respects_bounds_and_step():
    setup = _setup("cosine")
    assert setup.scaling is not None
    lim = {p.name: p for p in setup.scaling.pools}
    reqs = poisson_requests(3.0, 300.0, 256, 64, DOMAINS, seed=2)
    res = simulate(setup, Workload(reqs), duration_s=300.0)
    for name, tl in res.replicas_timeline.items():
        assert all(lim[name].min_replicas <= n <= lim[name].max_replicas for _, n in tl)
        assert all(a[1] - b[1] <= setup.scaling.max_scale_down_step for a, b in zip(tl, tl[1:], strict=False))
    assert res.summary()["usd_per_million_tokens"] > 0


def _flat_setup(mode="target-only", budget=512, pools=(), lookup=None):
    """A verifier whose every step takes 1 s whatever its tokens, vLLM's budget `budget`."""
    from cosine_spec.cluster_spec import SpeculationSpec

    from cosine.simulation.cluster import SimSetup, VerifierModel
    from cosine.simulation.cost_models import AcceptanceModel

    return SimSetup(mode, VerifierModel(lambda n, kv: 1.0, max_batch_tokens=budget), pools,
                    AcceptanceModel({}, {}, default_mean=0.9), SpeculationSpec(), lookup=lookup)


def test_token_budget_chunks_prefills():
    # 3 prompts of 300 tokens, budget 512: step 1 prefills 300 + 212, step 2 finishes the second
    # prompt (88) and takes 300 of the third... with one decode token for the first request
    reqs = tuple(RequestSpec(0.0, 300, 4, "chat") for _ in range(3))
    res = simulate(_flat_setup(budget=512), Workload(reqs, 3))
    assert sorted(res.ttft_s) == [1.0, 2.0, 2.0]
    assert res.tokens == 12 and res.passes == 5  # 2 prefill steps, then decodes of all three together
    # a budget of 100 tokens: the first prompt alone takes 3 steps
    res = simulate(_flat_setup(budget=100), Workload(reqs[:1], 1))
    assert res.ttft_s == [3.0] and res.passes == 6


def test_prompt_lookup_drafts_cut_steps():
    from cosine.simulation.cluster import LookupModel

    reqs = (RequestSpec(0.0, 50, 33, "code"),)
    plain = simulate(_flat_setup(), Workload(reqs, 1))
    looked = simulate(_flat_setup("cosine", lookup=LookupModel(1.0, 8)), Workload(reqs, 1)).summary()
    assert plain.passes == 33  # a prefill step, then one token per step
    assert looked["draft_tokens"] > 0 and looked["mean_accepted_per_step"] > 1.0  # a flat pass: k = 8 pays
    assert looked["latency_p50_s"] < plain.summary()["latency_p50_s"] / 2


def test_pool_drafts_serve_a_later_step():
    from cosine.simulation.cluster import PoolModel

    slow = PoolModel("p", (), 1, 1, 1, draft_token_s=10.0)  # 80 s a draft
    fast = PoolModel("p", (), 1, 1, 1, draft_token_s=0.01)
    reqs = (RequestSpec(0.0, 50, 20, "code"),)
    late = simulate(_flat_setup("cosine", pools=(slow,)), Workload(reqs, 1)).summary()
    assert late["draft_tokens"] == 0 and late["drafts_late"] > 0  # the verifier never waits for it
    on_time = simulate(_flat_setup("cosine", pools=(fast,)), Workload(reqs, 1)).summary()
    assert on_time["draft_tokens"] > 0 and on_time["latency_p50_s"] < late["latency_p50_s"]


def test_the_simulator_drives_the_serving_proposer(monkeypatch):
    """No copy of the proposer in the simulator: every draft the simulated verifier checks is what
    `CoSineProposer.propose` returned, and the proposer learns from every simulated step."""
    from cosine.proposer import CoSineProposer
    from cosine.simulation.cluster import LookupModel, PoolModel

    proposed, observed = [], []
    propose, observe = CoSineProposer.propose, CoSineProposer.observe_step
    monkeypatch.setattr(CoSineProposer, "propose",
                        lambda self, *a, **kw: proposed.append(propose(self, *a, **kw)) or proposed[-1])
    monkeypatch.setattr(CoSineProposer, "observe_step", lambda self, step: observed.append(step) or observe(self, step))
    pool = PoolModel("p", (), 1, 1, 1, draft_token_s=0.01)
    res = simulate(_flat_setup("cosine", pools=(pool,), lookup=LookupModel(0.5, 4)),
                   Workload(tuple(RequestSpec(0.0, 50, 24, "code") for _ in range(3)), 3))
    assert res.tokens == 72 and len(observed) == res.passes
    assert res.draft_tokens == sum(len(d) for ds in proposed for d in ds.values()) > 0
    assert sum(o.num_draft_tokens for s in observed for o in s.outcomes) == res.draft_tokens
    assert set(res.by_source) <= {"p", "lookup"} and res.by_source.get("p")  # the pool's drafts were used


def test_a_pool_call_resolves_after_its_simulated_work():
    import simpy

    from cosine.simulation.cluster import SimExecutor

    env = simpy.Environment()
    ex = SimExecutor(env)

    def call():
        ex.defer(iter([env.timeout(2.5)]))
        return "draft"

    fut = ex.submit(call)
    env.run(until=2.4)
    assert not fut.done()
    env.run(until=2.6)
    assert fut.result() == "draft"
    failed = ex.submit(lambda: 1 / 0)
    env.run(until=3.0)
    assert isinstance(failed.exception(), ZeroDivisionError)


def _routed(router, seen_hit_factor=1.0):
    """Two replicas whose step costs 10 ms plus 1 ms per token (prefill matters), each with a
    prefix cache, prompt lookup on; `router` in front."""
    import dataclasses

    from cosine.simulation.cluster import LookupModel, VerifierModel

    setup = _flat_setup("cosine", lookup=LookupModel(0.3, 4, seen_hit_factor=seen_hit_factor))
    verifier = VerifierModel(lambda n, kv: 0.01 + 0.001 * n, replicas=2, max_batch_tokens=4096,
                             prefix_cache_tokens=100_000)
    return dataclasses.replace(setup, verifier=verifier, router=router)


def test_routers_keep_conversations_where_their_prefix_is_cached():
    """Session affinity and the endpoint picker's scorers send a conversation's later turns to the
    replica that holds its history: most of their prompts come from the prefix cache, TTFT drops,
    and nothing is lost; a random router finds the history about half the time with two replicas.
    A lookup that drafts more on a seen conversation (`seen_hit_factor`) drafts more under
    affinity. Catches: a router that ignores the cache, a cache that outlives eviction or is
    shared between replicas, turns of a conversation sent out of order."""
    from cosine.simulation.scenarios import conversations

    reqs = conversations(16, 4, system_tokens=64, user_tokens=32, output_tokens=24, domains=("chat",), seed=3)
    w = Workload(reqs, 4, sessions=True)
    res = {r: simulate(_routed(r), w).summary() for r in ("random", "session", "affinity")}
    # later turns' histories (a first turn's is the system prompt, in no cache yet)
    history = sum(r.history_tokens for r in reqs if r.history_tokens > 64) / sum(r.prompt_tokens for r in reqs)
    for r in res.values():
        assert r["tokens"] == 24 * len(reqs)
    assert res["session"]["prefix_cache_hit_fraction"] > 0.9 * history
    assert res["affinity"]["prefix_cache_hit_fraction"] > 0.9 * history
    assert res["random"]["prefix_cache_hit_fraction"] < 0.75 * history
    assert res["session"]["ttft_p50_s"] < res["random"]["ttft_p50_s"]
    seen = {r: simulate(_routed(r, seen_hit_factor=3.0), w).summary() for r in ("random", "session")}
    assert seen["session"]["steps_with_draft_fraction"] > seen["random"]["steps_with_draft_fraction"]
    with pytest.raises(ValueError, match="router"):
        simulate(_routed("round-robin"), w)


def _head(k=4, token_s=0.05):
    from cosine.simulation.cluster import EAGLE3, EngineDrafterModel

    return EngineDrafterModel(EAGLE3, k, lambda batch: token_s)


def test_the_engines_drafter_is_a_source_inside_cosine(monkeypatch):
    """EAGLE-3 is a source of `cosine`, not a mode beside it: every step its draft for each decoding
    request is offered to the proposer (`EngineSource.offer`, as `vllm_hooks` does), the proposer
    verifies what it chooses, and the head's k forwards are paid on every decode step whichever
    draft wins. vLLM's own `eagle3` (mode `vanilla` with the head) verifies the head's k tokens."""
    import dataclasses

    from cosine.simulation.cluster import EAGLE3, LookupModel
    from cosine.sources.engine import EngineSource

    offered = []
    offer = EngineSource.offer
    monkeypatch.setattr(EngineSource, "offer", lambda self, drafts: offered.append(dict(drafts)) or offer(self, drafts))
    reqs = (RequestSpec(0.0, 50, 40, "chat"),)
    setup = dataclasses.replace(_flat_setup("cosine", lookup=LookupModel(0.5, 4)), engine_drafter=_head())
    res = simulate(setup, Workload(reqs, 1))
    assert res.tokens == 40 and len(offered) == res.passes - 1  # after every step but the last
    assert all(1 <= len(d["r0"]) <= 4 for d in offered)  # as deep as the proposer's engine_draft_len
    assert res.by_source.get(EAGLE3) and res.accepted > 0
    # the prefill step alone has no decode: 1 s; every decode step pays the head's forwards, 0.05 s
    # each, as deep as drafted (1 to 4): exactly what the offered drafts' lengths say
    assert res.verifier_busy_s == pytest.approx(1.0 + (res.passes - 1) + 0.05 * (
        4 + sum(len(d["r0"]) for d in offered[1:])))
    vllm = simulate(dataclasses.replace(setup, mode="vanilla", lookup=None), Workload(reqs, 1))
    assert set(vllm.by_source) == {EAGLE3} and vllm.draft_tokens == 4 * vllm.spec_steps
    assert vllm.verifier_busy_s == pytest.approx(1.0 + 1.2 * (vllm.passes - 1))
    without = simulate(dataclasses.replace(setup, engine_drafter=None), Workload(reqs, 1))
    assert EAGLE3 not in without.by_source and without.verifier_busy_s == pytest.approx(without.passes)


def test_async_scheduling_off_and_the_proposers_time_are_paid_per_step():
    """A step with async scheduling off pays `sync_step_s`; a cosine step also pays the proposer's
    time for its decoding requests; target-only keeps async scheduling and has no proposer."""
    import dataclasses

    from cosine.simulation.cluster import LookupModel

    reqs = tuple(RequestSpec(0.0, 50, 10, "chat") for _ in range(2))
    setup = _flat_setup("cosine", lookup=LookupModel(0.0, 4))
    setup = dataclasses.replace(setup, async_scheduling=False, verifier=dataclasses.replace(
        setup.verifier, sync_step_s=0.1, proposer_step_s=lambda batch: 0.01 * batch))
    res = simulate(setup, Workload(reqs, 2))
    decode_steps = res.passes - 1  # both prompts in one prefill step, then both decode together
    assert res.verifier_busy_s == pytest.approx(1.1 + 1.12 * decode_steps)
    assert res.summary()["proposer_cpu_ms_per_step"] > 0  # measured, wall time of this process
    plain = simulate(dataclasses.replace(setup, mode="target-only", async_scheduling=True), Workload(reqs, 2))
    assert plain.verifier_busy_s == pytest.approx(plain.passes)


def test_the_model_runner_seam_pays_the_proposer_only_past_the_gpu_step():
    """Through the model runner seam the proposer's Python runs beside the GPU's step: a step pays
    its time only where it exceeds the step's GPU time (the pass, the head's forwards, lookup on
    the device), and then only the excess; lookup on the device adds its kernels' time to every
    decode step. Async scheduling is on: no `sync_step_s`."""
    import dataclasses

    from cosine.simulation.cluster import LookupModel

    reqs = tuple(RequestSpec(0.0, 50, 10, "chat") for _ in range(2))
    setup = _flat_setup("cosine", lookup=LookupModel(0.0, 4))
    setup = dataclasses.replace(setup, proposer_overlapped=True, verifier=dataclasses.replace(
        setup.verifier, sync_step_s=0.1, device_lookup_step_s=0.2, proposer_step_s=lambda batch: 0.01 * batch))
    res = simulate(setup, Workload(reqs, 2))
    decode_steps = res.passes - 1  # both prompts in one prefill step, then both decode together
    assert res.verifier_busy_s == pytest.approx(1.0 + 1.2 * decode_steps)  # 0.02 s of Python hidden by 1.2 s
    slow = dataclasses.replace(setup, verifier=dataclasses.replace(setup.verifier, proposer_step_s=lambda b: 0.8 * b))
    res = simulate(slow, Workload(reqs, 2))  # 1.6 s of Python a step: 0.4 s past the GPU's 1.2 s
    assert res.verifier_busy_s == pytest.approx(1.0 + 1.6 * (res.passes - 1))
    # the scheduler seam: every step pays all of the proposer's time and async scheduling off
    sched = dataclasses.replace(slow, proposer_overlapped=False, async_scheduling=False)
    res = simulate(sched, Workload(reqs, 2))
    assert res.verifier_busy_s == pytest.approx(1.1 + (1.2 + 1.6 + 0.1) * (res.passes - 1))


class _Script:
    """A local source that drafts, at each call, the tokens `script` gives for the context's length."""

    name, where = "lookup", "process"

    def __init__(self, script):
        self.script, self.asked = script, []

    def start(self, request_id, prompt):
        pass

    def candidate(self, request_id, context, max_tokens, acceptance_rate):
        from cosine.sources import Candidate

        self.asked.append(max_tokens)
        tokens = self.script.get(len(context), ())[:max_tokens]
        return Candidate(tuple(tokens), (0.5,) * len(tokens)) if tokens else None

    def release(self, request_id):
        pass


def test_an_anchored_candidate_is_used_a_step_later_only_where_it_continues_the_tokens():
    """A candidate from the verifier's process reaches the device a step stale, anchored to the
    context it was made from: the step after, it is used where the tokens emitted meanwhile are its
    own first ones (the rest of it is the draft), and is no candidate where they are not, so
    another source's draft is verified."""
    from cosine.simulation.drafting import AnchoredSource

    inner = _Script({3: (4, 5, 6, 7, 8), 5: (6, 7, 8), 7: (9, 9)})
    src = AnchoredSource(inner)
    assert src.candidate("r", [1, 2, 3], 4, 0.5) is None  # nothing made a step before
    assert inner.asked == [9]  # asked for enough to outlast the step it waits through
    got = src.candidate("r", [1, 2, 3, 4, 5], 2, 0.5)  # the target emitted 4, 5: the candidate's own
    assert got is not None and got.token_ids == (6, 7) and got.confidences == (0.5, 0.5)
    assert src.candidate("r", [1, 2, 3, 4, 5, 6, 0], 4, 0.5) is None  # emitted 6, 0: the candidate said 6, 7
    got = src.candidate("r", [1, 2, 3, 4, 5, 6, 0, 9], 4, 0.5)  # made from 7 tokens as (9, 9); emitted 9
    assert got is not None and got.token_ids == (9,)
    src.release("r")
    assert src.candidate("r", [1, 2, 3, 4, 5, 6, 0, 9, 9], 4, 0.5) is None  # released: nothing kept


def test_stale_lookup_falls_back_to_the_heads_draft():
    """With lookup's candidates a step stale (`SimSetup.lookup_anchored`), the steps where no stale
    candidate continues the tokens verify the head's draft: the head's share of verified drafts
    grows against lookup on the current tokens, and every token still completes."""
    import dataclasses

    from cosine.simulation.cluster import EAGLE3, LookupModel

    reqs = tuple(RequestSpec(0.0, 50, 60, "code") for _ in range(2))
    setup = dataclasses.replace(_flat_setup("cosine", lookup=LookupModel(1.0, 4)), engine_drafter=_head())
    fresh = simulate(setup, Workload(reqs, 2))
    stale = simulate(dataclasses.replace(setup, lookup_anchored=True), Workload(reqs, 2))
    assert fresh.tokens == stale.tokens == 120
    share = {name: r.by_source.get(EAGLE3, [0])[0] / r.spec_steps for name, r in (("fresh", fresh), ("stale", stale))}
    assert stale.by_source.get("lookup") and share["stale"] > share["fresh"]
