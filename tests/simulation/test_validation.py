"""The simulator against a recorded `cosine bench` run of today's system.

Data: `cosine/simulation/data/bench_session8.json` (shipped in the package), produced on this
project's 2-core CPU machine by
    cosine bench --workload results/mixed2-heldout3.jsonl --max-tokens 32 --concurrency 1,8
        --systems vllm,vllm-ngram,vllm-suffix,vllm-draft,cosine-lookup,cosine --placement split
(`data/bench_session8.meta.json`: the command, the machine, the prompts' token counts;
`data/mixed2-heldout3.jsonl`: the 11 prompts). Each system is calibrated on its own
concurrency-1 row (`calibration.calibrate`) and simulated with the row's own requests.

Achieved error of simulated output tokens/s against the measured (first run at each level),
mean of 5 seeds:
    concurrency 1 (in-sample: calibrated on the same run): vllm +0.0%, cosine-lookup -4.9%,
        cosine +5.7%;
    concurrency 8 (out of sample: nothing of the c=8 rows is used): vllm +7.8% (-0.6% against its
        second run, 4.39 tok/s), cosine-lookup +12.6%, cosine +15.2%.
(Before the proposer's sources became peers (a pool asked only where it beats the best local
source, unverified local candidates scored against the target): cosine +4.9% and +14.7%.)
(Before a pool's on-time share stopped counting looks at a draft left behind while the pool was
not asked: cosine +1.8% and +13.9%. The served proposer drafts more from its pool now, and the
simulator errs higher for it: the bench was recorded with the old proposer.)
(With a copy of the proposer's per-step glue, k from acceptance rates and a pool's usable share a
fixed `use_prob`: cosine-lookup -4.6% and +11.7%, cosine +5.1% and +12.5%. The simulator now runs
`CoSineProposer` itself; a pool draft is usable when it continues what the target accepted.
Before that, copying the pool policy too: cosine -0.1% and +14.7%.)
Tolerances: 10% in-sample (the model's structure only: decode passes priced flat, one prefill
line, acceptance as i.i.d. runs), 20% out of sample. 20% is what this data can honestly support:
the machine's own run-to-run spread is as large (vllm at c=1 ran at 1.39 and 0.78 tok/s in the
same session; at c=8 at 4.04 and 4.39), each row has 11 requests, and acceptance differs between
levels (cosine-lookup's 0.68 at c=1, 0.89 at c=8). The simulator errs high at c=8 for the CoSine
systems: it does not model the pool and the verifier competing for memory bandwidth more under
load, nor attention over the KV cache.
"""


import pytest

from cosine.simulation import calibration, scenarios

BENCH = calibration.KEPT_BENCH
TOLERANCE = {True: 0.10, False: 0.20}  # in_sample -> relative error of output tokens/s
# The simulated output tokens/s of each row (mean of the validation's seeds): deterministic, so a
# change that moves them is seen here, where the tolerances above (the machine's own spread)
# cannot see it. A deliberate change updates them, the docstring's errors and docs/simulation.md.
PINNED = {("vllm", 1): 1.3918, ("vllm", 8): 4.3573, ("cosine-lookup", 1): 1.1146, ("cosine-lookup", 8): 2.8719,
          ("cosine", 1): 1.4276, ("cosine", 8): 3.0843}


@pytest.fixture(scope="module")
def validation():
    return scenarios.validation(BENCH)


def test_throughput_per_system_and_concurrency(validation):
    rows = {(r["system"], r["concurrency"]): r for r in validation["rows"]}
    assert set(rows) == {(s, c) for s in ("vllm", "cosine-lookup", "cosine") for c in (1, 8)}
    for r in rows.values():
        assert abs(r["error"]) <= TOLERANCE[r["in_sample"]], r
    assert validation["command"].startswith("cosine bench --workload")


def test_the_simulated_figures_are_the_pinned_and_documented_ones(validation):
    """Catches: the simulator (the proposer it drives, its cost model, the calibration) moving its
    validation figures unnoticed: a 10% shift passes the tolerances, not this. The documented
    out-of-sample errors are today's, rounded."""
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "simulation.md").read_text()
    for r in validation["rows"]:
        assert r["simulated_tok_s"] == pytest.approx(PINNED[(r["system"], r["concurrency"])], rel=1e-3), r
        if not r["in_sample"]:
            assert f"{r['error']:+.0%} ({r['system']})" in docs, r


def test_speculation_ordering_is_reproduced(validation):
    """What the bench shows at c=1 (split placement: CoSine's verifier on one core), the simulator
    shows: cosine beats cosine-lookup; vllm on two cores beats both CoSine systems at c=8."""
    sim = {(r["system"], r["concurrency"]): r["simulated_tok_s"] for r in validation["rows"]}
    assert sim[("cosine", 1)] > sim[("cosine-lookup", 1)]
    assert sim[("vllm", 8)] > max(sim[("cosine", 8)], sim[("cosine-lookup", 8)])


def test_calibration_reads_the_bench():
    bench = calibration.load_bench(BENCH)
    vllm = calibration.calibrate(bench, "vllm", 1)
    assert vllm.run == 0 and vllm.pools == () and vllm.lookup_draft_tokens == 0
    assert vllm.decode_pass_s == pytest.approx(0.61, abs=0.01)  # ~ its TPOT p50, 0.62 s
    assert vllm.prefill_token_s == pytest.approx(0.026, abs=0.002)
    cos = calibration.calibrate(bench, "cosine", 1)
    assert [p.name for p in cos.pools] == ["coder"]
    coder = cos.pools[0]
    assert coder.draft_token_s == pytest.approx(0.143, abs=0.001) and coder.tokens_per_call == 10
    assert 0.0 < coder.use_prob < 1.0 and 0.5 < coder.alpha < 1.0
    assert 0.5 < cos.lookup_alpha < 1.0 and cos.lookup_draft_tokens == 5
    # the pass curve: flat (memory-bound) for a few tokens, then the prefill line
    assert cos.pass_s(1) == cos.pass_s(2) == cos.decode_pass_s
    assert cos.pass_s(512) == pytest.approx(cos.prefill_base_s + 512 * cos.prefill_token_s)


def test_fit_alpha_inverts_expected_accepted_tokens():
    a = calibration.fit_alpha(2.0, 4.0)
    assert sum(a**i for i in range(1, 5)) == pytest.approx(2.0, rel=1e-6)
    assert calibration.fit_alpha(0.0, 4.0) == 0.0 and calibration.fit_alpha(4.0, 4.0) == 1.0


def test_placement_evidence_from_a_split_bench_keeps_pools_off_two_cores(tmp_path):
    """The evidence `cosine serve --placement auto` weighs, read from a real 2-core split bench:
    the verifier's step on both cores (vllm's), on the one it keeps beside the pool (cosine's), the
    pool's and prompt lookup's acceptance. There the pool paid less than its core cost."""
    from cosine.placement import Evidence, choose
    from cosine.tooling.bench_results import CLUSTERS

    bench = calibration.load_bench(BENCH)
    ev = calibration.placement_evidence(bench, Evidence(cores=2, pool_cores=1, source="session 8"), CLUSTERS)
    assert ev.pass_s == pytest.approx(calibration.calibrate(bench, "vllm", 1).decode_pass_s)
    assert ev.kept_pass_s == pytest.approx(calibration.calibrate(bench, "cosine", 1).decode_pass_s)
    assert ev.kept_pass_s > ev.pass_s and 0 < ev.pool_alpha < 1 and 0 < ev.pool_use <= 1
    assert ev.draft_token_s > 0 and 0 < ev.lookup_hit < 1
    assert choose(ev).mode == "lookup"
    # `cosine bench` writes no meta file (prompt lengths): the decode figures are read all the same
    bare = tmp_path / "bench.json"
    bare.write_text(BENCH.read_text())
    ev_bare = calibration.placement_evidence(calibration.load_bench(bare), Evidence(cores=2, pool_cores=1), CLUSTERS)
    assert (ev_bare.pass_s, ev_bare.kept_pass_s, ev_bare.pool_alpha) == (ev.pass_s, ev.kept_pass_s, ev.pool_alpha)
    # a bench without a split CoSine row measures no pool: the pools stay off, unmeasured
    only_lookup = {**bench, "rows": [r for r in bench["rows"] if r["system"] != "cosine"]}
    assert calibration.placement_evidence(only_lookup, Evidence(cores=2, pool_cores=1), CLUSTERS).pool_alpha is None
