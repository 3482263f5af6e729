"""How CoSine uses its drafter pools: whether to ask one for a request's next draft, how large an
ask, what the proposer believes about each pool, and which replica of a pool holds a request.

Pure policy: numbers in, decisions out; no grpc, no clock. One object, `PoolPolicy`, called by the
serving path (`proposer.CoSineProposer`) and by the simulator (`simulation.cluster`) alike, so the
simulated cluster decides as the served one does (a copy of a policy drifts, and the copy then
argues for a system that does not serve).

- Asking (`PoolPolicy.skip_reason`): a pool is asked where its expected accepted tokens per
  verifier step beat the best local source's for the request (the engine's own drafter, prompt
  lookup: `speculation_control.pool_pays`) and, with a value on accepted tokens
  (`token_value_usd`) and a price on the pool's replicas (`pool_prices`), where the tokens it adds
  over that source are worth what the ask costs in dollars (`ask_pays`); and on the request's probe
  steps (its first step, then every `probe_every`: `probe_step`), where it has a replica, so its
  estimates can recover. An ask made only to probe is no demand for the autoscaler: a pool that
  pays nowhere but its probes goes down to its `minReplicas`, zero allowed, and a pool at zero
  comes back only for the asks it would pay for.
- Sizing (`PoolPolicy.ask`): draft tokens and branches sized to come back within the verifier step
  the call overlaps (`speculation_control.pool_ask`; PEARL's post-verify drafting, Liu et al.,
  arXiv:2408.11850, for the branches).
- Beliefs: a pool's on-time share (`on_time`: its draft arrived in time and continued the context)
  and a request's hit rate for a local source (`hit_rate`), both exponential moving averages over looks.
- Routing with fusion (`routing_settings`): with `fusion` every pool may be routed to a request,
  each then asked only where it pays (Gao et al. 2025, arXiv:2503.10325, confidence-based fusion).
- Replicas (`assign_replica`): a pool is N replicas, each keeping per-request state (a KV sequence,
  the context deltas it was sent). A request is assigned to one replica for its lifetime, the one
  holding the fewest requests at assignment (least outstanding requests), so a replica the
  autoscaler adds takes new requests until the pool is even, and a request's context is never
  split. Consistent hashing with bounded loads (Mirrokni et al. 2018) would keep a request on the
  same replica across several verifiers without coordination; here each request has exactly one
  verifier, which remembers its replica, so the simpler rule balances as well and moves nothing
  when replicas come and go.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from cosine_spec.cluster_spec import MAX_DRAFT_LEN, SpeculationSpec

from cosine import routing
from cosine import speculation_control as sc

SPEED_DECAY = 0.8  # weight kept by a pool's round-trip and per-token estimates per call
ON_TIME_DECAY = 0.95  # weight kept by a pool's on-time share per look at one of its drafts
HIT_DECAY = 0.8  # weight kept by a request's hit rate for a local source per step


@dataclass(frozen=True)
class PoolPolicy:
    """How the drafting plane uses pools (see the module docstring).

    lookahead_tokens: a pool drafts this many tokens beyond k (the target emits at least one token
    while the draft is made). max_draft_tokens: the most draft tokens per candidate of one ask.
    branches: at most this many rejection points of the draft being verified a pool drafts from as
    well (`Drafter.propose`'s `max_branches`). step_budget: the share of a verifier step an ask is
    sized to take, from the pool's measured seconds per draft token. min_gain_tokens: expected
    accepted tokens per step a pool must give a request to be asked (besides beating the best local source).
    probe_every: a pool that does not pay for a request is still asked every this many of its steps.
    token_value_usd: what one accepted draft token is worth, USD (`spec.autoscaling.
    acceptedTokenValuePerMillionUsd` / 1e6, the value the autoscaler weighs a replica's price
    against); 0: an ask's cost is not weighed. pool_prices: (pool name, one replica's USD per hour:
    `spec.drafterPools[].pricePerHourUsd`, the spot price on spot capacity) per priced pool.

    Raises ValueError for probe_every < 1, negative token counts, a negative value or price, or
    step_budget outside (0, 1].
    """

    lookahead_tokens: int = 2
    max_draft_tokens: int = MAX_DRAFT_LEN
    branches: int = SpeculationSpec().branches  # the CRD's spec.speculation.branches default
    step_budget: float = 0.8
    min_gain_tokens: float = 0.25
    probe_every: int = 8
    token_value_usd: float = 0.0
    pool_prices: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.probe_every < 1 or min(self.lookahead_tokens, self.max_draft_tokens, self.branches) < 0:
            raise ValueError(f"need probe_every >= 1 and non-negative token counts, got {self!r}")
        if self.token_value_usd < 0 or any(price < 0 for _, price in self.pool_prices):
            raise ValueError(f"need a token value and pool prices >= 0, got {self!r}")
        if not 0 < self.step_budget <= 1:
            raise ValueError(f"step_budget must be in (0, 1], got {self.step_budget}")

    def price_per_hour_usd(self, pool: str) -> float:
        """One replica of `pool`'s price, USD per hour (0: not priced)."""
        return next((price for name, price in self.pool_prices if name == pool), 0.0)

    def ask_pays(self, gain_tokens: float, pool: str, ask_s: float) -> bool:
        """Whether an ask is worth its dollars: the accepted tokens it adds over the best local
        source (`gain_tokens`, `speculation_control.pool_gain_tokens`) at `token_value_usd` each,
        against the replica time it takes, `ask_s` seconds at the pool's price. `ask_s` is a
        call's measured wall time: a replica drafting for several requests at once serves each in
        less, so this prices an ask at most what it costs. A pool is paid by the replica-second:
        where asks do not pay, the autoscaler, which counts them as *yield* (no demand), lets the
        pool shrink to its `minReplicas`; a pool held at a fixed size costs its price whether
        asked or not. True where no value or no price is set (cost not weighed)."""
        price = self.price_per_hour_usd(pool)
        if self.token_value_usd <= 0 or price <= 0:
            return True
        return gain_tokens * self.token_value_usd >= price / 3600.0 * max(0.0, ask_s)

    def probe_step(self, request_steps: int) -> bool:
        """Whether a request's step (`request_steps`, counted from 1) is one of its probe steps:
        the first, then every `probe_every`. On a probe step a pool that would be skipped is asked
        all the same, where it has a replica, so its estimates can recover; such an ask is a
        *probe* (`proposer_stats.pool_probes`), which the autoscaler does not count as demand: a
        pool asked only to probe does not pay, and goes down to its `minReplicas`."""
        return (request_steps - 1) % self.probe_every == 0

    @staticmethod
    def gain_tokens(pool_alpha: float, local: Sequence[tuple[float, float]], k_max: int,
                    on_context: float = 1.0) -> float:
        """Expected accepted tokens per verifier step the pool's draft adds for the request over
        its best local source, were the draft back in time (`speculation_control.pool_gain_tokens`
        at the pool's on-context share; never below 0). Summed over the steps a request wants the
        pool (`proposer_stats.pool_gain_tokens`), it is what the autoscaler weighs a replica's
        price against: what the pool adds, not all it gets accepted."""
        return max(0.0, sc.pool_gain_tokens(pool_alpha, on_context, local, k_max))

    def skip_reason(self, pool_alpha: float, pool_on_time: float,
                    local: Sequence[tuple[float, float]], k_max: int, on_context: float = 1.0,
                    pool: str = "", ask_s: float = 0.0) -> str | None:
        """Why not to ask the pool for this request now, or `None` to ask where
        `speculation_control.pool_pays` against the best local source (`local`: per source, its
        per-token acceptance for the request and its hit rate, the share of steps it has a draft).
        A pool that does not pay is skipped as `"late"` when it would pay if its drafts arrived in
        time (its on-time share is what fails: demand a faster or larger pool would serve, which
        the autoscaler counts), else as `"yield"`. `on_context`: the share of the pool's drafts back
        in time that still continued the context (the target went where the pool guessed): it
        scales what the pool gives, but a faster pool would not raise it, so it never makes a skip
        "late". An ask whose gain is not worth its dollars (`ask_pays`: `pool`'s price, `ask_s`
        seconds of it) is skipped as "yield" (or "late" where it would pay on time). Alphas are
        per-token acceptance rates in [0, 1]. Probe steps are the caller's (`probe_step`)."""
        def pays(on_time: float) -> bool:
            return sc.pool_pays(pool_alpha, on_time, local, k_max, self.min_gain_tokens) and self.ask_pays(
                sc.pool_gain_tokens(pool_alpha, on_time, local, k_max), pool, ask_s)

        if pays(pool_on_time * on_context):
            return None
        return "late" if pays(on_context) else "yield"

    def ask(self, step_s: float, token_s: float | None, rtt_s: float, k_max: int, verifying: bool) -> tuple[int, int]:
        """(draft tokens per candidate, branches) of the next ask (`speculation_control.pool_ask`).
        step_s: the verifier's seconds per decode step; token_s: the pool's measured seconds per
        draft token (None: not measured yet); rtt_s: its measured round trip, seconds;
        `verifying`: a draft is being verified meanwhile (branches only then)."""
        return sc.pool_ask(step_s, token_s, rtt_s, k_max, self.branches if verifying else 0,
                           lookahead=self.lookahead_tokens, max_tokens=max(self.max_draft_tokens, k_max),
                           budget=self.step_budget)

    @staticmethod
    def learn_speed(rtt_s: float | None, token_s: float | None, call_s: float,
                    drafted_tokens: int) -> tuple[float, float | None]:
        """A pool's (round trip, seconds per draft token) estimates after a call of `call_s`
        seconds that drafted `drafted_tokens` tokens (all candidates; 0 leaves the per-token
        estimate alone, as for a call that took in a whole prompt). None: no estimate yet."""
        rtt = call_s if rtt_s is None else SPEED_DECAY * rtt_s + (1 - SPEED_DECAY) * call_s
        if drafted_tokens <= 0:
            return rtt, token_s
        per = call_s / drafted_tokens
        return rtt, per if token_s is None else SPEED_DECAY * token_s + (1 - SPEED_DECAY) * per

    @staticmethod
    def on_time(previous: float, usable: bool) -> float:
        """A pool's on-time share after one look at its draft (`usable`: it had arrived and still
        continued the context; a draft still in flight is not usable)."""
        return ON_TIME_DECAY * previous + (1 - ON_TIME_DECAY) * (1.0 if usable else 0.0)

    @staticmethod
    def hit_rate(previous: float, hit: bool) -> float:
        """A request's hit rate for a local source after one step on which it had (`hit`) a draft or not."""
        return HIT_DECAY * previous + (1 - HIT_DECAY) * (1.0 if hit else 0.0)

    @staticmethod
    def routing_settings(settings: routing.RoutingSettings, num_pools: int, fusion: bool) -> routing.RoutingSettings:
        """The router's settings for one request: with `fusion` every pool may be routed to it
        (each then asked only where it pays, their drafts fused); else the router's own limit."""
        if not fusion:
            return settings
        return replace(settings, max_drafters=max(settings.max_drafters, num_pools))


def assign_replica(held: Mapping[str, int], replicas: Sequence[str]) -> str | None:
    """The replica a new (or re-homed) request is assigned to: the one of `replicas` holding the
    fewest requests (`held`, missing = 0), the first in `replicas` order on a tie; None when there
    are no replicas."""
    if not replicas:
        return None
    return min(replicas, key=lambda r: held.get(r, 0))  # min keeps the first of equals
