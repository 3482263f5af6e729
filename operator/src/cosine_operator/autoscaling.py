"""The drafter-pool scaling policy: drafting capacity follows the drafts the verifier asks for.

Pure: observations, policy and the previous state go in, decisions and the new
state come out; no kopf, no HTTP, no clock (``now_s`` is passed in).

The signal is each pool's busy fraction ``u`` (its drafter pods' busy seconds over the interval,
per ready pod) against the target ``u*`` (``spec.autoscaling.targetDrafterUtilization``), the
Kubernetes HPA's rule ``desired = ceil(replicas u / u*)`` with its 10 % tolerance band:

* the verifier never waits for a draft (it verifies what has arrived), so its own busy fraction is
  close to 1 whenever requests run, whatever the pools do: under continuous batching it cannot
  say whether drafting keeps up (it made pools shrink under load and grow when idle). The demand
  on a pool is the verifier's: one draft call per routed running request per engine step. So a
  pool's busy fraction follows verifier throughput, and one above ``u*`` means its drafts queue
  and arrive late (CoSine's "balance draft generation and verification throughput",
  arXiv:2503.10325, per pool);
* a pool is grown only while its drafts pay (acceptance rate at the verifier of at least
  ``min_acceptance``): more replicas of a pool whose drafts are rejected add nothing. Such a pool
  also loses its load by itself: the verifier's proposer asks it only on probe steps while its
  yield is low, so its busy fraction falls and it shrinks;
* no requests in flight: pools drift down to ``minReplicas``.

Scale-up applies at once (at most ``max_scale_up_factor`` times per decision); a scale-down takes
the highest recommendation of the last ``stabilization_s`` seconds (the HPA's downscale
stabilization window) and removes at most ``max_scale_down_step`` replicas per decision, so an
input that flaps does not make the output flap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from cosine_operator.settings import clamp_replicas


@dataclass(frozen=True)
class VerifierObservation:
    """The verifier pods over the last interval (summed over replicas, utilization averaged)."""

    utilization: float  # busy fraction, 0..1
    tokens_verified_per_s: float
    requests_running: float
    requests_waiting: float


@dataclass(frozen=True)
class PoolObservation:
    """One drafter pool over the last interval."""

    name: str
    replicas: int  # the scale target's current value
    ready_replicas: int
    draft_tokens_per_s: float  # drafted by all its pods together
    acceptance_rate: float | None  # accepted / drafted tokens of this pool at the verifier, 0..1
    share: float | None  # this pool's fraction of all tokens drafted (routing share), 0..1
    utilization: float | None = None  # busy fraction of its measured pods, 0..1 (None: not measured)


@dataclass(frozen=True)
class Observations:
    """One snapshot of the cluster; ``verifier`` is ``None`` when it could not be measured."""

    verifier: VerifierObservation | None
    pools: tuple[PoolObservation, ...]


@dataclass(frozen=True)
class PoolLimits:
    """A pool's bounds from the spec."""

    name: str
    min_replicas: int
    max_replicas: int


@dataclass(frozen=True)
class ScalingPolicy:
    """Knobs of :func:`desired_replicas`; the first three come from ``spec.autoscaling``."""

    pools: tuple[PoolLimits, ...]
    target_utilization: float = 0.7  # drafter pool busy fraction to aim at, 0..1
    stabilization_s: float = 120.0  # scale-down looks back this far
    max_scale_down_step: int = 1  # replicas per pool per decision
    tolerance: float = 0.1  # relative band around the target where nothing changes
    min_acceptance: float = 0.3  # a pool below this acceptance rate is not grown
    max_scale_up_factor: float = 2.0  # drafting throughput grows at most this much per decision


@dataclass(frozen=True)
class ScaleDecision:
    """What to do with one pool, and why (recorded in status and as an Event)."""

    pool: str
    current: int
    desired: int
    reason: str

    @property
    def changed(self) -> bool:
        """Whether the desired replicas differ from the current ones."""
        return self.desired != self.current


@dataclass(frozen=True)
class ScalerState:
    """Recent recommendations per pool: ``(time_s, replicas)``, oldest first."""

    recommendations: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)


def _clamp(replicas: int, limits: PoolLimits) -> int:
    return clamp_replicas(replicas, limits.min_replicas, limits.max_replicas)


def _recommend(
    obs: Observations, policy: ScalingPolicy, pool: PoolObservation, limits: PoolLimits
) -> tuple[int, str]:
    """The raw (unstabilized, clamped) recommendation for one pool, and its reason."""
    v = obs.verifier
    if v is None:
        return _clamp(pool.replicas, limits), "no verifier metrics: holding"
    target = policy.target_utilization
    u = pool.utilization
    if v.requests_running + v.requests_waiting <= 0 and (u is None or u < target * (1 - policy.tolerance)):
        return limits.min_replicas, "no requests in flight: drifting to minReplicas"
    if u is None:
        return _clamp(pool.replicas, limits), "pool busy time not measured: holding"
    ratio = u / target if target > 0 else 1.0
    if abs(ratio - 1.0) <= policy.tolerance:
        return _clamp(pool.replicas, limits), (
            f"pool utilization {u:.2f} within {policy.tolerance:.0%} of target {target:.2f}")
    raw = math.ceil(pool.replicas * min(ratio, policy.max_scale_up_factor) - 1e-9)
    if ratio < 1.0:
        return _clamp(raw, limits), f"pool utilization {u:.2f} < target {target:.2f}: drafting capacity idle, shrinking"
    acceptance = pool.acceptance_rate
    if acceptance is None or acceptance < policy.min_acceptance:
        shown = "unknown" if acceptance is None else f"{acceptance:.2f}"
        return _clamp(pool.replicas, limits), (
            f"pool utilization {u:.2f} > target {target:.2f} but acceptance {shown} "
            f"< {policy.min_acceptance:.2f}: more of its drafts would not help"
        )
    return _clamp(max(raw, pool.replicas), limits), (
        f"pool utilization {u:.2f} > target {target:.2f} with acceptance {acceptance:.2f}: "
        "drafts queue behind the verifier's demand, growing"
    )


def desired_replicas(
    obs: Observations, policy: ScalingPolicy, state: ScalerState, now_s: float
) -> tuple[tuple[ScaleDecision, ...], ScalerState]:
    """Decide every pool's replicas; returns the decisions and the state for the next call.

    ``now_s`` is any monotonic time in seconds (the caller's clock); pools in ``policy.pools``
    without an observation are left out.
    """
    by_name = {p.name: p for p in obs.pools}
    decisions: list[ScaleDecision] = []
    history: dict[str, tuple[tuple[float, int], ...]] = {}
    for limits in policy.pools:
        pool = by_name.get(limits.name)
        if pool is None:
            continue
        raw, reason = _recommend(obs, policy, pool, limits)
        window = tuple(
            (t, r)
            for t, r in state.recommendations.get(limits.name, ())
            if now_s - t < policy.stabilization_s
        ) + ((now_s, raw),)
        history[limits.name] = window
        current = pool.replicas
        if raw >= current:
            desired = raw
        else:
            stabilized = max(r for _, r in window)
            desired = max(stabilized, current - policy.max_scale_down_step, raw)
            if desired > raw and desired >= current:
                reason += f"; held by the {policy.stabilization_s:.0f}s stabilization window"
            elif desired > raw:
                reason += f"; scale-down limited to {policy.max_scale_down_step} per decision"
        desired = _clamp(min(desired, max(current, raw)), limits)
        decisions.append(ScaleDecision(limits.name, current, desired, reason))
    return tuple(decisions), ScalerState(history)
