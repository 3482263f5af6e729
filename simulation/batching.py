"""Batch scheduling of the simulated verifier: which drafted requests its next pass takes.

Gao et al. 2025 (CoSine, arXiv:2503.10325), batch scheduling: the verifier "selectively groups
requests" for latency and throughput under a token budget. Throughput is scored as goodput,
expected emitted tokens per second of verifier time (SmartSpec, arXiv:2406.14066). The serving
path leaves this to vLLM's scheduler; the simulator (`cluster`) plans its passes with it.

Pure policy: a snapshot of ready requests, the budget and the measured pass cost in,
a `BatchPlan` out; no torch, no clock (`now_s` is passed in). Requests not taken stay ready.

Order of the pass: requests ready for longer than `max_wait_s` first (oldest first, the starvation
guard), then the rest by `latency_weight * urgency + (1 - latency_weight) * goodput`, each min-max
normalised over the ready set. Urgency is earliest-deadline-first; a request without a deadline has
one `default_slo_s` after its arrival, so among such requests it is first-come-first-served. Requests
are added greedily while they fit; a prefill may be given a chunk of its tokens (chunked prefill),
a draft is taken whole, or, if it alone exceeds the token budget, clipped to the budget as the only
request of its pass (verifying a prefix of a draft is lossless). So whenever some ready request fits
the memory bound alone, the plan takes at least one request, and none waits past `max_wait_s` for
more than the passes its elders need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_MIN_COST_S = 1e-9  # floor of a request's marginal pass time, so a free pass scores finitely


@dataclass(frozen=True)
class ReadyRequest:
    """A request waiting for verification (or for its prefill), as the scheduler sees it.

    num_tokens: tokens it adds to the pass (draft tokens or tree nodes + 1; for a prefill, its
    remaining prompt tokens). kv_tokens: its KV cache length before the pass. arrival_s: when the
    request arrived; ready_since_s: since when it waits for this pass; deadline_s: when it should
    have its next token (None: `default_slo_s` after arrival); all on the caller's clock, seconds.
    expected_accepted: tokens it emits if verified (e.g. `speculation_control.expected_tokens`;
    for a prefill, 1 once the whole prompt is in).
    """

    request_id: str
    num_tokens: int
    kv_tokens: int
    arrival_s: float
    ready_since_s: float
    expected_accepted: float = 1.0
    deadline_s: float | None = None
    is_prefill: bool = False

    def __post_init__(self) -> None:
        if self.num_tokens < 1 or self.kv_tokens < 0 or self.expected_accepted < 0:
            raise ValueError(f"invalid ready request {self!r}")


@dataclass(frozen=True)
class BatchBudget:
    """Limits of one verification pass: max_tokens (sum of tokens in the pass), max_kv_tokens (sum
    of each request's kv_tokens + its tokens in the pass: the KV memory bound), max_requests."""

    max_tokens: int
    max_kv_tokens: int
    max_requests: int

    def __post_init__(self) -> None:
        if min(self.max_tokens, self.max_kv_tokens, self.max_requests) < 1:
            raise ValueError(f"budget limits must be positive, got {self!r}")


@dataclass(frozen=True)
class PassCost:
    """Target pass time in seconds, measured by the engine at start-up:
    base_s + per_token_s * tokens + per_request_s * requests (0 for an empty pass)."""

    base_s: float
    per_token_s: float
    per_request_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.base_s, self.per_token_s, self.per_request_s) < 0:
            raise ValueError(f"pass costs must be non-negative, got {self!r}")

    def pass_s(self, num_tokens: int, num_requests: int) -> float:
        if num_requests == 0:
            return 0.0
        return self.base_s + self.per_token_s * num_tokens + self.per_request_s * num_requests


@dataclass(frozen=True)
class BatchSettings:
    """latency_weight: in [0, 1]; 1 = latency-first (most urgent first), 0 = throughput-first (most
    expected tokens per second of marginal pass time first). prefill_chunk_tokens: most prompt
    tokens of one request per pass. max_prefill_share: fraction of max_tokens prefills may take
    while decode requests are waiting. max_wait_s: a request ready for longer goes first, whatever
    the weight. default_slo_s: deadline, after arrival, of requests that give none."""

    latency_weight: float = 0.5
    prefill_chunk_tokens: int = 512
    max_prefill_share: float = 0.5
    max_wait_s: float = 1.0
    default_slo_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.latency_weight <= 1.0:
            raise ValueError(f"latency_weight must be in [0, 1], got {self.latency_weight}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be positive, got {self.prefill_chunk_tokens}")
        if not 0.0 <= self.max_prefill_share <= 1.0:
            raise ValueError(f"max_prefill_share must be in [0, 1], got {self.max_prefill_share}")
        if self.max_wait_s <= 0 or self.default_slo_s <= 0:
            raise ValueError(f"max_wait_s and default_slo_s must be positive, got {self!r}")


@dataclass(frozen=True)
class TakenRequest:
    """A request in the pass and how many of its tokens it may use (a prefill chunk, or a draft
    clipped to the budget: verify the first num_tokens - 1 draft tokens)."""

    request_id: str
    num_tokens: int


@dataclass(frozen=True)
class BatchPlan:
    """taken: in scheduling order. skipped: ids not taken, in input order (they stay ready).
    estimated_pass_s: the pass time by the `PassCost`, seconds."""

    taken: tuple[TakenRequest, ...]
    skipped: tuple[str, ...]
    estimated_pass_s: float

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.taken)


def _minmax(values: Sequence[float]) -> list[float]:
    lo, hi = min(values), max(values)
    return [(v - lo) / (hi - lo) if hi > lo else 0.0 for v in values]


def _order(ready: Sequence[ReadyRequest], cost: PassCost, s: BatchSettings, now_s: float) -> list[ReadyRequest]:
    starving = sorted((r for r in ready if now_s - r.ready_since_s > s.max_wait_s),
                      key=lambda r: (r.ready_since_s, r.arrival_s, r.request_id))
    rest = [r for r in ready if now_s - r.ready_since_s <= s.max_wait_s]
    if not rest:
        return starving
    deadline = [r.deadline_s if r.deadline_s is not None else r.arrival_s + s.default_slo_s for r in rest]
    goodput: list[float] = []
    for r in rest:
        n = min(r.num_tokens, s.prefill_chunk_tokens) if r.is_prefill else r.num_tokens
        tokens = r.expected_accepted * n / r.num_tokens  # a prefill chunk earns its share of the first token
        goodput.append(tokens / max(cost.per_request_s + cost.per_token_s * n, _MIN_COST_S))
    urgency, value = _minmax([now_s - d for d in deadline]), _minmax(goodput)
    w = s.latency_weight
    keyed = sorted(range(len(rest)), key=lambda i: (-(w * urgency[i] + (1 - w) * value[i]), deadline[i],
                                                    rest[i].arrival_s, rest[i].request_id))
    return starving + [rest[i] for i in keyed]


def plan_batch(
    ready: Sequence[ReadyRequest], budget: BatchBudget, settings: BatchSettings, now_s: float, *, cost: PassCost
) -> BatchPlan:
    """Choose the requests (and their token counts) for the next verification pass.

    Args:
        ready: requests waiting, drafted (or prefilling). now_s: the caller's clock, seconds.
        cost: measured pass cost, for the goodput score and `estimated_pass_s`.
    Returns a plan within `budget`, except a single draft larger than `max_tokens` (clipped to it)
    which is then the pass's only request. Raises ValueError on duplicate request ids.
    """
    if len({r.request_id for r in ready}) != len(ready):
        raise ValueError("duplicate request_id in ready")

    def fits_alone(r: ReadyRequest) -> bool:
        return r.kv_tokens + (1 if r.is_prefill else min(r.num_tokens, budget.max_tokens)) <= budget.max_kv_tokens

    # Chunked prefill (Sarathi-Serve, arXiv:2403.02369): prompts share the pass with decodes
    # instead of stalling them, up to max_prefill_share of the tokens while any decode can run.
    decode_waiting = any(not r.is_prefill and fits_alone(r) for r in ready)
    prefill_left = int(settings.max_prefill_share * budget.max_tokens) if decode_waiting else budget.max_tokens
    tokens_left, kv_left = budget.max_tokens, budget.max_kv_tokens
    taken: list[TakenRequest] = []
    for r in _order(ready, cost, settings, now_s):
        if len(taken) >= budget.max_requests:
            break
        if r.is_prefill:
            starving = now_s - r.ready_since_s > settings.max_wait_s  # the guard overrides the share
            share = tokens_left if starving else prefill_left
            n = min(r.num_tokens, settings.prefill_chunk_tokens, tokens_left, share, kv_left - r.kv_tokens)
        else:
            n = r.num_tokens if taken else min(r.num_tokens, budget.max_tokens)
            if n > tokens_left or r.kv_tokens + n > kv_left:
                continue
        if n < 1:
            continue
        taken.append(TakenRequest(r.request_id, n))
        tokens_left -= n
        kv_left -= r.kv_tokens + n
        if r.is_prefill:
            prefill_left = max(0, prefill_left - n)
    ids = {t.request_id for t in taken}
    total = sum(t.num_tokens for t in taken)
    return BatchPlan(tuple(taken), tuple(r.request_id for r in ready if r.request_id not in ids),
                     cost.pass_s(total, len(taken)))
