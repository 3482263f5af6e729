"""The drafter-pool scaling rule: enough replicas to serve a pool's demand on time, no more than pay.

Pure: observations, policy and the previous state go in, decisions and the new state come out; no
kopf, no HTTP, no clock (``now_s`` is passed in). The operator runs it on its scrape, ``cosine
serve`` on its own (embedded autoscaling), the simulator on its counters.

**Demand** (requests that want a draft from the pool per verifier step, ``d``): each step, each
request routed to the pool either asks it, finds its previous draft still in flight (a *late*
step), or skips the ask: as *late* (the pool's on-time share made it not pay), *down* (the pool has
no replica that answers: a pool at zero) or *yield* (its drafts are not accepted enough there). All
but *yield* are demand: ``d = (asks + late steps + skipped late + skipped down) / s × step_s``
(rates per second, ``step_s`` the verifier's seconds per engine step). Skips for *yield* are not
demand: more replicas do not make drafts better. Measuring demand where the proposer decides
(not as the pool's busy fraction) is what lets a late pool grow: a late pool is asked less, so
its busy fraction falls while its demand does not.

**Capacity** of a replica: its batched round takes ``r(b) = a + c b`` seconds for ``b`` requests
(``a`` fixed, ``c`` per request), fitted by least squares to the pool's own ``(batch, round
time)`` points (``cosine:drafter_rounds_total``, ``_batched_requests_total``, ``_busy_seconds_total``);
with a single batch size seen the fit is the optimistic ``a = 0``. A draft is on time when its
round plus the network (the least call round trip minus round time seen) fits the verifier's
step, so a replica serves ``b* = (step_s - network_s - a) / c`` requests on time and the pool needs
``ceil(d / b*)`` replicas. A pool whose one-request round alone does not fit (``b* < 1``) is
**too slow** for any replica count: it holds, flagged ``PoolTooSlow`` with the numbers.

**Cost**: with a value on accepted draft tokens (``spec.autoscaling.acceptedTokenValuePerMillionUsd``)
and a price per replica (``spec.drafterPools[].pricePerHourUsd``), replica ``n + 1`` is added only
while what it adds, ``yield × (served(n+1) - served(n))`` accepted tokens per second (``served(n) =
min(d, n b*) / step_s`` asks per second, ``yield`` the pool's accepted tokens per ask), is worth its
price per second. With no yield measured yet (a late pool's drafts are never checked) it is
optimistic: the replica is worth a try, as the router is optimistic about an untried pool.

**From zero**: a pool at zero replicas with demand (its asks skipped as *down*) gets
``max(1, minReplicas)``. **Missing data**: no verifier samples (or a pool with ready replicas but
no drafter samples) holds the pool, never shrinks it, and names the missing series (condition
``MetricsMissing``). **Idle**: no requests in flight and no demand drifts to ``minReplicas``.

Scale-up applies at once; a scale-down takes the highest recommendation of the last
``stabilization_s`` seconds (the Kubernetes HPA's downscale stabilization window) and removes at
most ``max_scale_down_step`` replicas per decision, so a flapping input does not flap the output.

The anchors decide similarly at other layers: NVIDIA Dynamo's planner sizes prefill/decode workers
from a per-replica performance model (latency against load, profiled) and predicted load; llm-d's
Workload Variant Autoscaler sizes variants from saturation and a cost optimiser. Here the
performance model is fitted online from the pool's own rounds and the target is the verifier's
step (a draft later than it is worthless), and the cost side values accepted tokens, which only
the verifier measures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cosine_operator import metric_names as names
from cosine_operator.settings import ClusterSpec, clamp_replicas

SKIP_REASONS = ("late", "yield", "down")  # cosine:drafter_asks_skipped_total{reason}
DEMAND_SKIPS = ("late", "down")  # skips that are demand: more replicas would have served them
FIT_POINTS = 20  # (batch, round time) points kept per pool for the fit


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
    ``None`` when no round ran; ``drafter_samples``: whether any of its pods was scraped twice.
    ``rtt_s``: the verifier's estimate of a draft call's wall time (EMA, seconds; ``None``: none).
    ``yield_tokens``: accepted tokens per draft call (``None``: not measured).
    """

    name: str
    replicas: int  # the scale target's current value
    ready_replicas: int
    asks_per_s: float = 0.0
    late_per_s: float = 0.0
    skipped_per_s: Mapping[str, float] = field(default_factory=dict)  # by reason (SKIP_REASONS)
    accepted_tokens_per_s: float = 0.0
    acceptance_rate: float | None = None  # accepted / drafted tokens at the verifier, 0..1
    draft_tokens_per_s: float = 0.0  # drafted by all its pods together
    round_s: float | None = None
    batch: float | None = None
    rtt_s: float | None = None
    yield_tokens: float | None = None
    drafter_samples: bool = False

    def demand_per_s(self) -> float:
        """Steps per second on which a request wanted a draft from this pool (see the module)."""
        return self.asks_per_s + self.late_per_s + sum(self.skipped_per_s.get(r, 0.0) for r in DEMAND_SKIPS)


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
    """Knobs of :func:`desired_replicas`; the first four come from ``spec.autoscaling``.

    ``token_value_usd``: what one accepted draft token is worth (0: cost is not weighed).
    Raises ValueError on a negative value or window, or a step below 1.
    """

    pools: tuple[PoolLimits, ...]
    stabilization_s: float = 120.0  # scale-down looks back this far
    max_scale_down_step: int = 1  # replicas per pool per decision
    token_value_usd: float = 0.0
    max_scale_up_factor: float = 2.0  # at most this many times the replicas per decision (from >= 1)

    def __post_init__(self) -> None:
        if self.stabilization_s < 0 or self.max_scale_down_step < 1 or self.token_value_usd < 0:
            raise ValueError(f"need stabilization_s >= 0, max_scale_down_step >= 1, token_value_usd >= 0: {self!r}")


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
    """Per pool: recent recommendations ``(time_s, replicas)`` and ``(batch, round_s, rtt_s)`` points."""

    recommendations: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    rounds: Mapping[str, tuple[tuple[float, float, float | None], ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundModel:
    """A replica's round time ``fixed_s + per_request_s × batch`` and the network time, seconds."""

    fixed_s: float
    per_request_s: float
    network_s: float

    def on_time_batch(self, step_s: float) -> float:
        """Requests one replica drafts for on time at a verifier step of ``step_s`` seconds."""
        room = step_s - self.network_s - self.fixed_s
        if self.per_request_s <= 0:
            return math.inf if room > 0 else 0.0
        return max(0.0, room / self.per_request_s)


def policy_from_spec(cluster: ClusterSpec) -> ScalingPolicy:
    """The rule's policy from a cluster spec (the operator, ``cosine serve`` and the simulator all
    build it here): each pool's bounds and price, ``spec.autoscaling``'s window, step and objective."""
    return ScalingPolicy(
        pools=tuple(PoolLimits(p.name, p.min_replicas, p.max_replicas, p.price_per_hour_usd)
                    for p in cluster.drafter_pools),
        stabilization_s=float(cluster.autoscaling.stabilization_s),
        max_scale_down_step=cluster.autoscaling.max_scale_down_step,
        token_value_usd=cluster.autoscaling.accepted_token_value_per_million_usd / 1e6,
    )


def fit_rounds(points: Sequence[tuple[float, float, float | None]]) -> RoundModel | None:
    """Least-squares ``round_s = a + c × batch`` over ``(batch, round_s, rtt_s)`` points (``a, c >=
    0``; one batch size seen: ``a = 0``, ``c`` its mean per-request time); network time: the least
    ``rtt_s - round_s`` seen (>= 0). ``None`` without points."""
    pts = [(b, r) for b, r, _ in points if b > 0 and r >= 0]
    if not pts:
        return None
    n = len(pts)
    mb, mr = sum(b for b, _ in pts) / n, sum(r for _, r in pts) / n
    var = sum((b - mb) ** 2 for b, _ in pts)
    if var / n < 0.25:  # batch sizes within about half a request: the parts cannot be told apart
        a, c = 0.0, mr / mb
    else:
        c = max(0.0, sum((b - mb) * (r - mr) for b, r in pts) / var)
        a = max(0.0, mr - c * mb)
    nets = [max(0.0, rtt - r) for _, r, rtt in points if rtt is not None]
    return RoundModel(a, c, min(nets) if nets else 0.0)


def _served(demand: float, replicas: int, per_replica: float) -> float:
    return min(demand, replicas * per_replica)


def _recommend(v: VerifierObservation | None, policy: ScalingPolicy, pool: PoolObservation,
               limits: PoolLimits, model: RoundModel | None) -> tuple[int, str, str | None]:
    """The raw (unstabilized, clamped) recommendation for one pool, its reason and condition."""
    if v is None:
        missing = names.total(names.VERIFIER_STEPS)
        return pool.replicas, f"metrics missing: {missing} (no verifier scraped twice): holding", "MetricsMissing"
    step_s = v.step_s or 0.0
    demand = pool.demand_per_s() * step_s  # requests wanting a draft from the pool per step
    in_flight = v.requests_running + v.requests_waiting
    if demand <= 0:
        if in_flight <= 0:
            return limits.min_replicas, "no requests in flight: drifting to minReplicas", None
        return limits.min_replicas, f"{in_flight:.0f} requests in flight, none wants this pool's drafts", None
    if pool.replicas == 0:
        up = max(1, limits.min_replicas)
        return up, f"at zero with demand ({demand:.2f} requests per step skipped it as down): scaling from zero", None
    if model is None:
        if pool.ready_replicas > 0 and not pool.drafter_samples:
            return pool.replicas, (f"metrics missing: {names.total(names.DRAFTER_ROUNDS)} of pool {pool.name} "
                                   "(no drafter pod scraped twice): holding"), "MetricsMissing"
        return pool.replicas, "no draft round measured yet: holding", None
    per_replica = model.on_time_batch(step_s)
    numbers = (f"round {model.fixed_s * 1e3:.1f} ms + {model.per_request_s * 1e3:.1f} ms per request, network "
               f"{model.network_s * 1e3:.1f} ms, verifier step {step_s * 1e3:.1f} ms")
    if per_replica < 1:
        return pool.replicas, f"too slow for the verifier at any size ({numbers}): holding", "PoolTooSlow"
    needed = max(1, math.ceil(demand / per_replica - 1e-9))
    reason = f"demand {demand:.2f} requests per step, {min(per_replica, 999):.1f} per replica on time ({numbers})"
    if policy.token_value_usd > 0 and limits.price_per_hour_usd > 0 and needed > 1:
        yield_tokens = pool.yield_tokens
        if yield_tokens is None and pool.asks_per_s > 0:
            yield_tokens = pool.accepted_tokens_per_s / pool.asks_per_s
        if yield_tokens is not None:
            price_s = limits.price_per_hour_usd / 3600
            n = 1
            while n < needed:
                gained = yield_tokens * (_served(demand, n + 1, per_replica) - _served(demand, n, per_replica)) / step_s
                if gained * policy.token_value_usd < price_s:
                    reason += (f"; replica {n + 1} would add {gained:.1f} accepted tokens/s, worth less than its "
                               f"${limits.price_per_hour_usd:g}/h")
                    break
                n += 1
            needed = n
    if pool.replicas > 0 and needed > pool.replicas:
        needed = min(needed, math.ceil(pool.replicas * policy.max_scale_up_factor))
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
    rounds: dict[str, tuple[tuple[float, float, float | None], ...]] = dict(state.rounds)
    for limits in policy.pools:
        pool = by_name.get(limits.name)
        if pool is None:
            continue
        points = rounds.get(limits.name, ())
        if pool.batch is not None and pool.round_s is not None:
            points = (points + ((pool.batch, pool.round_s, pool.rtt_s),))[-FIT_POINTS:]
        rounds[limits.name] = points
        raw, reason, condition = _recommend(obs.verifier, policy, pool, limits, fit_rounds(points))
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
    return tuple(decisions), ScalerState(history, rounds)
