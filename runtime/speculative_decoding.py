"""Speculative decoding of one request: draft -> verify -> accept, until EOS or the token limit.

The loop is the same for every configuration: with no drafter (or k = 0) each step is one target
pass over the pending token, i.e. plain decoding with a KV cache (our `target-only` baseline).
With a drafter, each step drafts k tokens (k from `speculation_control`), verifies them with one
target pass over [pending token, draft tokens] and keeps the accepted prefix plus one
recovered/bonus token (`speculative_sampling`). The target's KV cache is rolled back past rejected
tokens; the drafter syncs its own cache on the next proposal.

The multi-request, pipelined coordinator is `pipeline` (DESIGN.md §3); this module is its
single-request core and the reference the tests compare against.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from cosine.runtime.drafter import Draft, Drafter
from cosine.runtime.models import ModelRunner
from cosine.runtime.speculation_control import (
    CostModel,
    SpeculationSettings,
    SpeculationState,
    initial_state,
    next_draft_len,
    observe,
)
from cosine.runtime.speculative_sampling import (
    SamplingParams,
    VerificationResult,
    logits_to_probs,
    verify_greedy,
    verify_sampling,
)


@dataclass(frozen=True)
class StepOutput:
    """Tokens emitted by one step (prefill or one verification), in order."""

    token_ids: tuple[int, ...]
    num_draft_tokens: int
    num_accepted: int
    finished: bool
    drafter: str = ""  # who drafted this step's tokens ("" = no draft)
    mean_confidence: float = 0.0  # the drafter's mean top probability over its draft tokens


@dataclass
class GenerationStats:
    """Counters and timings of one request (seconds, tokens).

    mean_acceptance_length: tokens emitted per verification that had a draft (accepted + 1), as
    vLLM's `mean acceptance length`. acceptance_rate: accepted / drafted tokens.
    """

    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    wall_s: float = 0.0
    steps: int = 0
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    draft_lens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS) or "length", once finished
    speculation_state: SpeculationState | None = None  # the drafter's acceptance estimate at the end
    prefetch_hits: int = 0  # steps whose draft was drafted ahead, during the previous verification

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.output_tokens < 2:
            return None
        return (self.wall_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class GenerationResult:
    token_ids: tuple[int, ...]
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS) or "length"


def generate_stream(
    target: ModelRunner,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    *,
    drafter: Drafter | None = None,
    settings: SpeculationSettings = SpeculationSettings(),
    cost: CostModel | None = None,
    stop_token_ids: frozenset[int] | None = None,
    stats: GenerationStats | None = None,
    lookup: Drafter | None = None,
    initial: SpeculationState | None = None,
    request_id: str | None = None,
) -> Iterator[StepOutput]:
    """Generate up to `max_new_tokens` tokens after `prompt_ids`, yielding each step's tokens.

    Args:
        target: the target model.
        prompt_ids: prompt token ids (non-empty).
        max_new_tokens: limit on emitted tokens (>= 1).
        params: greedy (temperature 0) or sampling settings; `params.seed` seeds the RNG.
        drafter: proposes draft tokens; None = plain decoding.
        settings, cost: speculation policy and measured costs (see `speculation_control`).
        stop_token_ids: generation ends after emitting one of these (default: the target's EOS).
        stats: filled in as generation proceeds, if given.
        lookup: a free drafter (prompt lookup, `NgramDrafter`) tried first at every step; its draft
            is used when it proposes at least 2 tokens, otherwise `drafter` drafts. Its proposals
            cost no model pass, so it is consulted even when the policy says k = 0.
        initial: the drafter's acceptance estimate to start from (e.g. measured on earlier
            requests); default the settings' prior. The final estimate is left in
            `stats.speculation_state`.

    Raises:
        ValueError: empty prompt, max_new_tokens < 1, or prompt + output beyond the context.
    """
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt_ids) + max_new_tokens > target.max_context_tokens:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {target.max_context_tokens} tokens"
        )
    stop = target.eos_token_ids if stop_token_ids is None else stop_token_ids
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    generator = None
    if not params.greedy:
        generator = torch.Generator().manual_seed(params.seed if params.seed is not None else _fresh_seed())
    request_id = request_id or uuid.uuid4().hex
    seq = target.new_sequence()
    t0 = time.perf_counter()
    try:
        logits = target.forward(seq, prompt_ids, logits_to_keep=1)  # [1, vocab]
        first = _pick(logits[-1], params, generator)
        stats.ttft_s = time.perf_counter() - t0
        context = [*map(int, prompt_ids), first]
        emitted = 1
        finished = first in stop or emitted >= max_new_tokens
        stats.output_tokens, stats.wall_s = 1, time.perf_counter() - t0
        if finished:
            stats.finish_reason = "stop" if first in stop else "length"
        yield StepOutput((first,), 0, 0, finished)
        state = initial or initial_state(settings)
        propose_async = getattr(drafter, "propose_async", None)
        prefetch: _Prefetch | None = None
        while not finished:
            remaining = max_new_tokens - emitted
            draft = _take_prefetch(prefetch, context, remaining - 1)
            prefetch = None
            model_drafted = draft is not None
            if draft is not None:
                stats.prefetch_hits += 1
            else:
                draft = _propose(lookup, request_id, context, min(settings.max_draft_tokens, remaining - 1), params,
                                 settings, generator)
                if draft.num_tokens < 2:
                    k = 0
                    if drafter is not None:
                        state, k = next_draft_len(state, settings, cost)
                        k = min(k, remaining - 1)
                    draft = _propose(drafter, request_id, context, k, params, settings, generator)
                    model_drafted = draft.num_tokens > 0
            if propose_async is not None and model_drafted and remaining - 1 - draft.num_tokens >= 2:
                # Post-verify drafting (PEARL, arXiv:2408.11850): while the target verifies this
                # draft, the drafter (another process) drafts on, assuming every token is accepted.
                # Its first token is a guess of the bonus token; the rest is used only if the
                # guess is right, so the next proposal is then ready when verification ends.
                ahead = [*context, *draft.token_ids]
                state, k_ahead = next_draft_len(state, settings, cost)  # the policy sets the next k too
                k_ahead = max(1, min(k_ahead, remaining - 2 - draft.num_tokens))
                child = None  # the other thread gets its own RNG, seeded from ours: reproducible
                if generator is not None:
                    child = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (), generator=generator)))
                fut = propose_async(request_id, ahead, k_ahead + 1, params,
                                    min_confidence=settings.min_confidence, generator=child)
                prefetch = _Prefetch(tuple(ahead), fut)
            t_v = time.perf_counter()
            logits = target.forward(seq, [context[-1], *draft.token_ids])  # [k + 1, vocab]
            result = _verify(draft, logits, params, generator)
            target.rollback(seq, len(context) + result.num_accepted)
            stats.verify_s += time.perf_counter() - t_v
            new = _truncate(result.output_token_ids, stop, remaining)
            finished = (new[-1] in stop) or emitted + len(new) >= max_new_tokens
            context.extend(new)
            emitted += len(new)
            stats.steps += 1
            if draft.num_tokens:
                stats.num_drafts += 1
                stats.draft_tokens += draft.num_tokens
                stats.accepted_tokens += result.num_accepted
                stats.draft_s += draft.draft_s
                stats.draft_lens.append(draft.num_tokens)
                if model_drafted:
                    state = observe(state, settings, draft.num_tokens, result.num_accepted)
                    stats.speculation_state = state
            stats.output_tokens, stats.wall_s = emitted, time.perf_counter() - t0
            if finished:
                stats.finish_reason = "stop" if new[-1] in stop else "length"
            conf = sum(draft.confidences) / len(draft.confidences) if draft.confidences else 0.0
            yield StepOutput(new, draft.num_tokens, result.num_accepted, finished,
                             draft.drafter if draft.num_tokens else "", conf)
    finally:
        if prefetch is not None:
            _wait_quietly(prefetch.future)
        target.release(seq)
        for d in (drafter, lookup):
            if d is not None:
                d.release(request_id)


def generate(
    target: ModelRunner, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams = SamplingParams(), **kw
) -> GenerationResult:
    """Run `generate_stream` to completion. Same arguments."""
    stats = GenerationStats()
    tokens: list[int] = []
    last: StepOutput | None = None
    for last in generate_stream(target, prompt_ids, max_new_tokens, params, stats=stats, **kw):
        tokens.extend(last.token_ids)
    stop = kw.get("stop_token_ids") or target.eos_token_ids
    reason = "stop" if tokens and tokens[-1] in stop else "length"
    return GenerationResult(tuple(tokens), stats, reason)


def measure_cost_model(
    target: ModelRunner, drafter_runner: ModelRunner | None, *, context_tokens: int = 96, k: int = 8, repeats: int = 5
) -> CostModel:
    """Measure draft and verification costs once at start-up (seconds), on a synthetic context.

    verify_token_s comes from the difference between a (k + 1)-token and a 1-token target pass.
    Without a drafter, draft_token_s is 0 (e.g. an n-gram drafter). Each figure is the minimum over
    `repeats` passes (after one warm-up): on a shared machine interference only ever adds time.
    """

    def timed_pass(runner: ModelRunner, n: int) -> float:
        seq = runner.new_sequence()
        runner.forward(seq, [i % 1000 + 10 for i in range(context_tokens)], logits_to_keep=1)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            runner.forward(seq, list(range(100, 100 + n)))
            times.append(time.perf_counter() - t)
            runner.rollback(seq, context_tokens)
        runner.release(seq)
        return min(times[1:])

    base = timed_pass(target, 1)
    wide = timed_pass(target, k + 1)
    draft = timed_pass(drafter_runner, 1) if drafter_runner is not None else 0.0
    return CostModel(draft_token_s=draft, verify_base_s=base, verify_token_s=max(0.0, (wide - base) / k))


@dataclass(frozen=True)
class _Prefetch:
    """A draft requested for `context` (the current context + all draft tokens) before verification."""

    context: tuple[int, ...]
    future: Future


def _take_prefetch(prefetch: _Prefetch | None, context: list[int], max_tokens: int) -> Draft | None:
    """The prefetched draft minus its first token, if every draft token was accepted and that first
    token equals the bonus token the target chose; else None (the prefetch is wasted work)."""
    if prefetch is None:
        return None
    try:
        pre: Draft = prefetch.future.result()
    except Exception:  # a failed drafter costs speed, not the request: draft afresh
        return None
    n = len(prefetch.context)
    if len(context) != n + 1 or tuple(context[:n]) != prefetch.context:
        return None
    if pre.num_tokens < 2 or pre.token_ids[0] != context[-1] or max_tokens < 1:
        return None
    m = min(pre.num_tokens, max_tokens + 1)
    return Draft(
        pre.token_ids[1:m], pre.probs[1:m] if pre.probs is not None else None, pre.confidences[1:m], pre.drafter,
        pre.draft_s, pre.compressed[1:m],
    )


def _wait_quietly(future: Future) -> None:
    try:
        future.result()
    except Exception:  # the request is over; the drafter's failure was already counted or is moot
        pass


def _fresh_seed() -> int:
    return int.from_bytes(uuid.uuid4().bytes[:4], "little")


def _pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(logits_to_probs(logits[None], params)[0], 1, generator=generator))


def _propose(
    drafter: Drafter | None,
    request_id: str,
    context: list[int],
    k: int,
    params: SamplingParams,
    settings: SpeculationSettings,
    generator: torch.Generator | None,
) -> Draft:
    if drafter is None or k <= 0:
        return Draft((), None, (), "none", 0.0)
    return drafter.propose(request_id, context, k, params, min_confidence=settings.min_confidence, generator=generator)


def _verify(
    draft: Draft, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> VerificationResult:
    if params.greedy:
        return verify_greedy(draft.token_ids, logits)
    return verify_sampling(draft.token_ids, draft.probs, logits_to_probs(logits, params), generator)


def _truncate(tokens: Sequence[int], stop: frozenset[int], limit: int) -> tuple[int, ...]:
    """Cut after the first stop token and at `limit` tokens."""
    out: list[int] = []
    for t in tokens[:limit]:
        out.append(int(t))
        if t in stop:
            break
    return tuple(out)
