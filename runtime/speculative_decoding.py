"""Speculative decoding of one request: draft -> verify -> accept, until EOS or the token limit.

The loop is the same for every configuration: with no drafter (or k = 0) each step is one target
pass over the pending token, i.e. plain decoding with a KV cache (our `target-only` baseline).
With a drafter, each step drafts k tokens (k from `speculation_control`), verifies them with one
target pass over [pending token, draft tokens] and keeps the accepted prefix plus one
recovered/bonus token (`speculative_sampling`). The target's KV cache is rolled back past rejected
tokens; the drafter syncs its own cache on the next proposal.

The multi-request, pipelined coordinator is `pipeline`; this module is its
single-request core and the reference the tests compare against.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

from cosine.runtime import fusion
from cosine.runtime.drafter import Draft, Drafter
from cosine.runtime.models import ModelRunner
from cosine.runtime.speculation_control import (
    Cost,
    CostModel,
    PassCurve,
    SpeculationSettings,
    SpeculationState,
    catch_up_pays,
    initial_state,
    next_draft_len,
    observe,
)
from cosine.runtime.speculative_sampling import (
    SamplingParams,
    TreeVerificationResult,
    VerificationResult,
    logits_to_probs,
    verify_greedy,
    verify_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
)

_EMPTY = Draft((), None, (), "none", 0.0)


@dataclass(frozen=True)
class DraftOutcome:
    """One drafter's part in a verification: its draft tokens and how many of them the target
    accepted (for a fused tree: the accepted path's agreement with this drafter's own draft)."""

    drafter: str
    num_draft_tokens: int
    num_accepted: int
    mean_confidence: float


@dataclass(frozen=True)
class StepOutput:
    """Tokens emitted by one step (prefill or one verification), in order.

    num_draft_tokens: draft tokens verified (tree nodes for a fused tree). drafter: the drafter
    whose draft the accepted tokens came from ("" = no draft; "fused" when several drafters tie).
    outcomes: per drafter that drafted this step, its draft and accepted counts (for routing).
    """

    token_ids: tuple[int, ...]
    num_draft_tokens: int
    num_accepted: int
    finished: bool
    drafter: str = ""
    mean_confidence: float = 0.0  # the drafter's mean top probability over its draft tokens
    outcomes: tuple[DraftOutcome, ...] = ()
    tree_nodes: int = 0  # token-tree nodes verified (0: a single chain)


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
    tree_steps: int = 0  # verifications of a fused token tree (several drafters' drafts)
    accepted_by: dict[str, int] = field(default_factory=dict)  # accepted draft tokens per drafter

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
            cost no model pass, but its tokens cost verification: its draft length is the policy's
            k for its own acceptance (`Generation.lookup_state`) with draft_token_s = 0.
        initial: the drafter's acceptance estimate to start from (e.g. measured on earlier
            requests); default the settings' prior. The final estimate is left in
            `stats.speculation_state`.

    Raises:
        ValueError: empty prompt, max_new_tokens < 1, or prompt + output beyond the context.
    """
    gen = Generation(target, prompt_ids, max_new_tokens, params, drafter=drafter, settings=settings, cost=cost,
                     stop_token_ids=stop_token_ids, stats=stats, lookup=lookup, initial=initial,
                     request_id=request_id)
    try:
        while not gen.finished:
            work = gen.plan()
            logits = target.forward_batch([gen.seq], [work.token_ids], [work.parents], [work.logits_to_keep])[0]
            out = gen.apply(logits)
            if out is not None:
                yield out
    finally:
        gen.close()


@dataclass(frozen=True)
class VerifyWork:
    """What one request needs from the next target pass: `token_ids` appended to its KV cache (the
    prompt at prefill; else the last accepted token then the draft tokens or tree nodes), with
    `parents` for a tree (None: a chain), and `logits_to_keep` rows (0 = all; prefill keeps 1)."""

    token_ids: tuple[int, ...]
    parents: tuple[int, ...] | None = None
    logits_to_keep: int = 0
    is_prefill: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Generation:
    """One request's speculative decoding as a state machine, so a scheduler can batch many:
    `plan()` drafts and returns the request's `VerifyWork`; the caller runs the target over it
    (alone, or batched with other requests through `ModelRunner.forward_batch` on `self.seq`);
    `apply(logits)` verifies, keeps the accepted KV, and returns the step's `StepOutput`.
    `generate_stream` is this loop for one request. Arguments as `generate_stream`.

    Raises:
        ValueError: empty prompt, max_new_tokens < 1, or prompt + output beyond the context.
    """

    def __init__(
        self,
        target: ModelRunner,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        *,
        drafter: Drafter | None = None,
        settings: SpeculationSettings = SpeculationSettings(),
        cost: Cost | None = None,
        stop_token_ids: frozenset[int] | None = None,
        stats: GenerationStats | None = None,
        lookup: Drafter | None = None,
        initial: SpeculationState | None = None,
        request_id: str | None = None,
    ) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) + max_new_tokens > target.max_context_tokens:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_new_tokens}) exceeds the model's "
                f"context of {target.max_context_tokens} tokens"
            )
        self.target, self.params, self.settings, self.cost = target, params, settings, cost
        self.drafter, self.lookup = drafter, lookup
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.max_new_tokens = max_new_tokens
        self.stop = target.eos_token_ids if stop_token_ids is None else stop_token_ids
        self.stats = stats if stats is not None else GenerationStats()
        self.stats.prompt_tokens = len(prompt_ids)
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else _fresh_seed())
        self.request_id = request_id or uuid.uuid4().hex
        self.seq = target.new_sequence()
        self.context: list[int] = []
        self.emitted = 0
        self.finished = False
        self.state = initial or initial_state(settings)
        self.lookup_state = initial_state(settings)  # prompt lookup's own acceptance on this request
        self.cap_tokens: int | None = None  # a load-dependent cap on k, set by the scheduler
        self._propose_async = (getattr(drafter, "propose_async", None)
                               if getattr(drafter, "drafts_ahead", True) else None)
        self._fuse_many = drafter.propose_many if getattr(drafter, "fuses", False) else None  # type: ignore
        self._weights_of = getattr(drafter, "weights", None)
        self._optimistic_of = getattr(drafter, "optimistic_acceptance", None)
        self._tree_budget = getattr(drafter, "tree_budget", settings.max_draft_tokens)
        self._prefetch: _Prefetch | None = None
        self._t0 = time.perf_counter()
        self._pending: _Pending | None = None
        self._prefilled = 0  # prompt tokens already in the KV cache (chunked prefill)
        self._drafter_seen = 0  # context tokens the model drafter has processed (as of its last draft)

    def chunk_prefill(self, work: VerifyWork, num_tokens: int) -> VerifyWork:
        """Shrink a planned prefill to its first `num_tokens` prompt tokens (chunked prefill: a
        long prompt goes in over several passes so it does not stall other requests' decoding).
        `apply` then returns None until the last chunk."""
        if not work.is_prefill or not 0 < num_tokens <= work.num_tokens:
            raise ValueError(f"cannot chunk {work.num_tokens} planned tokens to {num_tokens}")
        if num_tokens == work.num_tokens:
            return work
        assert self._pending is not None
        self._pending = _Pending("prefill-chunk", (), False, self._pending.planned_at)
        return VerifyWork(work.token_ids[:num_tokens], None, 1, is_prefill=True)

    def _next_k(self, remaining: int) -> int:
        """The model drafter's k: the policy's, or 0 when bringing the drafter up to date with the
        context (its prefill) would cost more than its drafts can save (`catch_up_pays`).

        The catch-up is weighed at the larger of the request's acceptance estimate and the router's
        optimistic (upper-bound) acceptance of its pool on the domain: weighed at a pessimistic
        prior, a pool the router has no evidence for would never catch up, never draft, and so
        never produce the evidence that could show it pays."""
        self.state, k = next_draft_len(self.state, self.settings, self.cost, cap_tokens=self.cap_tokens)
        k = min(k, remaining - 1)
        behind = len(self.context) - self._drafter_seen
        if k > 0 and self.settings.adaptive and self.cost is not None and behind > self.settings.free_catch_up_tokens:
            alpha = self.state.acceptance_rate
            if self._optimistic_of is not None:
                alpha = max(alpha, self._optimistic_of(self.request_id))
            if not catch_up_pays(max(alpha, 1e-6), self.cost, behind, remaining, self.settings):
                return 0
        return k

    def _lookup_k(self, remaining: int) -> int:
        """Prompt lookup's draft length: free to draft, not to verify (goodput with no draft cost)."""
        if self.lookup is None:
            return 0
        free = None if self.cost is None else replace(self.cost, draft_token_s=0.0)
        self.lookup_state, k = next_draft_len(self.lookup_state, self.settings, free, cap_tokens=self.cap_tokens)
        return min(k, remaining - 1)

    def plan(self) -> VerifyWork:
        """Draft (if speculating) and return the tokens the target must process next.

        Raises:
            RuntimeError: the request is finished, or `apply` was not called after the last plan.
        """
        if self.finished or self._pending is not None:
            raise RuntimeError("plan() needs an unfinished request whose last plan was applied")
        if not self.context:
            self._pending = _Pending("prefill", (), False, time.perf_counter())
            return VerifyWork(tuple(self.prompt_ids[self._prefilled:]), None, 1, is_prefill=True)
        settings, params, context = self.settings, self.params, self.context
        remaining = self.max_new_tokens - self.emitted
        draft = _take_prefetch(self._prefetch, context, remaining - 1)
        self._prefetch = None
        model_drafted = draft is not None
        drafts: list[Draft] = []
        if draft is not None:
            self.stats.prefetch_hits += 1
        else:
            draft = _propose(self.lookup, self.request_id, context, self._lookup_k(remaining), params, settings,
                             self.generator)
            if self._fuse_many is not None:
                # collaborative drafting: the routed pools draft too, and the drafts are fused.
                # Prompt lookup is free; when its draft already covers the policy's k, model
                # drafting would cost more than the branch it adds, so lookup drafts alone.
                k = self._next_k(remaining)
                covered = draft.num_tokens >= max(2, k)
                many = self._fuse_many(self.request_id, context, k, params, min_confidence=settings.min_confidence,
                                       generator=self.generator) if k > 0 and not covered else []
                model_drafted = bool(many)
                drafts = [d for d in (draft, *many) if d.num_tokens]
                draft = drafts[0] if len(drafts) == 1 else _EMPTY
            elif draft.num_tokens < 2:
                k = self._next_k(remaining) if self.drafter is not None else 0
                if k > draft.num_tokens:
                    draft = _propose(self.drafter, self.request_id, context, k, params, settings, self.generator)
                    model_drafted = draft.num_tokens > 0
        if len(drafts) > 1:
            tree = fusion.fuse([_path(d) for d in drafts], max(1, min(self._tree_budget, remaining - 1)),
                               self._weights_of(self.request_id) if self._weights_of else None)
            if model_drafted:
                self._drafter_seen = len(context)
            self._pending = _Pending(tree, tuple(drafts), model_drafted, time.perf_counter())
            return VerifyWork((context[-1], *tree.token_ids), (-1, *(p + 1 for p in tree.parents)))
        k_ahead = 0
        if self._propose_async is not None and model_drafted and remaining - 1 - draft.num_tokens >= 2:
            k_ahead = min(self._next_k(remaining), remaining - 2 - draft.num_tokens)
        if k_ahead > 0:
            # Post-verify drafting (PEARL, arXiv:2408.11850): while the target verifies this draft,
            # the drafter (another process) drafts on, assuming every token is accepted. Its first
            # token is a guess of the bonus token; the rest is used only if the guess is right, so
            # the next proposal is then ready when verification ends.
            ahead = [*context, *draft.token_ids]
            child = None  # the other thread gets its own RNG, seeded from ours: reproducible
            if self.generator is not None:
                child = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (), generator=self.generator)))
            fut = self._propose_async(self.request_id, ahead, k_ahead + 1, params,
                                      min_confidence=settings.min_confidence, generator=child)
            self._prefetch = _Prefetch(tuple(ahead), fut)
        if model_drafted:
            self._drafter_seen = len(context)
        self._pending = _Pending("chain", (draft,), model_drafted, time.perf_counter())
        return VerifyWork((context[-1], *draft.token_ids))

    def apply(self, logits: torch.Tensor) -> StepOutput | None:
        """Verify the planned work against the target's `logits` for it ([rows, vocab] as the
        `VerifyWork` asked) and emit the step's tokens (None after a prefill chunk that is not the
        prompt's last)."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("apply() without a plan()")
        stats, context = self.stats, self.context
        if pending.kind == "prefill-chunk":
            self._prefilled = self.seq.num_tokens
            return None
        if pending.kind == "prefill":
            first = _pick(logits[-1], self.params, self.generator)
            stats.ttft_s = time.perf_counter() - self._t0
            self.context = [*self.prompt_ids, first]
            self.emitted = 1
            self.finished = first in self.stop or self.emitted >= self.max_new_tokens
            stats.output_tokens, stats.wall_s = 1, time.perf_counter() - self._t0
            if self.finished:
                stats.finish_reason = "stop" if first in self.stop else "length"
            return StepOutput((first,), 0, 0, self.finished)
        remaining = self.max_new_tokens - self.emitted
        if isinstance(pending.kind, fusion.TokenTree):
            tree, drafts = pending.kind, pending.drafts
            tv = _verify_tree(tree, logits, self.params, self.generator)
            self.target.keep_path(self.seq, len(context) - 1, [0, *(i + 1 for i in tv.path)])
            outcomes = tuple(_outcome(d, tree, tv.path) for d in drafts)
            result_tokens, num_accepted, num_draft = tv.output_token_ids, tv.num_accepted, tree.num_nodes
            stats.tree_steps += 1
            stats.draft_s += sum(d.draft_s for d in drafts)
            winner = max(outcomes, key=lambda o: o.num_accepted)
            model_outcomes = [o for o in outcomes if self.lookup is None or o.drafter != self.lookup.name]
            for o in outcomes:
                if self.lookup is not None and o.drafter == self.lookup.name:
                    self.lookup_state = observe(self.lookup_state, self.settings, o.num_draft_tokens, o.num_accepted)
            if pending.model_drafted and model_outcomes:
                best = max(model_outcomes, key=lambda o: o.num_accepted)
                self.state = observe(self.state, self.settings, best.num_draft_tokens, best.num_accepted)
                stats.speculation_state = self.state
            step_drafter = winner.drafter if num_accepted else "fused"
            tree_nodes = tree.num_nodes
        else:
            draft = pending.drafts[0]
            result = _verify(draft, logits, self.params, self.generator)
            self.target.rollback(self.seq, len(context) + result.num_accepted)
            result_tokens, num_accepted, num_draft = result.output_token_ids, result.num_accepted, draft.num_tokens
            conf = sum(draft.confidences) / len(draft.confidences) if draft.confidences else 0.0
            outcomes = (DraftOutcome(draft.drafter, draft.num_tokens, num_accepted, conf),) if num_draft else ()
            if num_draft:
                stats.draft_s += draft.draft_s
                if pending.model_drafted:
                    self.state = observe(self.state, self.settings, draft.num_tokens, num_accepted)
                    stats.speculation_state = self.state
                elif self.lookup is not None and draft.drafter == self.lookup.name:
                    self.lookup_state = observe(self.lookup_state, self.settings, draft.num_tokens, num_accepted)
            step_drafter = draft.drafter if num_draft else ""
            tree_nodes = 0
        stats.verify_s += time.perf_counter() - pending.planned_at
        new = _truncate(result_tokens, self.stop, remaining)
        self.finished = (new[-1] in self.stop) or self.emitted + len(new) >= self.max_new_tokens
        context.extend(new)
        self.emitted += len(new)
        stats.steps += 1
        if num_draft:
            stats.num_drafts += 1
            stats.draft_tokens += num_draft
            stats.accepted_tokens += num_accepted
            stats.draft_lens.append(num_draft)
            for o in outcomes:
                if o.num_accepted:
                    stats.accepted_by[o.drafter] = stats.accepted_by.get(o.drafter, 0) + o.num_accepted
        stats.output_tokens, stats.wall_s = self.emitted, time.perf_counter() - self._t0
        if self.finished:
            stats.finish_reason = "stop" if new[-1] in self.stop else "length"
        mean_conf = outcomes[0].mean_confidence if len(outcomes) == 1 else 0.0
        return StepOutput(new, num_draft, num_accepted, self.finished, step_drafter, mean_conf, outcomes, tree_nodes)

    def close(self) -> None:
        """Free the request's KV caches (target and drafters); wait for a draft still in flight."""
        if self._prefetch is not None:
            wait_quietly(self._prefetch.future)
            self._prefetch = None
        self.target.release(self.seq)
        for d in (self.drafter, self.lookup):
            if d is not None:
                d.release(self.request_id)


@dataclass(frozen=True)
class _Pending:
    """A planned step awaiting the target's logits: kind "prefill", "chain", or the TokenTree."""

    kind: object
    drafts: tuple[Draft, ...]
    model_drafted: bool
    planned_at: float


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

    verify_token_s comes from the difference between a (k + 1)-token and a 1-token target pass;
    catch_up_token_s from a drafter prefill of the context. Without a drafter (e.g. an n-gram
    drafter) draft_token_s and catch_up_token_s are 0. Each figure is the minimum over `repeats`
    passes (after one warm-up): on a shared machine interference only ever adds time.
    """

    def timed_pass(runner: ModelRunner, n: int) -> float:
        seq = runner.new_sequence()
        runner.forward(seq, _synthetic_ids(runner, context_tokens), logits_to_keep=1)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            runner.forward(seq, _synthetic_ids(runner, n, start=100))
            times.append(time.perf_counter() - t)
            runner.rollback(seq, context_tokens)
        runner.release(seq)
        return min(times[1:])

    def timed_prefill(runner: ModelRunner) -> float:
        times = []
        for _ in range(repeats + 1):
            seq = runner.new_sequence()
            t = time.perf_counter()
            runner.forward(seq, _synthetic_ids(runner, context_tokens), logits_to_keep=1)
            times.append(time.perf_counter() - t)
            runner.release(seq)
        return min(times[1:]) / context_tokens

    base = timed_pass(target, 1)
    wide = timed_pass(target, k + 1)
    draft = timed_pass(drafter_runner, 1) if drafter_runner is not None else 0.0
    catch_up = timed_prefill(drafter_runner) if drafter_runner is not None else 0.0
    return CostModel(draft_token_s=draft, verify_base_s=base, verify_token_s=max(0.0, (wide - base) / k),
                     catch_up_token_s=catch_up)


def measure_pass_curve(
    target: ModelRunner, tokens: Sequence[int] = (1, 2, 4, 8, 16, 32), *, context_tokens: int = 96, repeats: int = 2
) -> PassCurve:
    """Measure the target's pass time for each number of `tokens` in one pass (seconds), on a
    synthetic context of `context_tokens`: the start-up `PassCurve` the batch-aware k policy uses.
    Each point is the minimum over `repeats` passes after one warm-up; the curve is made
    non-decreasing. Raises ValueError if `tokens` does not start at 1 and increase strictly."""
    PassCurve(tuple((int(n), 1.0) for n in tokens))  # validate before spending passes
    seq = target.new_sequence()
    try:
        target.forward(seq, _synthetic_ids(target, context_tokens), logits_to_keep=1)
        points: list[tuple[int, float]] = []
        for n in tokens:
            times = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                target.forward(seq, _synthetic_ids(target, n, start=100))  # a verification keeps every row
                times.append(time.perf_counter() - t)
                target.rollback(seq, context_tokens)
            points.append((int(n), max(min(times[1:]), points[-1][1] if points else 1e-6)))
    finally:
        target.release(seq)
    return PassCurve(tuple(points))


def _synthetic_ids(runner: ModelRunner, n: int, *, start: int = 10) -> list[int]:
    """n token ids for timing passes: start, start + 1, ... (wrapping at 1000), within the vocabulary."""
    return [(start + i % 1000) % runner.vocab_size for i in range(n)]


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


def wait_quietly(future: Future) -> None:
    """Wait for a draft still in flight, ignoring its failure (its request is over or moved on)."""
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


def _verify_tree(tree: fusion.TokenTree, logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> TreeVerificationResult:
    if params.greedy:
        return verify_tree_greedy(tree, logits)
    return verify_tree_sampling(tree, logits_to_probs(logits, params), generator)


def _path(draft: Draft) -> fusion.DraftPath:
    rows = list(draft.probs) if draft.probs is not None else None
    return fusion.DraftPath(draft.drafter, draft.token_ids, draft.confidences, rows)


def _outcome(draft: Draft, tree: fusion.TokenTree, path: Sequence[int]) -> DraftOutcome:
    """How far the accepted path follows `draft`'s own tokens (its acceptance, for routing)."""
    n = 0
    while n < len(path) and n < draft.num_tokens and tree.nodes[path[n]].token_id == draft.token_ids[n]:
        n += 1
    kept = sum(1 for node in tree.nodes if any(p.drafter == draft.drafter for p in node.proposals))
    conf = sum(draft.confidences) / len(draft.confidences) if draft.confidences else 0.0
    return DraftOutcome(draft.drafter, kept, n, conf)


def _truncate(tokens: Sequence[int], stop: frozenset[int], limit: int) -> tuple[int, ...]:
    """Cut after the first stop token and at `limit` tokens."""
    out: list[int] = []
    for t in tokens[:limit]:
        out.append(int(t))
        if t in stop:
            break
    return tuple(out)
