"""Adaptive speculation length: choose k (0 = no speculation) to maximise goodput.

Pure policy (STYLE.md #3): numbers in, a decision out; no torch, no clock. The caller measures costs
and acceptance and passes them in.

Model (Leviathan et al. 2023, arXiv:2211.17192, §3.1; SmartSpec, arXiv:2406.14066, goodput): with
per-token acceptance probability alpha, a draft of k tokens yields on average
    E[tokens | alpha, k] = (1 - alpha**(k + 1)) / (1 - alpha)
tokens per verification (accepted + the recovered/bonus token), at a cost of
    k * draft_token_s + verify_s(k + 1),   verify_s(n) = verify_base_s + (n - 1) * verify_token_s.
Goodput is their ratio; k = 0 (plain decoding) is one token per `verify_base_s`. So speculation is
switched off where it does not pay, and probed again every `probe_interval_steps` steps so a
request whose text turns predictable (code, repetition) gets it back.

Load feedback (Gao et al. 2025, arXiv:2503.10325, adaptive speculation control "to minimize idle
periods"; SmartSpec: speculate less as load grows): `adjust_for_load`, called once per verification
pass with a `LoadSignal`, moves a verifier-wide cap on k that `next_draft_len(..., cap_tokens=)`
applies: verifier idle -> the cap grows (up to `max_draft_tokens`), verifier backlogged -> it shrinks
(down to `load_min_draft_tokens`; 0 switches speculation off under overload). Additive increase,
multiplicative decrease, with a dead band between two pressure thresholds and a minimum dwell in
observations, so a noisy signal does not make the cap flap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class SpeculationSettings:
    """Speculation policy settings (maps onto the CRD's `spec.speculation`).

    max_draft_tokens: upper bound on k. adaptive: choose k by goodput; if False always draft
    `max_draft_tokens`. min_confidence: a drafter stops drafting at the first position whose top
    probability is below this (0 = never stops early; HF assisted generation uses 0.4).
    acceptance_prior: alpha assumed before any outcome is seen. ema_weight: weight of the newest
    outcome in the acceptance estimate. probe_interval_steps: after this many k = 0 steps, draft
    `probe_draft_tokens` tokens to re-measure acceptance.

    Load feedback (`adjust_for_load`; pressure = backlog_tokens / budget_tokens - idle fraction):
    load_shrink_pressure: the cap on k shrinks at or above this pressure (default: half a pass of
    tokens waiting beyond the budget). load_grow_pressure: it grows at or below this (default: the
    verifier idle 20% of the window, no backlog); in between it holds (the hysteresis band).
    load_dwell_observations: consecutive observations beyond a threshold before the cap moves, and
    so between two moves. load_shrink_factor: cap *= factor on a shrink (at least 1 token less).
    load_grow_tokens: cap += this on a grow. load_min_draft_tokens: the lowest cap (0 = speculation
    off under overload). Invalid values raise ValueError.
    """

    max_draft_tokens: int = 8
    adaptive: bool = True
    min_confidence: float = 0.0
    acceptance_prior: float = 0.7
    ema_weight: float = 0.3
    probe_interval_steps: int = 8
    probe_draft_tokens: int = 2
    load_shrink_pressure: float = 0.5
    load_grow_pressure: float = -0.2
    load_dwell_observations: int = 3
    load_shrink_factor: float = 0.5
    load_grow_tokens: int = 1
    load_min_draft_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.max_draft_tokens <= 64:
            raise ValueError(f"max_draft_tokens must be in [0, 64], got {self.max_draft_tokens}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence}")
        if not 0.0 < self.ema_weight <= 1.0:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight}")
        if not self.load_grow_pressure < self.load_shrink_pressure:
            raise ValueError("load_grow_pressure must be below load_shrink_pressure (the hysteresis band)")
        if self.load_dwell_observations < 1 or self.load_grow_tokens < 1:
            raise ValueError("load_dwell_observations and load_grow_tokens must be positive")
        if not 0.0 <= self.load_shrink_factor < 1.0:
            raise ValueError(f"load_shrink_factor must be in [0, 1), got {self.load_shrink_factor}")
        if self.load_min_draft_tokens < 0:
            raise ValueError(f"load_min_draft_tokens must be non-negative, got {self.load_min_draft_tokens}")


@dataclass(frozen=True)
class CostModel:
    """Measured costs, in seconds.

    draft_token_s: drafter time per draft token. verify_base_s: one target pass over one token.
    verify_token_s: extra target time per additional token in the same pass.
    """

    draft_token_s: float
    verify_base_s: float
    verify_token_s: float

    def verify_s(self, num_tokens: int) -> float:
        return self.verify_base_s + max(0, num_tokens - 1) * self.verify_token_s


@dataclass(frozen=True)
class SpeculationState:
    """Per-request acceptance estimate: EMAs of accepted draft tokens and of acceptance trials."""

    accepted_ema: float
    trials_ema: float
    steps_since_probe: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_ema / self.trials_ema if self.trials_ema > 0 else 0.0


def initial_state(settings: SpeculationSettings, acceptance_rate: float | None = None) -> SpeculationState:
    """Fresh estimate: `acceptance_rate` measured for this drafter on earlier requests (its agreement
    with the target), else the settings' prior. Weighted as one trial, so the request's own
    outcomes take over quickly."""
    alpha = settings.acceptance_prior if acceptance_rate is None else min(max(acceptance_rate, 0.0), 1.0)
    return SpeculationState(accepted_ema=alpha, trials_ema=1.0)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted by one verification of k draft tokens (accepted + 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def goodput_per_s(alpha: float, k: int, cost: CostModel) -> float:
    """Expected emitted tokens per second for draft length k."""
    return expected_tokens(alpha, k) / (k * cost.draft_token_s + cost.verify_s(k + 1))


def best_draft_len(alpha: float, cost: CostModel, max_draft_tokens: int) -> int:
    """argmax over k in [0, max_draft_tokens] of goodput; ties go to the shorter draft."""
    best_k, best = 0, goodput_per_s(alpha, 0, cost)
    for k in range(1, max_draft_tokens + 1):
        g = goodput_per_s(alpha, k, cost)
        if g > best * 1.0001:
            best_k, best = k, g
    return best_k


def next_draft_len(
    state: SpeculationState, settings: SpeculationSettings, cost: CostModel | None, cap_tokens: int | None = None
) -> tuple[SpeculationState, int]:
    """Draft length for the next step, and the state to carry.

    Without a cost model (not measured yet) or with `adaptive` off: `max_draft_tokens`.
    cap_tokens: a further upper bound on k, in tokens, e.g. `LoadState.cap_tokens` from
    `adjust_for_load` (None: no cap); it bounds probes too.
    """
    max_k = settings.max_draft_tokens if cap_tokens is None else max(0, min(settings.max_draft_tokens, cap_tokens))
    if not settings.adaptive or cost is None:
        return state, max_k
    k = best_draft_len(state.acceptance_rate, cost, max_k)
    if k > 0:
        return replace(state, steps_since_probe=0), k
    if state.steps_since_probe + 1 >= settings.probe_interval_steps:
        return replace(state, steps_since_probe=0), min(settings.probe_draft_tokens, max_k)
    return replace(state, steps_since_probe=state.steps_since_probe + 1), 0


def observe(
    state: SpeculationState, settings: SpeculationSettings, num_draft_tokens: int, num_accepted: int
) -> SpeculationState:
    """Fold one verification outcome into the acceptance estimate.

    Acceptance is a run of Bernoulli(alpha) trials that stops at the first rejection: n accepted of k
    drafted is n successes and, if n < k, one failure. A step that drafted nothing carries no signal.
    """
    if num_draft_tokens <= 0:
        return state
    trials = num_accepted + (1 if num_accepted < num_draft_tokens else 0)
    w = settings.ema_weight
    return replace(
        state,
        accepted_ema=(1 - w) * state.accepted_ema + w * num_accepted,
        trials_ema=(1 - w) * state.trials_ema + w * trials,
    )


@dataclass(frozen=True)
class LoadSignal:
    """What the engine measured over the last window (e.g. since the previous verification pass).

    verifier_idle_fraction: share of the window the verifier had nothing to verify, in [0, 1].
    backlog_tokens: draft/verify tokens queued beyond the verifier's per-pass budget.
    budget_tokens: that per-pass token budget (e.g. `BatchBudget.max_tokens`), positive.
    Raises ValueError outside these ranges.
    """

    verifier_idle_fraction: float
    backlog_tokens: int
    budget_tokens: int

    def __post_init__(self) -> None:
        if not 0.0 <= self.verifier_idle_fraction <= 1.0:
            raise ValueError(f"verifier_idle_fraction must be in [0, 1], got {self.verifier_idle_fraction}")
        if self.backlog_tokens < 0 or self.budget_tokens < 1:
            raise ValueError(f"backlog_tokens must be >= 0 and budget_tokens > 0, got {self!r}")

    @property
    def pressure(self) -> float:
        """Backlog in passes minus idle fraction: > 0 backlogged, < 0 idle (dimensionless)."""
        return self.backlog_tokens / self.budget_tokens - self.verifier_idle_fraction


@dataclass(frozen=True)
class LoadState:
    """Verifier-wide cap on k (tokens), and the current run of observations pushing it one way
    (direction: -1 shrink, +1 grow, 0 none; streak: its length in observations)."""

    cap_tokens: int
    direction: int = 0
    streak: int = 0


def initial_load_state(settings: SpeculationSettings) -> LoadState:
    """No restriction at first: the cap starts at `max_draft_tokens`."""
    return LoadState(cap_tokens=settings.max_draft_tokens)


def adjust_for_load(state: LoadState, signal: LoadSignal, settings: SpeculationSettings) -> LoadState:
    """Fold one load observation into the cap on k; call once per verification pass.

    The cap moves only after `load_dwell_observations` consecutive observations beyond the same
    threshold, and the run then starts over, so it moves at most once per dwell. An observation in
    the band between `load_grow_pressure` and `load_shrink_pressure` ends the run and holds the cap.
    """
    lo = min(settings.load_min_draft_tokens, settings.max_draft_tokens)
    cap = min(max(state.cap_tokens, lo), settings.max_draft_tokens)
    p = signal.pressure
    direction = -1 if p >= settings.load_shrink_pressure else 1 if p <= settings.load_grow_pressure else 0
    if direction == 0:
        return LoadState(cap)
    streak = state.streak + 1 if direction == state.direction else 1
    if streak < settings.load_dwell_observations:
        return LoadState(cap, direction, streak)
    if direction < 0:
        cap = max(lo, min(cap - 1, int(cap * settings.load_shrink_factor)))
    else:
        cap = min(settings.max_draft_tokens, cap + settings.load_grow_tokens)
    return LoadState(cap)
