"""The scaling rule with plain numbers (no kopf, no HTTP, no clock): demand, capacity, cost."""

from __future__ import annotations

import dataclasses

import pytest
from cosine_spec.autoscaling import (
    Observations,
    PoolLimits,
    PoolObservation,
    ScalerState,
    ScalingPolicy,
    VerifierObservation,
    desired_replicas,
)

STEP_S = 0.1  # the verifier's engine step


def verifier(running: float = 8, step_s: float | None = STEP_S) -> VerifierObservation:
    return VerifierObservation(step_s=step_s, tokens_verified_per_s=100.0, requests_running=running,
                               requests_waiting=0)


def pool(replicas: int = 1, asks: float = 0.0, late: float = 0.0, skipped: dict[str, float] | None = None,
         u: float | None = 0.7, round_s: float | None = 0.02, batch: float | None = 4.0, accepted: float = 0.0,
         yield_tokens: float | None = 2.0, ready: int | None = None) -> PoolObservation:
    """Pool "code" at busy fraction `u`; rates in events per second."""
    return PoolObservation("code", replicas, replicas if ready is None else ready, asks_per_s=asks, late_per_s=late,
                           skipped_per_s=skipped or {}, accepted_tokens_per_s=accepted, round_s=round_s,
                           batch=batch, yield_tokens=yield_tokens, utilization=u, drafter_samples=u is not None)


POLICY = ScalingPolicy(pools=(PoolLimits("code", 1, 8),), stabilization_s=60, max_scale_down_step=1)


_BUSY = verifier()


def decide(p: PoolObservation, v: VerifierObservation | None = _BUSY, policy: ScalingPolicy = POLICY,
           state: ScalerState | None = None, now_s: float = 0.0):
    (d,), new_state = desired_replicas(Observations(v, (p,)), policy, state or ScalerState(), now_s)
    return d, new_state


def test_a_late_pool_grows() -> None:
    # asked 20/s, late on 40 steps/s, skipped as late 20/s: demand 80/s. Busy 0.9 serving 20/s, it
    # would be busy 3.6 serving all: 6 replicas at 0.7, at most twice its size per decision. Its
    # busy fraction alone (0.9 of what it is asked) is what the old rule read, and it falls as
    # the proposer asks it less.
    d, _ = decide(pool(1, asks=20, late=40, skipped={"late": 20, "yield": 50}, u=0.9))
    assert (d.desired, d.condition) == (2, None), d
    assert "demand 80.0/s, served 20.0/s" in d.reason and d.reason.endswith("growing")


def test_within_the_tolerance_band_nothing_changes() -> None:
    d, _ = decide(pool(3, asks=40, late=2, u=0.7))  # 0.735 were all served: within 10 % of 0.7
    assert (d.desired, d.reason.endswith("within tolerance")) == (3, True), d


def test_skips_for_yield_are_not_demand() -> None:
    d, _ = decide(pool(2, asks=10, skipped={"yield": 500}, u=0.2))
    assert d.desired == 1, d  # 2 x 0.2 / 0.7 -> 1; the yield skips ask for nothing


def test_a_pool_asked_only_to_probe_goes_down_to_zero() -> None:
    """Asks made only on requests' probe steps (`probes_per_s`, skipped as yield else) are no
    demand: a pool asked for nothing more, with minReplicas 0, goes to zero, however busy its
    probes keep it (a pool that does not pay stops costing)."""
    policy = ScalingPolicy(pools=(PoolLimits("code", 0, 4),), stabilization_s=0)
    probed = dataclasses.replace(pool(1, asks=6, skipped={"yield": 42}, u=0.5), probes_per_s=6)
    d, _ = decide(probed, policy=policy)
    assert (d.current, d.desired) == (1, 0), d
    assert "none wants this pool's drafts" in d.reason
    asked = dataclasses.replace(probed, probes_per_s=3)  # half its asks paid: demand 3/s
    assert decide(asked, policy=policy)[0].desired == 1


def test_a_pool_late_even_at_one_request_per_round_holds_as_too_slow() -> None:
    d, _ = decide(pool(2, asks=5, late=60, u=1.0, round_s=0.15, batch=1.0))
    assert (d.desired, d.condition) == (2, "PoolTooSlow"), d
    assert "92% of its demand late at 1.00 requests per round (round 150 ms, verifier step 100 ms)" in d.reason


def test_zero_with_demand_comes_back() -> None:
    policy = ScalingPolicy(pools=(PoolLimits("code", 0, 4),))
    d, _ = decide(pool(0, skipped={"down": 3}, u=None, round_s=None, batch=None), policy=policy)
    assert (d.current, d.desired) == (0, 1), d
    assert "scaling from zero" in d.reason
    idle, _ = decide(pool(0, u=None, round_s=None, batch=None), v=verifier(running=0), policy=policy)
    assert idle.desired == 0  # no demand: it stays at zero


def test_an_idle_pool_shrinks_one_step_at_a_time_after_the_window() -> None:
    idle = pool(4, u=0.0)
    d, state = decide(idle, v=verifier(running=0, step_s=None), now_s=0.0)
    assert d.desired == 3 and "drifting to minReplicas" in d.reason  # the window only holds what it saw
    busy, state = decide(pool(3, asks=100, u=0.7), state=state, now_s=10.0)
    assert busy.desired == 3
    held, state = decide(dataclasses.replace(idle, replicas=3), v=verifier(running=0, step_s=None), state=state,
                         now_s=20.0)
    assert held.desired == 3 and "stabilization window" in held.reason
    later, _ = decide(dataclasses.replace(idle, replicas=3), v=verifier(running=0, step_s=None), state=state,
                      now_s=80.0)
    assert later.desired == 2


def test_a_replica_not_worth_its_price_is_not_added() -> None:
    # demand 80/s, 40/s served at 0.7: 2 replicas at the target. The second serves 40 asks/s more
    # at 0.5 accepted tokens per ask: 20 tokens/s, at $1e-4 a token $7.2/h.
    late_pool = pool(1, asks=40, late=40, u=0.7, yield_tokens=0.5)
    cheap = ScalingPolicy(pools=(PoolLimits("code", 1, 8, price_per_hour_usd=1.0),), token_value_usd=1e-4)
    dear = ScalingPolicy(pools=(PoolLimits("code", 1, 8, price_per_hour_usd=10.0),), token_value_usd=1e-4)
    assert decide(late_pool, policy=cheap)[0].desired == 2
    d, _ = decide(late_pool, policy=dear)
    assert d.desired == 1 and "worth less than its $10/h" in d.reason, d


def test_a_spot_pool_is_weighed_at_its_spot_price() -> None:
    """A pool on spot capacity prices its next replica at `spotPricePerHourUsd`, so the gate adds
    the replica the on-demand price would refuse; on-demand pools (and spot pools without a spot
    price) keep `pricePerHourUsd`."""
    from cosine_spec.autoscaling import policy_from_spec
    from cosine_spec.cluster_spec import parse_cluster_spec

    def spec(capacity: str, spot_price: float):
        pool = {"name": "code", "model": "m", "capacity": capacity, "pricePerHourUsd": 10.0,
                "spotPricePerHourUsd": spot_price, "minReplicas": 1, "maxReplicas": 8}
        return parse_cluster_spec({"verifier": {"model": "t"}, "drafterPools": [pool], "spot": {"provider": "gke"},
                                   "autoscaling": {"acceptedTokenValuePerMillionUsd": 100}})

    prices = {(c, sp): policy_from_spec(spec(c, sp)).pools[0].price_per_hour_usd
              for c, sp in (("spot", 3.5), ("onDemand", 3.5), ("spot", 0.0))}
    assert prices == {("spot", 3.5): 3.5, ("onDemand", 3.5): 10.0, ("spot", 0.0): 10.0}
    late_pool = pool(1, asks=40, late=40, u=0.7, yield_tokens=0.5)  # the second replica adds $7.2/h of tokens
    assert decide(late_pool, policy=policy_from_spec(spec("spot", 3.5)))[0].desired == 2
    assert decide(late_pool, policy=policy_from_spec(spec("onDemand", 3.5)))[0].desired == 1


def test_missing_data_holds_and_never_shrinks() -> None:
    d, _ = decide(pool(3), v=None)
    assert (d.desired, d.condition) == (3, "MetricsMissing") and "cosine_verifier_steps_total" in d.reason
    d, _ = decide(pool(3, asks=5, u=None))
    assert (d.desired, d.condition) == (3, "MetricsMissing") and "cosine_drafter_busy_seconds_total" in d.reason


def test_growth_is_clamped_to_the_bounds_and_the_scale_up_factor() -> None:
    d, _ = decide(pool(2, asks=400, late=800, u=1.0))  # 3 x busier were all served: 9, at most 2 x 2
    assert d.desired == 4
    policy = ScalingPolicy(pools=(PoolLimits("code", 1, 3),))
    assert decide(pool(2, asks=400, late=800, u=1.0), policy=policy)[0].desired == 3


def test_flapping_demand_does_not_flap_the_output() -> None:
    state, replicas, history = ScalerState(), 4, []
    for i in range(12):  # demand swings between 3x and 1x what is served every 10 s
        d, state = decide(pool(replicas, asks=40, late=80 if i % 2 else 0, u=0.7), state=state, now_s=10.0 * i)
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
    with pytest.raises(ValueError):
        ScalingPolicy(pools=(), target_utilization=0.0)
