"""CoSine's drafting plane (`runtime/src/cosine/proposer.py`) with plain token lists and fake pools."""

from __future__ import annotations

import threading
import time

import pytest
from cosine_spec.autoscaling import SKIP_REASONS, PoolObservation
from cosine_spec.cluster_spec import SpeculationSpec

from cosine.drafter import Draft, DraftBranch
from cosine.pool_policy import PoolPolicy
from cosine.proposer import CoSineProposer, ProposerSettings, RequestOutcome, StepRecord
from cosine.sources.lookup import LOOKUP


def _k(max_draft_len: int, **speculation) -> SpeculationSpec:
    """spec.speculation with k's upper bound `max_draft_len`."""
    return SpeculationSpec(max_draft_len=max_draft_len, **speculation)

REPEAT = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8, 9]  # the tail 5 6 7 8 9 was seen before, followed by 10 11 12 ...


class FakePool:
    """A drafter pool whose draft is the context's continuation under a fixed rule; `delay_s`
    simulates drafting time; `fail` raises like a dead gRPC peer."""

    def __init__(self, name: str, rule=lambda ctx, k: [ctx[-1] + 1 + i for i in range(k)], delay_s: float = 0.0,
                 fail: bool = False, confidence: float = 0.9) -> None:
        self.name, self.rule, self.delay_s, self.fail, self.confidence = name, rule, delay_s, fail, confidence
        self.calls = 0
        self.released: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def propose(self, request_id, context_ids, max_tokens, *, min_confidence=0.0, expected=(), max_branches=0) -> Draft:
        self.calls += 1
        self.gate.wait()
        time.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("drafter down")
        toks = tuple(self.rule(list(context_ids), max_tokens))
        return Draft(toks, (self.confidence,) * len(toks), self.name, self.delay_s)

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def _wait(pred, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_prompt_lookup_draft_capped_at_k():
    p = CoSineProposer(ProposerSettings(speculation=_k(3)))
    drafts = p.propose({"r": REPEAT})
    assert drafts == {"r": [10, 11, 12]}
    assert p.source_of("r") == LOOKUP


def test_no_candidate_no_draft():
    p = CoSineProposer(ProposerSettings(speculation=_k(4)))
    assert p.propose({"r": [1, 2, 3, 4]}) == {"r": []}
    assert p.source_of("r") == ""


def test_k_falls_to_zero_when_drafts_cost_and_are_rejected_then_probes():
    s = ProposerSettings(speculation=_k(4))
    p = CoSineProposer(s)
    ks = []
    for _ in range(40):
        d = p.propose({"r": REPEAT})["r"]
        ks.append(len(d))
        # a pass costs 0.1 s per token (compute-bound) and the target rejects every draft token
        n = 1 + len(d)
        p.observe_step(StepRecord(0.1 * n, n, (RequestOutcome("r", len(d), 0, p.source_of("r")),)))
    assert ks[0] == 4  # unmeasured: tried at full length
    assert ks[-10:].count(0) >= 8  # priced and rejected: speculation stops ...
    assert any(k > 0 for k in ks[-10:])  # ... but probes keep re-measuring


def test_k_stays_long_when_drafts_are_accepted_and_passes_flat():
    p = CoSineProposer(ProposerSettings(speculation=_k(4)))
    for _ in range(20):
        d = p.propose({"r": REPEAT})["r"]
        n = 1 + len(d)
        p.observe_step(StepRecord(0.1 + 0.002 * n, n, (RequestOutcome("r", len(d), len(d), p.source_of("r")),)))
    assert len(p.propose({"r": REPEAT})["r"]) == 4
    assert p.stats.accepted_tokens[LOOKUP] > 0 and p.stats.steps_with_draft == 20


def test_pool_never_blocks_and_counts_late_drafts():
    pool = FakePool("coder")
    pool.gate.clear()  # the pool hangs
    p = CoSineProposer(ProposerSettings(speculation=_k(4), lookup=False), [pool])
    # both steps return while the pool is still hung: the verifier never waits for a draft (a
    # proposer that waited would not return until the gate opens below)
    assert p.propose({"r": [1, 2, 3]}) == {"r": []}
    assert p.propose({"r": [1, 2, 3, 4]}) == {"r": []}
    assert not pool.gate.is_set()
    assert p.stats.drafts_late["coder"] >= 1
    pool.gate.set()
    p.close()


def test_pool_draft_used_when_it_arrives_and_continues_the_context():
    pool = FakePool("coder")  # drafts ctx[-1]+1, +2, ...
    p = CoSineProposer(ProposerSettings(speculation=_k(3), lookup=False), [pool])
    assert p.propose({"r": [1, 2, 3]}) == {"r": []}  # asks the pool to draft from [1, 2, 3]
    _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
    # the target emitted 4 meanwhile, the pool's own first token: the rest of its draft continues
    assert p.propose({"r": [1, 2, 3, 4]}) == {"r": [5, 6, 7]}
    assert p.source_of("r") == "coder"


def test_pool_draft_dropped_when_the_target_diverged():
    pool = FakePool("coder")
    p = CoSineProposer(ProposerSettings(speculation=_k(3), lookup=False), [pool])
    p.propose({"r": [1, 2, 3]})
    _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
    assert p.propose({"r": [1, 2, 3, 99]}) == {"r": []}


def test_failed_pool_costs_drafts_not_the_request():
    pool = FakePool("coder", fail=True)
    p = CoSineProposer(ProposerSettings(speculation=_k(3)), [pool])
    for i in range(12):
        drafts = p.propose({"r": REPEAT + [i]})
        assert "r" in drafts
        time.sleep(0.02)
    assert p.stats.pool_errors["coder"] >= 3
    assert not p.pools.breakers["coder"].allows(time.monotonic())


def test_a_down_pool_still_shows_its_demand():
    """A pool with no replica that answers (at zero on a cluster) is not routed, so it is never
    asked; the steps on which it would have been are counted as asks skipped as "down" (the
    autoscaler's signal to bring it back), on new requests as on running ones."""
    pool = FakePool("coder", fail=True)
    s = ProposerSettings(speculation=_k(3), lookup=False, pool_retry_s=60.0)
    p = CoSineProposer(s, [pool])
    for i in range(6):
        p.propose({"r": [1, 2, 3 + i]})
        _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
    assert not p.pools.breakers["coder"].allows(time.monotonic())
    calls, down = pool.calls, p.stats.pool_skipped.get(("coder", "down"), 0)
    assert down >= 2
    for i in range(4):  # a request that arrives while the pool is down: routed nowhere, demand still
        p.propose({"r2": [7, 8, 9 + i]})
    assert p._requests["r2"].pools == [] and p._requests["r2"].down == ["coder"]
    assert pool.calls == calls and p.stats.pool_skipped[("coder", "down")] >= down + 1
    p.close()


def test_a_pool_at_zero_replicas_is_not_asked_but_shows_its_demand(caplog):
    """A pool the autoscaler took to zero has no replica (`ready` 0): asking it would only fail,
    so it is not asked, which is no error and no warning; its asks are counted skipped "down"
    (the demand that brings it back), and once a replica is back, new requests are routed to it."""
    pool = FakePool("coder")
    pool.ready = 0
    p = CoSineProposer(ProposerSettings(speculation=_k(3), lookup=False), [pool])
    with caplog.at_level("INFO", logger="cosine.pool_clients"):
        for i in range(4):
            p.propose({"r": [1, 2, 3 + i]})
    assert pool.calls == 0 and p.stats.pool_errors.get("coder", 0) == 0
    assert p.stats.pool_skipped[("coder", "down")] == 4
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    pool.ready = 1
    p.propose({"r2": [7, 8, 9]})
    _wait(lambda: pool.calls == 1)
    assert p._requests["r2"].pools == ["coder"]
    p.close()


def test_failed_pool_is_one_warning_not_a_line_per_call(caplog):
    pool = FakePool("coder", fail=True)
    s = ProposerSettings(speculation=_k(3), lookup=False, pool_retry_s=0.0)  # asked again at once
    p = CoSineProposer(s, [pool])
    with caplog.at_level("DEBUG", logger="cosine.proposer"):
        for i in range(30):
            p.propose({"r": [1, 2, 3 + i]})
            _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
    assert p.stats.pool_errors["coder"] >= 10
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "coder" in warnings[0].getMessage()
    p.close()


def test_single_late_call_is_a_metric_not_a_warning(caplog):
    pool = FakePool("coder")
    p = CoSineProposer(ProposerSettings(speculation=_k(3), lookup=False), [pool])
    with caplog.at_level("INFO", logger="cosine.proposer"):
        pool.fail = True
        p.propose({"r": [1, 2, 3]})
        _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
        pool.fail = False
        for i in range(4):
            p.propose({"r": [1, 2, 3, 9 + i]})
            _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
    assert p.stats.pool_errors["coder"] == 1
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    assert p.pools.breakers["coder"].allows(0.0) and p.pools.breakers["coder"].down_until_s == 0.0
    p.close()


def test_release_reaches_every_pool_the_request_used_after_its_calls_end():
    a, b = FakePool("a"), FakePool("b")
    p = CoSineProposer(ProposerSettings(speculation=_k(3, fusion=False), lookup=False, reroute_every=1),
                       [a, b], seed=1)
    for i in range(40):  # re-routed every step between two equal pools: both get used
        p.propose({"r": [1, 2, 3 + i]})
        _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
    assert a.calls and b.calls
    b.gate.clear()  # b's last call hangs while the request finishes
    p._requests["r"].inflight["b"] = p.pools._executor.submit(b.propose, "r", [1], 3)
    p.retain(set())
    assert p.num_requests() == 0  # the request is gone ...
    time.sleep(0.1)  # (time for a release sent too early to land: the executor runs it at once)
    assert a.released == [] and b.released == []  # ... but no pool is told while b's call is out
    b.gate.set()
    _wait(lambda: "r" in a.released and "r" in b.released)
    assert p.num_requests() == 0
    p.close()


def test_close_returns_while_released_requests_wait_for_queued_calls():
    """Shutting down with pool calls queued behind hung ones, for requests already released: the
    executor cancels the queued calls and runs their callbacks under its own lock, so the release
    they were waiting for must not be submitted then (it deadlocked `vLLM`'s shutdown once)."""
    pool = FakePool("a")
    p = CoSineProposer(ProposerSettings(speculation=_k(3), lookup=False), [pool], seed=0)
    pool.gate.clear()  # the pool hangs: two calls run (the executor's 2 threads), the rest queue
    for i in range(4):
        p.propose({f"r{i}": [1, 2, 3]})
    assert sum(not f.running() and not f.done() for r in p._requests.values() for f in r.inflight.values()) >= 1
    p.retain(set())
    closed = threading.Thread(target=p.close)
    closed.start()
    closed.join(timeout=5)
    assert not closed.is_alive(), "close() deadlocked"
    pool.gate.set()


def test_fusion_picks_the_more_confident_candidate_per_position():
    # lookup proposes 10 11 12 (path probability 0.5: the tail 5..9 is followed by 10 once of its
    # two occurrences); the pool, an expert on the domain, proposes 10 42 43 at confidence 0.99
    pool = FakePool("coder", rule=lambda ctx, k: [10, 42, 43, 44][:k], confidence=0.99)
    p = CoSineProposer(ProposerSettings(speculation=_k(3)), [pool], {"coder": ["code"]},
                       classify=lambda prompt: "code")
    p.propose({"r": REPEAT})
    _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
    pool.gate.clear()  # keep the next call in flight so the arrived draft stays the pool's latest
    assert p.propose({"r": REPEAT})["r"] == [10, 42, 43]
    pool.gate.set()
    p.close()


def test_outcomes_train_the_router_per_pool_and_domain():
    pool = FakePool("coder")
    p = CoSineProposer(ProposerSettings(speculation=_k(3), lookup=False), [pool], {"coder": ["code"]},
                       classify=lambda prompt: "code")
    p.propose({"r": [1, 2, 3]}, {"r": 3})
    _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
    d = p.propose({"r": [1, 2, 3, 4]})["r"]
    p.observe_step(StepRecord(0.1, 1 + len(d), (RequestOutcome("r", len(d), 2, "coder"),)))
    arm = p.router.arms[("coder", "code")]
    assert arm.accepted == 2 and arm.rejected == 1


def test_retain_releases_finished_requests_whose_output_drafts_for_others():
    pool = FakePool("coder")
    p = CoSineProposer(ProposerSettings(speculation=_k(3), pool=PoolPolicy(probe_every=1000)), [pool])
    p.propose({"a": [1, 2], "b": [7, 8]}, {"a": 2, "b": 2})
    p.propose({"a": [1, 2, 3, 4, 5, 6], "b": [7, 8, 9]})  # a's output: 3 4 5 6
    p.retain({"b"})
    _wait(lambda: pool.released == ["a"])
    assert "a" not in p._requests and "b" in p._requests and len(p.sources[0].trees) == 1
    d = p.propose({"b": [7, 8, 9, 3, 4]})["b"]
    assert d[:2] == [5, 6] and p.source_of("b") == LOOKUP  # a's output, drafted for b


def test_lookup_drafts_carry_the_suffix_trees_path_probabilities():
    p = CoSineProposer(ProposerSettings(speculation=_k(4)))
    ctx = [5, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2]
    assert p._fused("r", p._new_request("r", ctx), ctx, 0, 1)[:3] == ((3, 9), LOOKUP, pytest.approx((0.5, 0.25)))


def test_prompt_lookup_acceptance_is_learned_per_domain_across_requests():
    p = CoSineProposer(ProposerSettings(speculation=_k(4)), classify=lambda prompt: "code" if prompt[0] < 100
                       else "chat")
    fresh = p._initial_state(LOOKUP, "chat").acceptance_rate
    drafted = []
    for i in range(30):  # chat requests whose lookup drafts are always rejected
        rid = f"chat{i}"
        d = p.propose({rid: [100 + i, *REPEAT]}, {rid: 12})[rid]
        drafted.append(len(d))
        p.observe_step(StepRecord(0.1, 1 + len(d), (RequestOutcome(rid, len(d), 0, p.source_of(rid)),)))
        p.retain(set())
    assert drafted[0] == 4 and drafted[-5:] == [0] * 5  # the same tree match, no longer drafted for chat
    assert p.calibration(LOOKUP, "chat") < 0.2 and p.calibration(LOOKUP, "code") == 1.0
    assert p._initial_state(LOOKUP, "chat").acceptance_rate < fresh
    assert p._initial_state(LOOKUP, "code").acceptance_rate == fresh  # another domain keeps its prior
    assert len(p.propose({"code": [1, *REPEAT]}, {"code": 12})["code"]) == 4


def _decode_with(p: CoSineProposer, pool: FakePool, steps: int, accept, stride: int = 1) -> list[int]:
    """Run `steps` engine steps of one request whose target emits ctx[-1] + stride (the pool drafts
    + 1), accepting `accept(draft)` tokens of each draft; the pool's call count after every step."""
    ctx, calls = [1, 2, 3], []
    for _ in range(steps):
        drafts = p.propose({"r": list(ctx)})
        d = drafts["r"]
        n_acc = accept(d)
        p.observe_step(StepRecord(0.05, 1 + len(d), (RequestOutcome("r", len(d), n_acc, p.source_of("r")),)))
        ctx += d[:n_acc] + [(d[n_acc - 1] if n_acc else ctx[-1]) + stride]
        _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
        calls.append(pool.calls)
    return calls


def test_pool_whose_drafts_never_pay_is_only_probed():
    pool = FakePool("slow", rule=lambda ctx, k: [ctx[-1] + 1 + i for i in range(k)])  # the target takes +2
    s = ProposerSettings(speculation=_k(3), lookup=False, pool=PoolPolicy(probe_every=8))
    p = CoSineProposer(s, [pool])
    calls = _decode_with(p, pool, 72, accept=lambda d: 0, stride=2)
    assert calls[1] == 2, "asked while its acceptance estimate (the prior) says it pays"
    assert calls[-1] - calls[23] <= 48 // 8 + 1, "once measured as rejected, only on probe steps"
    assert p.stats.pool_yield["slow"] < 0.1
    p.close()


def test_pool_whose_tokens_do_not_pay_for_its_time_is_only_probed():
    """The pool of `test_pool_whose_drafts_are_accepted_is_asked_every_step`, priced: at $3600 an
    hour a call of its measured round trip costs more than the 3 tokens it adds are worth at
    1e-6 $ each, so after its first call (which measures the round trip) it is asked only on
    probe steps, skipped as "yield" (not demand: the autoscaler does not add replicas for it)."""
    pool = FakePool("dear")
    policy = PoolPolicy(probe_every=8, token_value_usd=1e-6, pool_prices=(("dear", 3600.0),))
    p = CoSineProposer(ProposerSettings(speculation=_k(3), lookup=False, pool=policy), [pool])
    calls = _decode_with(p, pool, 40, accept=len)
    assert p.stats.pool_rtt_s["dear"] > 1e-5  # the ask's price: 1 $/s for this long at least
    assert calls[-1] <= 40 // 8 + 2
    assert p.stats.pool_skipped[("dear", "yield")] >= 30
    # its probe asks are counted apart: the autoscaler sees no demand for it
    assert p.stats.pool_probes["dear"] == calls[-1] - 1 >= 3
    obs = PoolObservation("dear", 1, 1, asks_per_s=calls[-1], probes_per_s=p.stats.pool_probes["dear"],
                          skipped_per_s={r: p.stats.pool_skipped.get(("dear", r), 0) for r in SKIP_REASONS})
    assert obs.demand_per_s() == 1  # its first ask, which paid on the prior
    p.close()


def test_a_pool_at_zero_is_not_brought_back_by_probes():
    """A pool with no replica is probed by no one: on a request's probe steps where it would be
    skipped as "yield" it is skipped as "yield" (no demand), and only where it would pay is the
    skip "down" (the autoscaler brings it back for those)."""
    pool = FakePool("dear", fail=True)
    policy = PoolPolicy(probe_every=2, token_value_usd=1e-6, pool_prices=(("dear", 3600.0),))
    s = ProposerSettings(speculation=_k(3), lookup=False, pool_retry_s=60.0, pool=policy)
    p = CoSineProposer(s, [pool])
    p.stats.set(p.stats.pool_rtt_s, "dear", 1.0)  # measured: an ask costs $1, 1e6 tokens' worth
    p.pools.breakers["dear"].failed(time.monotonic(), fatal=True)  # no replica answers
    for i in range(9):
        p.propose({"r": [1, 2, 3 + i]})
    assert pool.calls == 0 and not p.stats.pool_probes
    assert p.stats.pool_skipped.get(("dear", "down"), 0) == 0 and p.stats.pool_skipped[("dear", "yield")] == 9
    p.close()


def test_pool_is_not_asked_where_prompt_lookup_gives_more():
    """A request whose own tokens repeat (lookup drafts and is accepted every step) does not take
    the pool's capacity beyond probes; the pool pays where lookup finds nothing."""
    pool = FakePool("p", rule=lambda ctx, k: [0] * k)
    s = ProposerSettings(speculation=_k(4), pool=PoolPolicy(probe_every=8))
    p = CoSineProposer(s, [pool])
    ctx = [1, 2, 3, 4, 5] * 6
    for _ in range(32):
        d = p.propose({"r": list(ctx)})["r"]
        p.observe_step(StepRecord(0.05, 1 + len(d), (RequestOutcome("r", len(d), len(d), p.source_of("r")),)))
        ctx += d + [ctx[-5]]
        _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
    assert pool.calls <= 32 // 8 + 2
    assert p.stats.pool_skipped[("p", "yield")] >= 24  # lookup beats it: not demand for more replicas
    p.close()


def test_pool_pays_rule():
    from cosine.speculation_control import pool_gain_tokens, pool_pays

    assert pool_pays(0.8, 1.0, [(0.5, 0.2)], 4)  # lookup rarely matches: the pool pays
    assert not pool_pays(0.8, 1.0, [(0.9, 1.0)], 4)  # lookup matches every step and is accepted more
    assert not pool_pays(0.8, 0.1, [(0.5, 0.5)], 4)  # the pool's drafts arrive late 9 times in 10
    assert not pool_pays(0.05, 1.0, [], 4, min_gain_tokens=0.25)  # nothing to beat, but too little
    assert not pool_pays(0.9, 1.0, [], 0)
    # the best local source is what a pool must beat: an engine drafter always drafting at 0.7
    assert pool_pays(0.8, 1.0, [(0.5, 0.2)], 4) and not pool_pays(0.8, 1.0, [(0.5, 0.2), (0.85, 1.0)], 4)
    # what it pays is its gain over that source: accepted tokens per step, the pool's less the best local's
    assert pool_gain_tokens(0.8, 1.0, [(0.5, 0.2), (0.85, 1.0)], 4) < 0 < pool_gain_tokens(0.8, 1.0, [(0.5, 0.2)], 4)
    assert pool_gain_tokens(1.0, 1.0, [(1.0, 0.5)], 4) == pytest.approx(2.0)
    assert pool_gain_tokens(1.0, 1.0, [], 0) == 0.0


def test_pool_whose_drafts_are_accepted_is_asked_every_step():
    pool = FakePool("good")
    s = ProposerSettings(speculation=_k(3), lookup=False, pool=PoolPolicy(probe_every=8))
    p = CoSineProposer(s, [pool])
    calls = _decode_with(p, pool, 40, accept=len)  # every draft token accepted
    assert calls[-1] == 40
    assert p.stats.pool_yield["good"] >= 1.0
    p.close()


def test_collector_exports_pool_calls_and_yield():
    from prometheus_client import CollectorRegistry, generate_latest

    from cosine.metrics import ProposerCollector

    pool = FakePool("good")
    p = CoSineProposer(ProposerSettings(speculation=_k(3), lookup=False), [pool])
    _decode_with(p, pool, 6, accept=len)
    registry = CollectorRegistry()
    registry.register(ProposerCollector(p.stats, model_name="m"))
    text = generate_latest(registry).decode()
    assert 'cosine_drafter_calls_total{model_name="m",pool="good"} 6.0' in text
    assert f'cosine_drafter_yield_tokens{{model_name="m",pool="good"}} {p.stats.pool_yield["good"]}' in text
    assert p.stats.pool_yield["good"] > 1.0
    p.close()


def test_every_request_probes_a_pool_on_its_first_step():
    """A pool that stopped paying (late or failing) is still asked on each new request's first
    step, so a restarted or recovered pool is found again even when requests are short."""
    pool = FakePool("p")
    p = CoSineProposer(ProposerSettings(speculation=_k(3), lookup=False, pool=PoolPolicy(probe_every=100)),
                       [pool])
    p.stats.pool_on_time["p"] = 0.0  # measured useless so far
    for i in range(5):
        before = pool.calls
        p.propose({f"r{i}": [1, 2, 3]})
        _wait(lambda b=before: pool.calls == b + 1)
        p.propose({f"r{i}": [1, 2, 3, 9]})  # second step: not a probe, and the pool does not pay
        time.sleep(0.05)
        assert pool.calls == before + 1
        p.retain(set())
    p.close()


class BranchingPool(FakePool):
    """Drafts past `expected` (ctx[-1]+1, ... after it) and, at each of its first `max_branches`
    positions i, from expected[:i] + 100 + i: what a llama.cpp pool returns."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.asked: list[tuple[tuple[int, ...], int]] = []

    def propose(self, request_id, context_ids, max_tokens, *, min_confidence=0.0, expected=(),
                max_branches=0) -> Draft:
        self.asked.append((tuple(expected), max_branches))
        last = expected[-1] if expected else context_ids[-1]
        main = tuple(last + 1 + i for i in range(max_tokens))
        branches = tuple(DraftBranch(i, tuple(100 + i + j for j in range(max_tokens)), (0.5,) * max_tokens)
                         for i in range(min(max_branches, len(expected))))
        return Draft(main, (0.9,) * max_tokens, self.name, 0.0, prefix_len=len(expected), branches=branches)


def test_pool_drafts_past_the_draft_being_verified_and_from_its_rejection_points():
    def pool_and_first_draft():
        pool = BranchingPool("coder")
        p = CoSineProposer(ProposerSettings(speculation=_k(3), lookup=False, pool=PoolPolicy(branches=2)), [pool])
        assert p.propose({"r": [1, 2, 3]}) == {"r": []}
        _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
        assert p.propose({"r": [1, 2, 3, 4]}) == {"r": [5, 6, 7]}  # verified now; the pool is asked meanwhile
        _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
        assert pool.asked[-1] == ((5, 6, 7), 2)
        return p

    # all three accepted, then the target's own token 8: the main draft continues
    assert pool_and_first_draft().propose({"r": [1, 2, 3, 4, 5, 6, 7, 8]}) == {"r": [9, 10, 11]}
    # 5 accepted, 6 rejected and the target emitted 101 instead: the branch at position 1 continues
    assert pool_and_first_draft().propose({"r": [1, 2, 3, 4, 5, 101]}) == {"r": [102, 103, 104]}
    # a rejection point the pool did not draft from: nothing usable, on time but off the context
    p = pool_and_first_draft()
    assert p.propose({"r": [1, 2, 3, 4, 5, 6, 99]}) == {"r": []}
    assert p.stats.pool_on_time["coder"] == 1.0 and p.stats.pool_on_context["coder"] < 1.0


def test_pool_asks_are_sized_from_the_pools_measured_speed_to_come_back_within_a_step():
    pool = BranchingPool("coder")
    s = ProposerSettings(speculation=_k(8), lookup=False, pool=PoolPolicy(branches=2))
    p = CoSineProposer(s, [pool])
    p.observe_step(StepRecord(1.0, 1))  # a verifier step takes 1 s
    asks = []
    real = p.pools._draft_on_pool
    p.pools._draft_on_pool = lambda name, rid, ctx, k, expected=(), branches=0, **kw: (
        asks.append((k, branches)), real(name, rid, ctx, k, expected, branches, **kw))[1]
    ctx = [1, 2, 3]
    # 0.8 s of a 1 s step: 20, 8, 4 draft tokens in all; a pool slower than the step (0.5 s a token,
    # 2.5 s a call) drafts one long chain instead, past the 3 steps the target runs meanwhile
    for token_s, want in [(0.04, (6, 2)), (0.09, (4, 1)), (0.19, (4, 0)), (0.5, (11, 0))]:
        p.stats.pool_token_s["coder"] = token_s
        p.stats.pool_rtt_s["coder"] = 2.5 if token_s == 0.5 else 0.5
        req = p._requests.get("r") or p._new_request("r", ctx)
        req.inflight.clear()
        req.steps = 1  # a probe step: asked whatever the estimates say
        p._request_pool_drafts("r", req, ctx, [4, 5, 6])
        _wait(lambda r=req: all(f.done() for f in r.inflight.values()))
        assert asks[-1] == want, token_s
    # every answered call is measured (a BranchingPool answers at once: the estimate falls)
    assert p.stats.pool_token_s["coder"] < 0.5


def test_prefetch_asks_the_pools_with_the_prompt_before_the_first_step():
    pool = BranchingPool("coder")
    p = CoSineProposer(ProposerSettings(speculation=_k(3), lookup=False), [pool])
    p.prefetch("r", [1, 2, 3])  # the target starts prefilling [1, 2, 3]
    _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
    assert pool.asked == [((), 0)]
    # the prefill emitted 4, the pool's own first token: its draft serves the first decode step
    assert p.propose({"r": [1, 2, 3, 4]}) == {"r": [5, 6, 7]}
    p.prefetch("r", [1, 2, 3])  # known: not asked again
    _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
    assert len(pool.asked) == 2  # the first step's ask only
    p.release("r")
    _wait(lambda: pool.released == ["r"])


def test_drafts_never_reach_past_the_verifiers_context_limit():
    """As vLLM's own proposers clamp (`ngram_proposer`: k <= max_model_len - num_tokens): a request
    of n tokens gets at most max_model_len - n - 1 draft tokens (the step computes them and a
    bonus token), none at the limit."""
    s = ProposerSettings(speculation=_k(4), lookup=True, max_model_len=40)
    p = CoSineProposer(s, [])
    ctx = [1, 2, 3, 4, 5] * 7  # 35 tokens that repeat: lookup drafts the full k
    for _ in range(3):
        p.propose({"r": ctx})
    assert len(p.propose({"r": ctx})["r"]) == 4
    assert len(p.propose({"r": ctx + [1, 2]})["r"]) == 40 - 37 - 1
    assert p.propose({"r": ctx + [1, 2, 3, 4]})["r"] == []
    p.close()


def test_a_request_whose_own_drafts_fail_stops_while_its_domain_goes_on():
    """Calibration is per request too, with its domain's as the prior: of two chat requests on
    the same tree match, the one whose drafts the target rejects stops drafting, the one whose
    drafts it accepts keeps its full draft."""
    p = CoSineProposer(ProposerSettings(speculation=_k(4)))
    good, bad = [1, *REPEAT], [2, *REPEAT]
    lens: dict[str, list[int]] = {"good": [], "bad": []}
    for _ in range(8):
        d = p.propose({"good": good, "bad": bad}, {"good": 14, "bad": 14})
        for rid in d:
            lens[rid].append(len(d[rid]))
        outcomes = (RequestOutcome("good", len(d["good"]), len(d["good"]), p.source_of("good")),
                    RequestOutcome("bad", len(d["bad"]), 0, p.source_of("bad")))
        n = 2 + len(d["good"]) + len(d["bad"])
        p.observe_step(StepRecord(0.1 + 0.005 * n, n, outcomes))
    assert lens["bad"][-3:] == [0, 0, 0] and lens["good"][-3:] == [4, 4, 4]
    assert p.calibration(LOOKUP, "chat", "bad") < 0.25 < p.calibration(LOOKUP, "chat") < p.calibration(
        LOOKUP, "chat", "good")


def test_stats_writes_from_many_threads_all_count():
    """Catches: unlocked read-modify-writes of the stats from the pool calls' threads (lost
    increments), and a scrape that reads while they write."""
    from concurrent.futures import ThreadPoolExecutor

    from cosine.proposer_stats import ProposerStats

    stats = ProposerStats()

    def work(i: int) -> None:
        for _ in range(2000):
            stats.add(stats.pool_calls, f"p{i % 2}")
            stats.observe_step(0.001, 1, i % 2 == 0)
            stats.snapshot()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))
    assert stats.pool_calls == {"p0": 4000, "p1": 4000} and stats.steps == 8000 and stats.steps_with_draft == 4000


def test_on_time_and_on_context_shares_are_kept_apart():
    """A pool whose drafts arrive in time but continue a context the target left: on time, off context."""
    pool = FakePool("coder", rule=lambda ctx, k: [7777 + i for i in range(k)])
    p = CoSineProposer(ProposerSettings(speculation=_k(3), lookup=False, pool=PoolPolicy(probe_every=1)), [pool])
    ctx = [1, 2, 3]
    for _ in range(30):
        p.propose({"r": ctx})
        _wait(lambda: all(f.done() for f in p._requests["r"].inflight.values()))
        ctx = ctx + [ctx[-1] + 1]  # the target never emits the pool's tokens
    assert p.stats.pool_on_time["coder"] > 0.9 and p.stats.pool_on_context["coder"] < 0.5
    p.close()
