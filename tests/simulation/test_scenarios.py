"""The studies: the autoscaler's figures and its behaviour under a load step."""

import json
import statistics
from pathlib import Path

import pytest

from cosine.simulation import config, scenarios, tables
from cosine.simulation.cluster import LookupModel, RequestSpec, Workload


def test_scaling_figures_count_flaps():
    from cosine_spec.autoscaling import PoolLimits, ScalingPolicy

    from cosine.simulation.cluster import SimResult

    res = SimResult(replicas_timeline={"a": [(0.0, 3), (30.0, 5), (60.0, 4), (90.0, 6), (700.0, 6)]})
    figs = scenarios._scaling_figures(res, ScalingPolicy((PoolLimits("a", 3, 8),)), 30.0, 600.0, 2)
    assert figs["flaps"] == 2 and figs["bound_violations"] == 0
    assert figs["convergence_intervals_max"] == 2.0


def _autoscale_shared_pools(profiles=None, duration_s: float = 360.0, rate: float = 2.0,
                            start_replicas: int = 6, min_replicas: int = 2, seed: int = 0):
    """The scenario of the test below (no study runs it). Pools that keep up (Qwen2.5-0.5B on
    L4s, 4 requests drafted at once per replica) started over-provisioned at `start_replicas`
    behind 2 DeepSeek-R1-Distill-Qwen-32B verifiers, under a light steady load: the autoscaler
    takes each pool down to `min_replicas` in steps of at most `maxScaleDownStep`, while the
    proposer spreads each pool's requests over its replicas (least held first) and re-homes those
    of a replica that leaves. Reports the replica timelines, the draft calls each replica served,
    re-homes, and `_scaling_figures`."""
    profiles = profiles or scenarios.load_profiles()
    m = scenarios._pair_manifest("qwen-32b", "cosine")
    for p in m["spec"]["drafterPools"]:
        p.update(replicas=start_replicas, minReplicas=min_replicas, maxReplicas=4 * start_replicas)
    m["spec"]["verifier"]["replicas"] = 2
    m["spec"]["autoscaling"] = {"enabled": True, "intervalSeconds": 30, "stabilizationSeconds": 60,
                                "maxScaleDownStep": 2}
    for p in m["simulation"]["pools"].values():
        p.update(hardware="l4", slots=4)
    setup, _ = scenarios.config.build_setup(m, profiles, seed=seed)
    assert setup.scaling is not None
    trace = scenarios._rate_trace(lambda t: rate, duration_s, 256, 64, seed)
    res = scenarios.simulate(setup, scenarios.Workload(trace), duration_s=duration_s)
    return (scenarios._scaling_figures(res, setup.scaling, setup.interval_s, duration_s, 1) | res.summary()
            | {"timeline": res.replicas_timeline, "replica_calls": res.replica_calls})


def test_over_provisioned_pools_shrink_while_replicas_share_the_load():
    """The operator's policy, in simulation, on pools whose replicas share load the way the
    proposer spreads it (`pool_policy.assign_replica`): pools started at 6 replicas under light
    load shrink to their minimum of 2, at most 2 replicas a step, without reversing; while they
    had several replicas, several of them served draft calls."""
    out = _autoscale_shared_pools(duration_s=300, rate=2.0, start_replicas=6, min_replicas=2)
    assert out["flaps"] == 0 and out["bound_violations"] == 0
    for name, tl in out["timeline"].items():
        assert tl[0][1] == 6 and tl[-1][1] == 2, (name, tl)
        calls = out["replica_calls"][name]
        assert sum(1 for c in calls if c > 0) >= 2, (name, calls)  # the load was shared
    # the pools keep up: late drafts are (almost only) each request's first step, whose ask carried
    # its whole prompt (the proposer's prefetch) and is still drafting when the target's prefill ends
    assert out["draft_tokens"] > 0 and out["drafts_late"] < 1.1 * out["requests"] * len(out["timeline"])


def test_load_step_study_brings_the_zero_pool_back_and_marks_the_slow_one():
    """The autoscale study, short: the GPU pool that starts at zero comes back within the first
    decisions where a replica pays (the best fixed size is not zero) and stays at zero where none
    does, the CPU pool behind a GPU verifier is marked too slow (and held, not grown), and the
    rule's tokens per dollar are within 2% of the best fixed size's."""
    out = scenarios.autoscale_step(phase_s=90.0, fixed_gpu=(0, 1), token_value_per_million_usd=5.0)
    if out["best_fixed_gpu_replicas"]:
        assert out["zero_pool_returned_s"] is not None and out["zero_pool_returned_s"] <= 60.0
    else:  # open loop: the tokens are the load's, and the replica adds less than its price
        assert out["zero_pool_returned_s"] is None
    assert out["tokens_per_usd_vs_best_fixed"] >= 0.98
    assert "cpu:PoolTooSlow" in out["conditions"] and "gpu:PoolTooSlow" not in out["conditions"]
    assert all(n == 1 for _, n in out["timeline"]["cpu"])
    assert out["bound_violations"] == 0


ROOT = Path(__file__).resolve().parents[2]


# The default run computes one workload of one pair of the paper study (both levels: 2 of its 12
# cells); the whole study runs with -m slow. A cell depends on nothing but its pair, workload and
# level (its requests are drawn from a generator seeded by its workload), so the one pair's
# workload's tables are the docs' rows for it.
PAPER_WORKLOAD, PAPER_PAIR = "qa", "qwen-32b"


@pytest.fixture(scope="module")
def paper():
    return scenarios.paper_testbed(workloads=(PAPER_WORKLOAD,), pairs=(PAPER_PAIR,))


def test_the_paper_tables_in_the_docs_are_the_study_output(paper):
    """docs/simulation.md and the README show what `cosine simulate --studies paper --tables`
    writes for this pair and workload, nothing copied by hand (the simulator is deterministic): its
    table, with what each part adds, and its summary row."""
    docs = (ROOT / "docs" / "simulation.md").read_text()
    section = tables.paper_markdown(paper).strip()
    assert section.startswith(f"**{PAPER_PAIR}, {PAPER_WORKLOAD}**") and section in docs, section
    readme = (ROOT / "README.md").read_text()
    rows = tables.paper_summary_markdown(paper).strip().splitlines()[2:]  # below the header
    assert len(rows) == 1 and rows[0].startswith(f"| {PAPER_PAIR} | {PAPER_WORKLOAD} |")
    for row in rows:
        assert row in readme.splitlines(), row


@pytest.mark.slow
def test_the_whole_paper_study_is_in_the_docs():
    """Every workload's tables (about a minute on two cores): the docs' blocks are the study's output."""
    study = scenarios.paper_testbed()
    assert set(study["pairs"][next(iter(scenarios.PAIRS))]) == set(scenarios.WORKLOADS)
    docs = (ROOT / "docs" / "simulation.md").read_text()
    assert tables.replace_block(docs, "paper", tables.paper_markdown(study)) == docs
    readme = (ROOT / "README.md").read_text()
    assert tables.replace_block(readme, "paper-summary", tables.paper_summary_markdown(study)) == readme


def test_paper_study_runs_what_users_run(paper):
    """Every system is what a user would run, on each workload and level: EAGLE-3 at its best k;
    `cosine` as served drafts from the same head, lookup and pools, fused; each ablation drops one
    part and each part's gain is reported; lookup's figures differ by domain (measured on reference
    replies); ratios are the rows' own."""
    for workloads in paper["pairs"].values():
        assert set(workloads) == {PAPER_WORKLOAD}
        for levels in workloads.values():
            assert set(levels) == {"16", "64"}
            for rows in levels.values():
                assert set(scenarios.PAPER_SYSTEMS) <= set(rows)
                assert rows["eagle3"]["draft_len"] in scenarios.EAGLE3_K
                assert rows["eagle3-best"]["mean_accepted_per_step"] > rows["eagle3"]["mean_accepted_per_step"]
                assert rows["cosine-head"]["mean_accepted_per_step"] > rows["lookup"]["mean_accepted_per_step"]
                for system in scenarios.COSINE_SYSTEMS:
                    assert rows["ratios"][system]["vs_eagle3"] == pytest.approx(
                        rows[system]["tok_s_per_usd_h"] / rows["eagle3"]["tok_s_per_usd_h"])
                for part, without in scenarios.ABLATIONS.items():
                    assert rows["gains"][part] == pytest.approx(
                        rows["cosine"]["tok_s_per_usd_h"] / rows[without]["tok_s_per_usd_h"] - 1)
                # pools that add next to nothing beside the head and lookup: held at one replica they
                # cost their price; autoscaled (minReplicas 0) they go to zero at the first decision
                auto = rows["autoscaled"]
                assert rows["ratios"]["cosine"]["vs_cosine_head"] < 0.97 < 0.98 <= auto["vs_cosine_head"]
                assert all(tuple(tl[1]) == (30.0, 0) for tl in auto["pool_replicas"].values())  # the first decision
    setups = scenarios.paper_setups("llama-70b", scenarios.load_profiles(),
                                    Workload((RequestSpec(0.0, 256, 16, "chat"),) * 4, 4))
    head = setups["cosine"].engine_drafter
    assert head is not None and head.name == setups["eagle3"].engine_drafter.name == "eagle3"
    assert setups["cosine"].acceptance.mean("eagle3", "chat") == setups["eagle3"].acceptance.mean("eagle3", "chat")
    assert setups["cosine"].lookup is not None and setups["cosine"].pools
    assert setups["cosine-head"].pools == () and setups["cosine-head"].engine_drafter is head
    assert setups["cosine-no-head"].engine_drafter is None and setups["cosine-no-head"].pools == setups["cosine"].pools
    assert setups["cosine-no-lookup"].lookup is None and setups["cosine-no-lookup"].engine_drafter is head
    # vLLM's eagle3 and target-only keep async scheduling, lookup (vLLM's suffix) runs without; CoSine
    # serves through the model runner: async scheduling on, its proposer beside the GPU's step,
    # lookup on the device at its kernels' time a step (or a step stale from the process, free of it)
    assert setups["eagle3"].async_scheduling and setups["target-only"].async_scheduling
    assert not setups["lookup"].async_scheduling
    for system in ("cosine", "cosine-head", "cosine-no-head", "cosine-no-lookup", "cosine-head-lookup-stale"):
        s = setups[system]
        assert s.async_scheduling and s.proposer_overlapped and s.verifier.sync_step_s == 0, system
    assert setups["cosine-head"].verifier.device_lookup_step_s == scenarios.DEVICE_LOOKUP_STEP_S > 0
    assert setups["cosine-no-lookup"].verifier.device_lookup_step_s == 0
    stale = setups["cosine-head-lookup-stale"]
    assert stale.lookup_anchored and stale.verifier.device_lookup_step_s == 0 and not setups["cosine"].lookup_anchored
    old = setups["cosine-head-scheduler-seam"]  # what CoSine served through before: V1's scheduler
    assert not old.async_scheduling and not old.proposer_overlapped
    assert old.verifier.sync_step_s == scenarios.SYNC_STEP_S
    assert old.engine_drafter is head and old.lookup is not None and not old.lookup_anchored
    assert old.verifier.proposer_step_s(64) == setups["cosine-head"].verifier.proposer_step_s(64) > 0
    hit_chat, _ = setups["lookup"].lookup.on("chat")
    assert setups["lookup"].acceptance.mean("lookup", "chat") < setups["lookup"].acceptance.mean("lookup", "math")
    assert 0 < hit_chat < 1


def test_spot_study_prices_preempts_and_rehomes():
    """A short spot study (one target, a preemption rate high enough to see in two minutes): spot
    pools cost less per hour than on-demand ones, are preempted, their requests re-homed, and
    every system of the study is reported with a winner per dollar."""
    target = next(iter(scenarios.SPOT_TARGETS))
    out = scenarios.spot_study(concurrency=(16,), duration_s=120.0, preemptions_per_replica_hour=60.0,
                               replacement_s=30.0, targets=(target,))
    level = out["targets"][target]["16"]
    assert set(scenarios.SPOT_SYSTEMS) <= set(level) and level["winner"] in scenarios.SPOT_SYSTEMS
    spot, on_demand = level["cosine-spot"], level["cosine"]
    assert spot["preemptions"] >= 1 and spot["rehomed_requests"] >= 1 and on_demand["preemptions"] == 0
    assert spot["usd_per_hour"] < on_demand["usd_per_hour"]
    assert level["target-only"]["usd_per_hour"] == pytest.approx(level["eagle3"]["usd_per_hour"])  # no pool charged
    assert level["cosine-head"]["usd_per_hour"] == pytest.approx(level["eagle3"]["usd_per_hour"])
    assert f"Winner per dollar: `{level['winner']}`" in tables.spot_markdown(out)


@pytest.mark.slow
def test_the_spot_table_in_the_docs_is_the_study_output():
    """docs/simulation.md shows what `cosine simulate --studies spot --tables` writes (minutes)."""
    docs = (ROOT / "docs" / "simulation.md").read_text()
    assert tables.replace_block(docs, "spot", tables.spot_markdown(scenarios.spot_study())) == docs


@pytest.mark.slow
def test_the_routing_table_in_the_docs_is_the_study_output():
    """docs/simulation.md shows what `cosine simulate --studies affinity --tables` writes (30 s);
    and what the table says holds: keeping conversations together fills the prefix cache and
    halves TTFT, is worth more per dollar than random spreading, and leaves the acceptance length
    where it was (lookup indexes the history in every prompt)."""
    study = scenarios.affinity_study(seen_hit_factor=scenarios.SEEN_HIT_FACTOR)
    docs = (ROOT / "docs" / "simulation.md").read_text()
    assert tables.replace_block(docs, "affinity", tables.affinity_markdown(study)) == docs
    for system in scenarios.AFFINITY_SYSTEMS:
        rand, aff = study["rows"][f"{system} / random"], study["rows"][f"{system} / affinity"]
        assert aff["prefix_cache_hit_fraction"] > 2 * rand["prefix_cache_hit_fraction"]
        assert aff["ttft_p50_s"] < 0.7 * rand["ttft_p50_s"] and aff["per_usd_vs_random"] > 0.05
        assert aff["acceptance_length"] == pytest.approx(rand["acceptance_length"], abs=0.05)


def test_lookup_drafts_its_measured_mean_length_and_is_accepted_as_measured():
    """Simulated lookup drafts the measured mean length on average (two whole lengths around it),
    so at the fitted per-token acceptance its accepted tokens per draft are the measured ones:
    rounding code's 4.40 tokens to 4 gave 3.12 against the measured 3.37."""
    model, means = scenarios.lookup_on_references()
    raw = json.loads(scenarios.LOOKUP_ON_REFERENCES.read_text())["domains"]
    for domain, r in raw.items():
        mean_tokens = model.on(domain)[1]
        assert mean_tokens == pytest.approx(r["mean_draft_tokens"]), domain
        lengths = [LookupModel.draft_len(mean_tokens, (i + 0.5) / 1000) for i in range(1000)]
        assert statistics.mean(lengths) == pytest.approx(mean_tokens, abs=0.002) and max(lengths) - min(lengths) <= 1
        alpha = means[("lookup", domain)]
        accepted = statistics.mean(sum(alpha ** (j + 1) for j in range(n)) for n in lengths)
        assert accepted == pytest.approx(r["accepted_per_draft"], rel=0.04), domain
    assert LookupModel.draft_len(0.2, 0.9) == 1 and LookupModel.draft_len(3.0, 0.99) == 3


def test_the_proposer_prices_pool_asks_from_the_manifest():
    """The simulated proposer prices an ask as the served one does, from the manifest: the
    autoscaling section's value on accepted tokens and each pool's replica price (a pool priced 0
    in the spec at its hardware's list price); the paper study values a token at what the
    verifier alone spends on one at the study's concurrency."""
    m = scenarios._pair_manifest("qwen-32b", "cosine", domains=("chat",), token_value_usd=2e-6)
    setup = config.build_setup(m, scenarios.load_profiles())[0]
    assert setup.pool_policy.token_value_usd == pytest.approx(2e-6)
    assert setup.pool_policy.pool_prices == (("chat", setup.pools[0].price_per_hour_usd),)
    assert setup.pool_policy.pool_prices[0][1] > 0
    m["spec"]["drafterPools"][0]["pricePerHourUsd"] = 0.5
    assert config.build_setup(m, scenarios.load_profiles())[0].pool_policy.pool_prices == (("chat", 0.5),)
    setups = scenarios.paper_setups("qwen-32b", scenarios.load_profiles(),
                                    Workload((RequestSpec(0.0, 256, 16, "chat"),) * 4, 4), domains=("chat",))
    v = setups["target-only"].verifier
    assert setups["cosine"].pool_policy.token_value_usd == pytest.approx(
        v.price_per_hour_usd / 3600 * v.pass_s(4, 4 * 320) / 4)
    assert setups["cosine-head"].pools == ()
