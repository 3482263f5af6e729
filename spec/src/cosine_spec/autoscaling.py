"""The drafter-pool scaling rule: enough replicas to serve a pool's demand, no more than pay.

Pure: observations, policy and the previous state go in, decisions and the new state come out; no
kopf, no HTTP, no clock (``now_s`` is passed in). The operator runs it on its scrape, ``cosine
serve`` on its own (embedded autoscaling), the simulator on its counters.

**Demand** ``D`` (per second): each verifier step, each request routed to the pool either asks
it, finds its previous draft still in flight (a *late* step), or skips the ask: as *late* (the
pool's on-time share made it not pay), *down* (no replica answers: a pool at zero) or *yield* (its
drafts are not accepted enough there, or not enough to be worth the ask's dollars). All but
*yield* are demand: ``D = asks - probes + late steps + skipped late + skipped down``. Skips for
*yield* are not: more replicas do not make drafts better. Nor are *probes*, asks the proposer
makes only on a request's probe steps where it would otherwise skip for *yield* (so its estimate
of the pool can recover): a pool asked for nothing else goes down to ``minReplicas`` (the idle
rule below), zero allowed, and a pool at zero is asked by no probe, so only asks it would pay for
bring it back.
Demand is counted where the proposer decides, so a late pool, which is asked less and so idles
more, still shows what it is wanted for.

**Capacity**: the pool's replicas were busy a fraction ``u`` of the interval (engine seconds per
second per replica, ``cosine_drafter_busy_seconds_total``) serving ``A`` asks per second. Serving
all of ``D`` would keep them busy ``u D / A``; the pool needs ``ceil(replicas u D / (A u*))``
replicas to run at the target busy fraction ``u*`` (``spec.autoscaling.targetDrafterUtilization``):
the Kubernetes HPA's rule, on the demand instead of on what was served. Under batching a
replica's round grows with its batch, so fewer requests per replica also make each draft earlier.

**Too slow**: a pool whose drafts are late even at about one request per round (mean batch
``<= 1.25``, more than half its demand late) cannot be helped by replicas: it holds, flagged
``PoolTooSlow`` with its round time and the verifier's step.

**Cost**: with a value on accepted draft tokens (``spec.autoscaling.acceptedTokenValuePerMillionUsd``)
and a price per replica (``spec.drafterPools[].pricePerHourUsd``), a pool keeps replica ``n + 1``
only while what it adds, ``gain × (served(n+1) - served(n))`` tokens per second (``served(n) =
min(D, n s)``, ``s = A u* / (u replicas)`` the asks per second a replica serves at the target,
unmeasured: all of ``D``), is worth its price per second, from the first replica on: a pool that
adds less than one replica's price goes to ``minReplicas``. ``gain`` is what the pool adds over the
verifier's own sources (its head, prompt lookup) per step a request wants it
(``cosine_drafter_gain_tokens_total`` over ``D``: the proposer's expected accepted tokens
of the pool's draft less the best local source's, at the request's last draft length), not all it
gets accepted: a pool whose drafts the head would have matched pays nothing. From a verifier
without that series, growth alone is weighed, by ``yield`` (accepted tokens per ask; with none
measured yet, the accepted tokens per ask of the interval).

**From zero**: a pool at zero replicas with demand (asks skipped as *down*) gets ``max(1,
minReplicas)``, where its first replica is worth its price (above). **Missing data**: no verifier
samples (or a pool with ready replicas but no drafter samples) holds the pool, never shrinks it,
and names the series (``MetricsMissing``).
**Idle**: no demand drifts to ``minReplicas``.

Scale-up applies at once (at most ``max_scale_up_factor`` times per decision); a scale-down takes
the highest recommendation of the last ``stabilization_s`` seconds (the HPA's downscale
stabilization window) and removes at most ``max_scale_down_step`` replicas per decision.

The anchors decide similarly at other layers: NVIDIA Dynamo's planner sizes prefill/decode workers
from a profiled per-replica performance model and predicted load; llm-d's Workload Variant
Autoscaler sizes variants from saturation signals and a cost optimiser. Here the load is the
verifier's demand for drafts (which only the proposer sees), the saturation is measured per pool,
and the cost side values accepted tokens, which only the verifier measures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from cosine_spec import metric_names as names
from cosine_spec.cluster_spec import ClusterSpec, clamp_replicas

SKIP_REASONS = ("late", "yield", "down")  # cosine_drafter_asks_skipped_total{reason}
DEMAND_SKIPS = ("late", "down")  # skips that are demand: more replicas would have served them


@dataclass(frozen=True)
class VerifierObservation:
    """The verifier pods over the last interval (rates summed over replicas)."""

    step_s: float | None  # mean seconds per engine step (None: no steps in the interval)
    tokens_verified_per_s: float
    requests_running: float
    requests_waiting: float


@dataclass(frozen=True)
class PoolObservation:
    """One drafter pool over the last interval; rates in events per second.

    ``round_s``/``batch``: its replicas' mean batched round time (seconds) and requests per round,
    ``None`` when no round ran; ``utilization``: engine-busy seconds per second per measured
    replica; ``drafter_samples``: whether any of its pods was scraped twice.
    ``rtt_s``: the verifier's estimate of a draft call's wall time (EMA, seconds; ``None``: none).
    ``yield_tokens``: accepted tokens per draft call (``None``: not measured).
    """

    name: str
    replicas: int  # the scale target's current value
    ready_replicas: int
    asks_per_s: float = 0.0
    late_per_s: float = 0.0
    probes_per_s: float = 0.0  # of asks_per_s, those made only to probe (no demand)
    # expected accepted tokens per second the pool adds over the verifier's own sources, where
    # requests want it (None: not measured: a verifier without the series)
    gain_tokens_per_s: float | None = None
    skipped_per_s: Mapping[str, float] = field(default_factory=dict)  # by reason (SKIP_REASONS)
    accepted_tokens_per_s: float = 0.0
    acceptance_rate: float | None = None  # accepted / drafted tokens at the verifier, 0..1
    draft_tokens_per_s: float = 0.0  # drafted by all its pods together
    round_s: float | None = None
    batch: float | None = None
    rtt_s: float | None = None
    yield_tokens: float | None = None
    utilization: float | None = None  # busy fraction of its measured replicas, 0..1 (None: none measured)
    drafter_samples: bool = False

    def demand_per_s(self) -> float:
        """Steps per second on which a request wanted a draft from this pool (see the module):
        what ``gain_tokens_per_s`` is summed over."""
        asked = max(0.0, self.asks_per_s - self.probes_per_s)
        return asked + self.late_per_s + sum(self.skipped_per_s.get(r, 0.0) for r in DEMAND_SKIPS)


@dataclass(frozen=True)
class Observations:
    """One snapshot of the cluster; ``verifier`` is ``None`` when it could not be measured."""

    verifier: VerifierObservation | None
    pools: tuple[PoolObservation, ...]


@dataclass(frozen=True)
class PoolLimits:
    """A pool's bounds and price from the spec (``pricePerHourUsd``: one replica, USD per hour)."""

    name: str
    min_replicas: int
    max_replicas: int
    price_per_hour_usd: float = 0.0

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas) or self.price_per_hour_usd < 0:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas (>= 1) and a price >= 0, got {self!r}")


@dataclass(frozen=True)
class ScalingPolicy:
    """Knobs of :func:`desired_replicas`; all but the last come from the spec.

    ``token_value_usd``: what one accepted draft token is worth (0: cost is not weighed).
    Raises ValueError on a negative value or window, or a step below 1.
    """

    pools: tuple[PoolLimits, ...]
    target_utilization: float = 0.7  # busy fraction of a pool's replicas to aim at, (0, 1]
    tolerance: float = 0.1  # no change while the load is within this fraction of the target (the HPA's band)
    stabilization_s: float = 120.0  # scale-down looks back this far
    max_scale_down_step: int = 1  # replicas per pool per decision
    token_value_usd: float = 0.0
    max_scale_up_factor: float = 2.0  # at most this many times the replicas per decision (from >= 1)

    def __post_init__(self) -> None:
        if (self.stabilization_s < 0 or self.max_scale_down_step < 1 or self.token_value_usd < 0
                or not 0 < self.target_utilization <= 1):
            raise ValueError("need stabilization_s >= 0, max_scale_down_step >= 1, token_value_usd >= 0 and "
                             f"target_utilization in (0, 1]: {self!r}")


@dataclass(frozen=True)
class ScaleDecision:
    """What to do with one pool, and why (recorded in status and as an Event).

    ``condition``: ``None``, ``"PoolTooSlow"`` or ``"MetricsMissing"`` (the reason says why)."""

    pool: str
    current: int
    desired: int
    reason: str
    condition: str | None = None

    @property
    def changed(self) -> bool:
        """Whether the desired replicas differ from the current ones."""
        return self.desired != self.current


@dataclass(frozen=True)
class ScalerState:
    """Recent recommendations per pool: ``(time_s, replicas)``, oldest first."""

    recommendations: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)


def policy_from_spec(cluster: ClusterSpec) -> ScalingPolicy:
    """The rule's policy from a cluster spec (the operator, ``cosine serve`` and the simulator all
    build it here): each pool's bounds and the price of its next replica (on spot capacity the spot
    price), ``spec.autoscaling``'s window, step and objective."""
    return ScalingPolicy(
        pools=tuple(PoolLimits(p.name, p.min_replicas, p.max_replicas, p.replica_price_per_hour_usd)
                    for p in cluster.drafter_pools),
        target_utilization=cluster.autoscaling.target_drafter_utilization,
        stabilization_s=float(cluster.autoscaling.stabilization_s),
        max_scale_down_step=cluster.autoscaling.max_scale_down_step,
        token_value_usd=cluster.autoscaling.accepted_token_value_per_million_usd / 1e6,
    )


def _served(demand: float, replicas: int, per_replica: float) -> float:
    return min(demand, replicas * per_replica)


def _worth(pool: PoolObservation, policy: ScalingPolicy, limits: PoolLimits, demand: float,
           needed: int) -> tuple[int, str]:
    """The most of ``needed`` replicas each worth its price (see the module's **Cost**), and why
    fewer. Valued by the tokens the pool adds over the verifier's own sources where measured
    (``gain_tokens_per_s``, from the first replica: a pool that adds less than one replica's
    price goes to ``minReplicas``), else by its accepted tokens per ask (growth only)."""
    asks, u, target = pool.asks_per_s, pool.utilization or 0.0, policy.target_utilization
    # asks per second a replica serves at the target (unmeasured, as at zero: all of the demand)
    per_replica = asks * target / (u * pool.replicas) if asks > 0 and u > 0 and pool.replicas else math.inf
    if pool.gain_tokens_per_s is not None:
        per_ask = pool.gain_tokens_per_s / demand if demand > 0 else 0.0
        n, what = 0, "over the verifier's own sources"
    elif needed > pool.replicas and asks > 0 and u > 0:
        per_ask = pool.yield_tokens if pool.yield_tokens is not None else pool.accepted_tokens_per_s / asks
        n, what = pool.replicas, "accepted"
    else:
        return needed, ""
    price_s = limits.price_per_hour_usd / 3600
    while n < needed:
        gained = per_ask * (_served(demand, n + 1, per_replica) - _served(demand, n, per_replica))
        if gained * policy.token_value_usd < price_s:
            return n, (f"; replica {n + 1} would add {gained:.1f} tokens/s {what}, worth less than its "
                       f"${limits.price_per_hour_usd:g}/h")
        n += 1
    return n, ""


def _recommend(v: VerifierObservation | None, policy: ScalingPolicy, pool: PoolObservation,
               limits: PoolLimits) -> tuple[int, str, str | None]:
    """The raw (unstabilized, clamped) recommendation for one pool, its reason and condition."""
    if v is None:
        missing = names.total(names.VERIFIER_STEPS)
        return pool.replicas, f"metrics missing: {missing} (no verifier scraped twice): holding", "MetricsMissing"
    demand, asks, target = pool.demand_per_s(), pool.asks_per_s, policy.target_utilization
    if demand <= 0:
        in_flight = v.requests_running + v.requests_waiting
        if in_flight <= 0:
            return limits.min_replicas, "no requests in flight: drifting to minReplicas", None
        return limits.min_replicas, f"{in_flight:.0f} requests in flight, none wants this pool's drafts", None
    priced = policy.token_value_usd > 0 and limits.price_per_hour_usd > 0
    if pool.replicas == 0:
        worth, why = _worth(pool, policy, limits, demand, 1) if priced else (1, "")
        if worth < 1:
            return limits.min_replicas, f"at zero with demand ({demand:.1f}/s){why}: holding at minReplicas", None
        return max(1, limits.min_replicas), f"at zero with demand ({demand:.1f}/s): scaling from zero", None
    u = pool.utilization
    if u is None:
        if pool.ready_replicas > 0:
            missing = names.total(names.DRAFTER_BUSY_SECONDS)
            return pool.replicas, (f"metrics missing: {missing} of pool {pool.name} (no drafter pod scraped twice): "
                                   "holding"), "MetricsMissing"
        return pool.replicas, "no replica ready yet: holding", None
    late = pool.late_per_s + pool.skipped_per_s.get("late", 0.0)
    if late > 0.5 * demand and pool.batch is not None and pool.batch <= 1.25:
        step = f"{v.step_s * 1e3:.0f} ms" if v.step_s else "unknown"
        round_ms = f"{pool.round_s * 1e3:.0f} ms" if pool.round_s is not None else "unknown"
        return pool.replicas, (f"too slow for the verifier at any size: {late / demand:.0%} of its demand late at "
                               f"{pool.batch:.2f} requests per round (round {round_ms}, verifier step {step}): "
                               "holding"), "PoolTooSlow"
    if asks <= 0 and u <= 0:  # ready but not asked yet (the proposer still holds it down): no evidence
        return pool.replicas, f"demand {demand:.1f}/s but no ask served yet: holding", None
    load = u * demand / asks if asks > 0 else math.inf  # the busy fraction were all demand served
    reason = (f"demand {demand:.1f}/s, served {asks:.1f}/s at busy fraction {u:.2f} "
              f"({min(load, 99.0):.2f} were all served; target {target:.2f})")
    tolerated = abs(load / target - 1) <= policy.tolerance
    needed = pool.replicas if tolerated else max(1, math.ceil(pool.replicas * min(load, 1e6) / target - 1e-9))
    if priced:
        needed, why = _worth(pool, policy, limits, demand, needed)
        reason += why
    if tolerated and needed == pool.replicas:
        reason += ": within tolerance"
    elif needed > pool.replicas:
        needed = min(needed, math.ceil(pool.replicas * policy.max_scale_up_factor))
        reason += ": growing"
    elif needed < pool.replicas:
        reason += ": shrinking"
    return clamp_replicas(needed, limits.min_replicas, limits.max_replicas), reason, None


def desired_replicas(
    obs: Observations, policy: ScalingPolicy, state: ScalerState, now_s: float
) -> tuple[tuple[ScaleDecision, ...], ScalerState]:
    """Decide every pool's replicas; returns the decisions and the state for the next call.

    ``now_s`` is any monotonic time in seconds (the caller's clock); pools in ``policy.pools``
    without an observation are left out. A decision with condition ``MetricsMissing`` never
    lowers the replicas.
    """
    by_name = {p.name: p for p in obs.pools}
    decisions: list[ScaleDecision] = []
    history: dict[str, tuple[tuple[float, int], ...]] = {}
    for limits in policy.pools:
        pool = by_name.get(limits.name)
        if pool is None:
            continue
        raw, reason, condition = _recommend(obs.verifier, policy, pool, limits)
        current = pool.replicas
        if condition is not None:  # holding: not a recommendation the window should remember
            history[limits.name] = state.recommendations.get(limits.name, ())
            decisions.append(ScaleDecision(limits.name, current, current, reason, condition))
            continue
        window = tuple((t, r) for t, r in state.recommendations.get(limits.name, ())
                       if now_s - t < policy.stabilization_s) + ((now_s, raw),)
        history[limits.name] = window
        if raw >= current:
            desired = raw
        else:
            stabilized = max(r for _, r in window)
            desired = max(stabilized, current - policy.max_scale_down_step, raw)
            if desired > raw and desired >= current:
                reason += f"; held by the {policy.stabilization_s:.0f}s stabilization window"
            elif desired > raw:
                reason += f"; scale-down limited to {policy.max_scale_down_step} per decision"
        desired = clamp_replicas(min(desired, max(current, raw)), limits.min_replicas, limits.max_replicas)
        decisions.append(ScaleDecision(limits.name, current, desired, reason))
    return tuple(decisions), ScalerState(history)
