"""The studies: the autoscaler's figures and its behaviour under a load step."""

import pytest

from cosine.simulation import scenarios


def test_scaling_figures_count_flaps():
    from cosine.simulation.cluster import SimResult
    from cosine_operator.autoscaling import PoolLimits, ScalingPolicy

    res = SimResult(replicas_timeline={"a": [(0.0, 3), (30.0, 5), (60.0, 4), (90.0, 6), (700.0, 6)]})
    figs = scenarios._scaling_figures(res, ScalingPolicy((PoolLimits("a", 3, 8),)), 30.0, 600.0, 2)
    assert figs["flaps"] == 2 and figs["bound_violations"] == 0
    assert figs["convergence_intervals_max"] == 2.0


@pytest.mark.xfail(reason="the proposer now asks a pool only where its drafts pay (pool_pays, on time): this study's "
                   "CPU pools (~30 ms a token) are always late for a GPU verifier, so they are rarely asked and never "
                   "busy enough to grow; the study needs pools that keep up (open, issue 18)", strict=False)
def test_pools_track_a_load_step():
    """The operator's policy, in simulation: pools stay at minReplicas under light load and grow
    when the load steps up, without reversing direction (the verifier-busy signal moved them
    against the load under continuous batching; the pools' own busy fraction follows it)."""
    out = scenarios.autoscale_at_scale(phase_s=120, rates=(1, 8), max_replicas=12, verifier_replicas=2)
    steps = out["steps"]
    assert steps["flaps"] == 0 and steps["bound_violations"] == 0
    for name, tl in steps["timeline"].items():
        light = [n for t, n in tl if t < 120]
        assert max(light) == 3, (name, tl)  # minReplicas while the load is light
        assert tl[-1][1] > 3, (name, tl)  # grown under the heavy phase
