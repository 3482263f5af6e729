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
    """

    max_draft_tokens: int = 8
    adaptive: bool = True
    min_confidence: float = 0.0
    acceptance_prior: float = 0.7
    ema_weight: float = 0.3
    probe_interval_steps: int = 8
    probe_draft_tokens: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.max_draft_tokens <= 64:
            raise ValueError(f"max_draft_tokens must be in [0, 64], got {self.max_draft_tokens}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence}")
        if not 0.0 < self.ema_weight <= 1.0:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight}")


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
    state: SpeculationState, settings: SpeculationSettings, cost: CostModel | None
) -> tuple[SpeculationState, int]:
    """Draft length for the next step, and the state to carry.

    Without a cost model (not measured yet) or with `adaptive` off: `max_draft_tokens`.
    """
    if not settings.adaptive or cost is None:
        return state, settings.max_draft_tokens
    k = best_draft_len(state.acceptance_rate, cost, settings.max_draft_tokens)
    if k > 0:
        return replace(state, steps_since_probe=0), k
    if state.steps_since_probe + 1 >= settings.probe_interval_steps:
        return replace(state, steps_since_probe=0), min(settings.probe_draft_tokens, settings.max_draft_tokens)
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
