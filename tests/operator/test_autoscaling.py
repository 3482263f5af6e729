"""The scaling rule with plain numbers (no kopf, no HTTP, no clock): demand, capacity, cost."""

from __future__ import annotations

import dataclasses

import pytest

from cosine_operator.autoscaling import (
    Observations,
    PoolLimits,
    PoolObservation,
    ScalerState,
    ScalingPolicy,
    VerifierObservation,
    desired_replicas,
    fit_rounds,
)

STEP_S = 0.1  # the verifier's engine step


def verifier(running: float = 8, step_s: float | None = STEP_S) -> VerifierObservation:
    return VerifierObservation(step_s=step_s, tokens_verified_per_s=100.0, requests_running=running,
                               requests_waiting=0)


def pool(replicas: int = 1, asks: float = 0.0, late: float = 0.0, skipped: dict[str, float] | None = None,
         round_s: float | None = 0.02, batch: float | None = 1.0, rtt_s: float | None = 0.03,
         accepted: float = 0.0, yield_tokens: float | None = 2.0, ready: int | None = None,
         samples: bool = True) -> PoolObservation:
    """Pool "code"; rates in events per second (at STEP_S, 10 steps/s: `asks=40` is 4 requests per step)."""
    return PoolObservation("code", replicas, replicas if ready is None else ready, asks_per_s=asks, late_per_s=late,
                           skipped_per_s=skipped or {}, accepted_tokens_per_s=accepted, round_s=round_s,
                           batch=batch, rtt_s=rtt_s, yield_tokens=yield_tokens, drafter_samples=samples)


POLICY = ScalingPolicy(pools=(PoolLimits("code", 1, 8),), stabilization_s=60, max_scale_down_step=1)


_BUSY = verifier()


def decide(p: PoolObservation, v: VerifierObservation | None = _BUSY, policy: ScalingPolicy = POLICY,
           state: ScalerState | None = None, now_s: float = 0.0):
    (d,), new_state = desired_replicas(Observations(v, (p,)), policy, state or ScalerState(), now_s)
    return d, new_state


def test_a_late_pool_grows() -> None:
    # 1 replica, rounds of 20 ms per request (a = 0 from one batch size), network 10 ms, step 100
    # ms: 4.5 requests on time per replica. Demand: 2 asks + 4 late steps + 2 skipped as late per
    # step = 8 requests per step -> 2 replicas. Its busy fraction would have fallen: it is asked less.
    d, _ = decide(pool(1, asks=20, late=40, skipped={"late": 20, "yield": 50}, round_s=0.09, batch=4.5))
    assert d.desired == 2 and d.condition is None, d
    assert "demand 8.00 requests per step" in d.reason


def test_skips_for_yield_are_not_demand() -> None:
    d, _ = decide(pool(2, asks=10, skipped={"yield": 500}))
    assert d.desired == 1, d  # one request per step fits one replica; the yield skips ask for nothing


def test_a_pool_whose_fixed_round_exceeds_the_step_holds_as_too_slow() -> None:
    points = ((1.0, 0.13, 0.15), (2.0, 0.14, 0.16))  # a = 120 ms, c = 10 ms: one request alone misses 100 ms
    state = ScalerState(rounds={"code": points})
    d, _ = decide(pool(2, asks=5, late=60, round_s=0.15, batch=3.0, rtt_s=0.17), state=state)
    assert (d.desired, d.condition) == (2, "PoolTooSlow"), d
    assert "round 120.0 ms + 10.0 ms per request" in d.reason and "verifier step 100.0 ms" in d.reason


def test_zero_with_demand_comes_back() -> None:
    policy = ScalingPolicy(pools=(PoolLimits("code", 0, 4),))
    d, _ = decide(pool(0, skipped={"down": 3}, round_s=None, batch=None, rtt_s=None, samples=False), policy=policy)
    assert (d.current, d.desired) == (0, 1), d
    assert "scaling from zero" in d.reason
    idle, _ = decide(pool(0, round_s=None, batch=None, samples=False), v=verifier(running=0), policy=policy)
    assert idle.desired == 0  # no demand: it stays at zero


def test_an_idle_pool_shrinks_one_step_at_a_time_after_the_window() -> None:
    idle = pool(4, round_s=None, batch=None)
    d, state = decide(idle, v=verifier(running=0, step_s=None), now_s=0.0)
    assert d.desired == 3 and "drifting to minReplicas" in d.reason  # the window only holds what it saw
    busy, state = decide(pool(3, asks=100), state=state, now_s=10.0)
    assert busy.desired == 3  # 10 requests per step at 4.5 per replica
    held, state = decide(dataclasses.replace(idle, replicas=3), v=verifier(running=0, step_s=None), state=state,
                         now_s=20.0)
    assert held.desired == 3 and "stabilization window" in held.reason
    later, _ = decide(dataclasses.replace(idle, replicas=3), v=verifier(running=0, step_s=None), state=state,
                      now_s=80.0)
    assert later.desired == 2


def test_a_replica_not_worth_its_price_is_not_added() -> None:
    # demand 8 per step at 4.5 per replica: 2 replicas would serve all of it. The second adds 3.5
    # asks per step = 35 asks/s x 0.5 accepted tokens per ask = 17.5 tokens/s.
    late_pool = pool(1, asks=40, late=40, round_s=0.09, batch=4.5, yield_tokens=0.5)
    cheap = ScalingPolicy(pools=(PoolLimits("code", 1, 8, price_per_hour_usd=1.0),), token_value_usd=1e-4)
    dear = ScalingPolicy(pools=(PoolLimits("code", 1, 8, price_per_hour_usd=10.0),), token_value_usd=1e-4)
    assert decide(late_pool, policy=cheap)[0].desired == 2  # 17.5 tok/s x $1e-4 = $6.3/h > $1/h
    d, _ = decide(late_pool, policy=dear)
    assert d.desired == 1 and "worth less than its $10/h" in d.reason, d  # $6.3/h < $10/h


def test_missing_data_holds_and_never_shrinks() -> None:
    d, _ = decide(pool(3), v=None)
    assert (d.desired, d.condition) == (3, "MetricsMissing") and "cosine:verifier_steps_total" in d.reason
    d, _ = decide(pool(3, asks=5, round_s=None, batch=None, samples=False))
    assert (d.desired, d.condition) == (3, "MetricsMissing") and "cosine:drafter_rounds_total" in d.reason


def test_growth_is_clamped_to_the_bounds_and_the_scale_up_factor() -> None:
    d, _ = decide(pool(2, asks=400, round_s=0.02, batch=1.0))  # 40 per step at 4.5: 9, at most 2 x 2
    assert d.desired == 4
    policy = ScalingPolicy(pools=(PoolLimits("code", 1, 3),))
    assert decide(pool(2, asks=400), policy=policy)[0].desired == 3


def test_the_round_fit_separates_fixed_and_per_request_time() -> None:
    model = fit_rounds([(1.0, 0.03, 0.04), (3.0, 0.05, 0.07), (5.0, 0.07, 0.08)])
    assert model is not None
    assert model.fixed_s == pytest.approx(0.02) and model.per_request_s == pytest.approx(0.01)
    assert model.network_s == pytest.approx(0.01)
    assert model.on_time_batch(0.1) == pytest.approx(7.0)
    assert fit_rounds([]) is None


def test_flapping_demand_does_not_flap_the_output() -> None:
    state, replicas, history = ScalerState(), 4, []
    for i in range(12):  # demand swings between 12 and 4 requests per step every 10 s
        d, state = decide(pool(replicas, asks=120 if i % 2 else 40), state=state, now_s=10.0 * i)
        replicas = d.desired
        history.append(replicas)
    changes = [b - a for a, b in zip(history, history[1:], strict=False) if b != a]
    assert all(c > 0 for c in changes), history  # it grows to the peak and stays within the window


def test_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        PoolLimits("code", 3, 2)
    with pytest.raises(ValueError):
        PoolLimits("code", 0, 2, price_per_hour_usd=-1)
    with pytest.raises(ValueError):
        ScalingPolicy(pools=(), token_value_usd=-1.0)
