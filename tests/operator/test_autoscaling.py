"""The scaling policy with plain numbers (no kopf, no HTTP, no clock)."""

from __future__ import annotations

from cosine_operator.autoscaling import (
    Observations,
    PoolLimits,
    PoolObservation,
    ScalerState,
    ScalingPolicy,
    VerifierObservation,
    desired_replicas,
)


def obs(
    util: float | None,
    replicas: int = 2,
    acceptance: float | None = 0.8,
    running: float = 4,
    draft_per_s: float = 200.0,
    verifier_util: float = 1.0,
) -> Observations:
    """One pool ("code") at pool busy fraction `util`; the verifier is busy (vLLM under load)."""
    return Observations(
        verifier=VerifierObservation(
            utilization=verifier_util, tokens_verified_per_s=100.0, requests_running=running, requests_waiting=0
        ),
        pools=(PoolObservation("code", replicas, replicas, draft_per_s, acceptance, 1.0, util),),
    )


POLICY = ScalingPolicy(
    pools=(PoolLimits("code", 1, 8),), target_utilization=0.7, stabilization_s=60, max_scale_down_step=1
)


def decide(
    o: Observations, policy: ScalingPolicy = POLICY, state: ScalerState | None = None, now_s: float = 0.0
):
    decisions, new_state = desired_replicas(o, policy, state or ScalerState(), now_s)
    return decisions[0], new_state


def test_saturated_pool_with_accepted_drafts_grows_by_the_hpa_rule() -> None:
    d, _ = decide(obs(util=1.0, replicas=3))
    assert d.desired == 5  # ceil(3 * 1.0 / 0.7)
    assert "growing" in d.reason


def test_busy_verifier_does_not_shrink_pools() -> None:
    """Under continuous batching the verifier is busy whenever requests run: not a reason to shrink."""
    d, _ = decide(obs(util=0.7, replicas=4, verifier_util=1.0))
    assert (d.current, d.desired) == (4, 4)


def test_saturated_pool_with_rejected_drafts_holds() -> None:
    d, _ = decide(obs(util=1.0, replicas=2, acceptance=0.1))
    assert d.desired == 2
    assert "acceptance 0.10" in d.reason


def test_idle_pool_shrinks_one_step_at_a_time() -> None:
    policy = ScalingPolicy(pools=(PoolLimits("code", 1, 8),), target_utilization=0.7, stabilization_s=0)
    d, _ = decide(obs(util=0.1, replicas=6), policy)
    assert d.desired == 5  # wants ceil(6 * 0.1 / 0.7) = 1, at most one replica per decision
    assert "shrinking" in d.reason and "limited to 1" in d.reason


def test_within_tolerance_band_holds() -> None:
    d, _ = decide(obs(util=0.74, replicas=3))
    assert (d.current, d.desired) == (3, 3)


def test_unmeasured_pool_holds() -> None:
    d, _ = decide(obs(util=None, replicas=3))
    assert d.desired == 3 and "not measured" in d.reason


def test_growth_is_clamped_to_max_and_to_the_scale_up_factor() -> None:
    policy = ScalingPolicy(pools=(PoolLimits("code", 1, 3), PoolLimits("chat", 1, 20)), target_utilization=0.5)
    o = Observations(
        verifier=VerifierObservation(1.0, 50.0, 8, 2),
        pools=(
            PoolObservation("code", 2, 2, 300.0, 0.9, 0.75, 1.0),
            PoolObservation("chat", 4, 4, 100.0, 0.9, 0.25, 1.0),
        ),
    )
    decisions, _ = desired_replicas(o, policy, ScalerState(), 0.0)
    by_pool = {d.pool: d.desired for d in decisions}
    assert by_pool["code"] == 3  # wants 2 * 1.0 / 0.5 = 4, clamped to max 3
    assert by_pool["chat"] == 8  # 4 * 2, the most one decision grows (max_scale_up_factor 2)


def test_no_load_drifts_to_min_one_step_at_a_time() -> None:
    policy = ScalingPolicy(pools=(PoolLimits("code", 1, 8),), stabilization_s=0, max_scale_down_step=1)
    d, _ = decide(obs(util=0.0, replicas=4, running=0), policy)
    assert d.desired == 3
    assert "limited to 1" in d.reason


def test_missing_verifier_metrics_hold() -> None:
    o = Observations(verifier=None, pools=(PoolObservation("code", 2, 2, 0.0, None, None, 0.9),))
    d, _ = decide(o)
    assert d.desired == 2 and "no verifier metrics" in d.reason


def test_scale_down_waits_for_the_stabilization_window() -> None:
    state = ScalerState()
    d, state = decide(obs(util=1.0, replicas=3), state=state, now_s=0.0)
    assert d.desired == 5
    d, state = decide(obs(util=0.3, replicas=5), state=state, now_s=10.0)
    assert d.desired == 5 and "stabilization window" in d.reason
    d, state = decide(obs(util=0.3, replicas=5), state=state, now_s=70.0)  # the high one aged out
    assert d.desired == 4


def test_flapping_input_does_not_flap_the_output() -> None:
    state, replicas, changes = ScalerState(), 2, []
    for tick in range(40):
        util = 1.0 if tick % 2 == 0 else 0.3  # pool busy fraction alternating around the target
        d, state = decide(obs(util=util, replicas=replicas), state=state, now_s=tick * 5.0)
        if d.desired != replicas:
            changes.append(d.desired - replicas)
        replicas = d.desired
    directions = [c > 0 for c in changes]
    flips = sum(1 for a, b in zip(directions, directions[1:], strict=False) if a != b)
    assert flips == 0, changes  # it may only go one way while the input alternates
    assert replicas <= 8
