"""Validation: the simulator, on costs measured on this machine, predicts a recorded bench run."""

from pathlib import Path

import pytest

from cosine.simulation import scenarios

BENCH = Path(__file__).parent / "data" / "bench_issue6.json"


@pytest.fixture(scope="module")
def validation():
    return scenarios.validation(BENCH)


def test_throughput_within_15_percent_at_concurrency_1_4_8(validation):
    rows = [r for r in validation["rows"] if r["concurrency"] in (1, 4, 8)]
    assert len(rows) == 6
    for r in rows:
        assert abs(r["error"]) <= 0.15, r


def test_target_only_p50_within_15_percent_of_littles_law(validation):
    # the note recorded throughput only; a closed loop of equal-length requests has mean latency
    # concurrency * max_tokens / throughput (Little's law), and for target-only p50 ~ mean
    for r in validation["rows"]:
        if r["system"] == "target-only" and r["concurrency"] in (1, 4, 8):
            assert r["simulated_p50_s"] == pytest.approx(r["derived_latency_s"], rel=0.15), r


def test_scaling_figures_count_flaps():
    from cosine.operator.autoscaling import PoolLimits, ScalingPolicy
    from cosine.simulation.cluster import SimResult

    res = SimResult(replicas_timeline={"a": [(0.0, 3), (30.0, 5), (60.0, 4), (90.0, 6), (700.0, 6)]})
    figs = scenarios._scaling_figures(res, ScalingPolicy((PoolLimits("a", 3, 8),)), 30.0, 600.0, 2)
    assert figs["flaps"] == 2 and figs["bound_violations"] == 0
    assert figs["convergence_intervals_max"] == 2.0
