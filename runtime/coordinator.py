"""The coordinator: runs many requests against one target model and its drafters.

Requests arrive from the gateway (asyncio) and are served by one engine thread that owns the
models (torch is not re-entrant per model, and a CPU pass already uses every thread it is given).
Each running request is a `Generation` state machine (plan -> target pass -> apply). The engine
thread schedules them (Gao et al. 2025, arXiv:2503.10325, pipelining and batch scheduling):
- drafting: a request's next draft is planned as soon as its last verification is applied; when
  `pipelined`, on drafting threads, so drafters work on some requests while the target verifies
  others (the drafters are remote processes, or have cores of their own);
- batching: of the requests whose drafts are ready, `batching.plan_batch` picks the next pass
  under a token and memory budget (continuous batching: requests join and leave between passes,
  prefills are bounded so they do not starve decoding), and one `forward_batch` verifies them all;
- feedback: verifier idle time (waiting on drafts: the bubble) and the backlog of ready draft
  tokens left out of a pass feed `speculation_control.adjust_for_load`, which caps every
  request's speculation length.
Each step's tokens are handed back to the request's asyncio queue.

Admission: at most `max_running` requests are stepped at once; up to `max_waiting` more wait in
FIFO order; beyond that `submit` raises `Overloaded` (the gateway answers 429 with Retry-After).

Drafter faults cost speed, never a request: a drafter call that raises is logged, the drafter is
marked down for `drafter_retry_s`, and the step goes on without speculation.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from cosine.runtime import routing
from cosine.runtime.collaborative import CollaborativeDrafters
from cosine.runtime.drafter import Drafter
from cosine.runtime.models import ModelRunner
from cosine.runtime.speculation_control import (
    BatchedCost,
    CostModel,
    LoadSignal,
    PassCurve,
    SpeculationSettings,
    adjust_for_load,
    initial_load_state,
    initial_state,
)
from cosine.runtime.speculative_decoding import Generation, GenerationStats, StepOutput, VerifyWork, wait_quietly
from cosine.runtime.speculative_sampling import SamplingParams
from cosine.simulation.batching import BatchBudget, BatchSettings, PassCost, ReadyRequest, plan_batch

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """Too many requests waiting; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class GenerationRequest:
    """One request, in token ids. stop_token_ids None = the target's EOS tokens."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    domain: str | None = None  # routing label; None = classified from the prompt


@dataclass
class _Active:
    request: GenerationRequest
    gen: Generation
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stats: GenerationStats
    submitted_at: float
    cancelled: bool = False
    work: VerifyWork | None = None  # drafted and ready for the verifier
    drafting: Future | None = None  # plan() in flight on a drafting thread
    ready_since: float = 0.0
    last_tokens: int = 1  # tokens its last verification put in the pass (1 for a prefill)


_DONE = object()


class Coordinator:
    """Serves `GenerationRequest`s with speculative decoding on one engine thread.

    Args:
        target: the target model (verifier).
        drafters: candidate drafters, tried in order (the first one that is up drafts).
        settings: speculation policy. cost: measured costs for adaptive k (None = fixed k).
        max_running: requests stepped concurrently. max_waiting: queued beyond that before 429.
        metrics: a `cosine.runtime.metrics.ServingMetrics`, or None.
        lookup: a free drafter tried first at each step (prompt lookup), see `generate_stream`.
        expertise: declared domains per drafter name (the routing prior).
        fusion_width, tree_budget: pools drafting each request together and the token-tree size
            (see `collaborative.CollaborativeDrafters`); `drafters` may also be one already built.
        batch_budget, batch_settings: what one verification pass may take (`batching.plan_batch`);
            default: up to `max_running` requests and 128 tokens per pass.
        pipelined: draft on a separate thread while the target verifies other requests (right
            when drafters are remote processes or have their own cores); otherwise each round
            drafts for every request, then verifies them in one batch.
        pass_curve: the target's pass time vs tokens per pass (`measure_pass_curve`); default a
            line through `cost`. With a `cost`, each request's k is chosen on a `BatchedCost`:
            what its tokens add to a pass shared with the other running requests. Every pass's
            measured time refines the curve. batch_aware_k=False chooses k as if each request
            had the verifier to itself (`cost` as is: the ablation). pass_curve_weight: how far
            one measured pass moves the curve (`PassCurve.observe`; 0 keeps it as given).
    """

    def __init__(
        self,
        target: ModelRunner,
        drafters: Sequence[Drafter] = (),
        settings: SpeculationSettings = SpeculationSettings(),
        cost: CostModel | None = None,
        *,
        max_running: int = 8,
        max_waiting: int = 64,
        drafter_retry_s: float = 5.0,
        metrics=None,
        lookup: Drafter | None = None,
        expertise: dict[str, tuple[str, ...]] | None = None,
        fusion_width: int = 1,
        tree_budget: int = 16,
        batch_budget: BatchBudget | None = None,
        batch_settings: BatchSettings = BatchSettings(),
        pipelined: bool = False,
        pass_curve: PassCurve | None = None,
        batch_aware_k: bool = True,
        pass_curve_weight: float = 0.1,
    ) -> None:
        self.target = target
        self.settings = settings
        self.cost = cost
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.lookup = lookup
        self._drafter = None
        if isinstance(drafters, CollaborativeDrafters):
            self._drafter = drafters
        elif drafters:
            # drafting concurrently (fused pools, post-verify drafting) only when pipelined: in-process
            # drafters otherwise compete with the target for the same cores
            self._drafter = CollaborativeDrafters(list(drafters), expertise, fusion_width=fusion_width,
                                                  tree_budget=tree_budget, retry_s=drafter_retry_s,
                                                  parallel=pipelined)
        self.batch_budget = batch_budget or BatchBudget(max_tokens=128, max_kv_tokens=1 << 20,
                                                        max_requests=max_running)
        self.batch_settings = batch_settings
        verify_base = cost.verify_base_s if cost else 0.3
        self._pass_cost = PassCost(base_s=verify_base, per_token_s=cost.verify_token_s if cost else 0.05)
        self._pipelined = pipelined
        if pass_curve is None and cost is not None:
            pass_curve = PassCurve(((1, cost.verify_base_s), (9, cost.verify_base_s + 8 * cost.verify_token_s)))
        # up to the pass budget, so large batched passes correct the curve where they land
        self.pass_curve = pass_curve.extended(self.batch_budget.max_tokens) if pass_curve is not None else None
        self.batch_aware_k = batch_aware_k
        self.pass_curve_weight = pass_curve_weight
        self._draft_pool = ThreadPoolExecutor(max_workers=max(1, max_running), thread_name_prefix="cosine-plan")
        self._load = initial_load_state(settings)
        self._busy_s = self._idle_s = self._busy_window = self._idle_window = self._draft_busy_s = 0.0
        self._waiting: deque[_Active] = deque()
        self._running: list[_Active] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._engine_loop, name="cosine-engine", daemon=True)
        self._started = False

    @property
    def max_context_tokens(self) -> int:
        return self.target.max_context_tokens

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._started:
            self._thread.join(timeout_s)
        self._draft_pool.shutdown(wait=False)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[StepOutput, None]:
        """Stream the request's steps. Raises `Overloaded` at admission, `ValueError` for a bad
        request (empty prompt, max_tokens < 1, over the context). Cancelling the consumer (client
        disconnect) frees the request's slot."""
        _validate(request, self.max_context_tokens)
        self.start()
        active = self._admit(request)
        try:
            while True:
                item = await active.queue.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            active.cancelled = True

    def _admit(self, request: GenerationRequest) -> _Active:
        with self._cv:
            if self._stopping:
                raise Overloaded("server shutting down", 5)
            if len(self._running) + len(self._waiting) >= self.max_running + self.max_waiting:
                raise Overloaded(
                    f"{len(self._running)} requests running and {len(self._waiting)} waiting "
                    f"(max {self.max_running} + {self.max_waiting})", 1
                )
            stats = GenerationStats()
            initial = None
            if self._drafter is not None:
                domain = request.domain or routing.classify_prompt(self.target.decode(request.prompt_ids[-256:]))
                order = self._drafter.assign(request.request_id, domain)
                if order:  # start from the routed pool's measured acceptance on this domain
                    initial = initial_state(self.settings, self._drafter.expected_acceptance(order[0], domain))
            gen = Generation(
                self.target, list(request.prompt_ids), request.max_tokens, request.params,
                drafter=self._drafter, settings=self.settings, cost=self.cost,
                stop_token_ids=request.stop_token_ids, stats=stats, lookup=self.lookup, request_id=request.request_id,
                initial=initial,
            )
            gen.cap_tokens = self._load.cap_tokens
            active = _Active(request, gen, asyncio.get_running_loop(), asyncio.Queue(), stats, time.perf_counter())
            self._waiting.append(active)
            if self.metrics:
                self.metrics.set_queue(len(self._running), len(self._waiting))
            self._cv.notify_all()
        return active

    @property
    def verifier_idle_fraction(self) -> float | None:
        """Share of the engine's wall time the verifier spent with nothing ready to verify while
        requests were running (the pipeline's bubble), since start; None before any work."""
        total = self._busy_s + self._idle_s
        return self._idle_s / total if total > 0 else None

    def reset_counters(self) -> None:
        """Restart the verifier and drafter busy/idle accounting (e.g. after a warm-up)."""
        self._busy_s = self._idle_s = self._busy_window = self._idle_window = self._draft_busy_s = 0.0

    def _engine_loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not self._running:
                    self._cv.wait()
                if self._stopping:
                    for a in [*self._running, *self._waiting]:
                        a.loop.call_soon_threadsafe(a.queue.put_nowait, RuntimeError("server shutting down"))
                    return
                while self._waiting and len(self._running) < self.max_running:
                    self._running.append(self._waiting.popleft())
                running = list(self._running)
            self._iterate(running)

    def _iterate(self, running: list[_Active]) -> None:
        """One scheduling round: start drafting for requests that need it, wait (idle) until some
        are ready, verify a planned batch of them in one target pass, emit their tokens."""
        for a in running:
            if a.cancelled and a.drafting is None:
                self._finish(a)
            elif a.work is None and a.drafting is None:
                self._start_plan(a)
        ready = [a for a in running if self._collect(a)]
        if not ready:
            pending = [a.drafting for a in running if a.drafting is not None]
            if pending:  # the verifier waits for drafts: a bubble
                t = time.perf_counter()
                wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                self._idle(time.perf_counter() - t)
            return
        now = time.perf_counter()
        by_id = {a.request.request_id: a for a in ready}
        plan = plan_batch(
            [ReadyRequest(a.request.request_id, a.work.num_tokens, a.gen.seq.num_tokens, a.submitted_at,
                          a.ready_since, expected_accepted=1.0 + a.gen.state.acceptance_rate * (a.work.num_tokens - 1),
                          is_prefill=a.work.is_prefill) for a in ready],
            self.batch_budget, self.batch_settings, now, cost=self._pass_cost,
        )
        batch = [by_id[t.request_id] for t in plan.taken]
        for t in plan.taken:
            a = by_id[t.request_id]
            if a.work.is_prefill and t.num_tokens < a.work.num_tokens:
                a.work = a.gen.chunk_prefill(a.work, t.num_tokens)
        t0 = time.perf_counter()
        try:
            logits = self.target.forward_batch(
                [a.gen.seq for a in batch], [a.work.token_ids for a in batch], [a.work.parents for a in batch],
                [a.work.logits_to_keep for a in batch],
            )
        except Exception as e:  # a bug or a bad request: fail this batch's requests, keep serving
            log.exception("verification pass failed")
            for a in batch:
                self._fail(a, e)
            return
        busy = time.perf_counter() - t0
        self._busy(busy)
        for a in batch:
            a.last_tokens = 1 if a.work.is_prefill else a.work.num_tokens
        if self.pass_curve is not None and self.pass_curve_weight > 0:
            sizes = [a.work.num_tokens for a in batch]  # the rows forward_batch computed:
            rows = len(sizes) * max(sizes) if getattr(self.target, "last_layout", None) == "padded" else sum(sizes)
            self.pass_curve = self.pass_curve.observe(rows, busy, self.pass_curve_weight)
        if self.metrics:
            self.metrics.tokens_verified(sum(a.work.num_tokens for a in batch))
        for a, lg in zip(batch, logits, strict=True):
            work, a.work = a.work, None
            try:
                out = a.gen.apply(lg)
            except Exception as e:
                log.exception("request %s failed", a.request.request_id)
                self._fail(a, e)
                continue
            if out is None:  # a prefill chunk: the rest of the prompt goes in the next passes
                self._start_plan(a)
                continue
            self._record(a, out, work)
            a.loop.call_soon_threadsafe(a.queue.put_nowait, out)
            if out.finished or a.cancelled:
                self._finish(a)
            elif not self._pipelined:
                pass  # drafted at the start of the next round, on this thread
            else:
                self._start_plan(a)  # draft the next step while the verifier takes other requests
        backlog = sum(a.work.num_tokens for a in ready if a.work is not None)
        self._feedback(backlog)
        if self.metrics:
            self.metrics.set_queue(len(self._running), len(self._waiting))

    def _start_plan(self, a: _Active) -> None:
        if a.gen.finished:
            self._finish(a)
            return
        a.gen.cap_tokens = self._load.cap_tokens
        if self.batch_aware_k and self.cost is not None and self.pass_curve is not None:
            with self._cv:
                others = [o for o in self._running if o is not a]
            sizes = [_pass_tokens(o) for o in others]
            # A runner that packs batches (ModelRunner.forward_batch "auto") pads only where padding
            # is cheaper than packing, so a long draft costs its packed tokens; one that always pads
            # charges it for every row (BatchedCost.padded_to).
            padded_to = 0 if hasattr(self.target, "packs_better") else max(sizes, default=0)
            a.gen.cost = BatchedCost(self.cost.draft_token_s, self.pass_curve, other_tokens=sum(sizes),
                                     num_requests=1 + len(others), catch_up_token_s=self.cost.catch_up_token_s,
                                     padded_to=padded_to)
        if self._pipelined and a.gen.context:  # prefill has nothing to draft
            a.drafting = self._draft_pool.submit(self._timed_plan, a.gen)
            return
        try:
            a.work, a.ready_since = self._timed_plan(a.gen), time.perf_counter()
        except Exception as e:
            log.exception("request %s failed while drafting", a.request.request_id)
            self._fail(a, e)

    def _timed_plan(self, gen: Generation) -> VerifyWork:
        t = time.perf_counter()
        try:
            return gen.plan()
        finally:
            self._draft_busy_s += time.perf_counter() - t

    @property
    def drafter_idle_fraction(self) -> float | None:
        """Share of the engine's wall time (verifier busy + idle) with no draft being made, since
        start (0 when drafting threads overlap each other all the time); None before any work."""
        total = self._busy_s + self._idle_s
        if total <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self._draft_busy_s / total))

    def _collect(self, a: _Active) -> bool:
        """Whether `a` has work ready for the verifier (collecting a finished draft)."""
        if a.drafting is not None and a.drafting.done():
            fut, a.drafting = a.drafting, None
            try:
                a.work, a.ready_since = fut.result(), time.perf_counter()
            except Exception as e:
                log.exception("request %s failed while drafting", a.request.request_id)
                self._fail(a, e)
                return False
        if a.cancelled and a.drafting is None:
            self._finish(a)
            return False
        return a.work is not None

    def _feedback(self, backlog_tokens: int) -> None:
        """Backlog / idle feedback into every request's speculation length cap (hysteresis in
        `speculation_control.adjust_for_load`)."""
        window = self._busy_window + self._idle_window
        if window < 1.0:
            return
        signal = LoadSignal(self._idle_window / window, backlog_tokens, self.batch_budget.max_tokens)
        self._load = adjust_for_load(self._load, signal, self.settings)
        self._busy_window = self._idle_window = 0.0

    def _busy(self, seconds: float) -> None:
        self._busy_s += seconds
        self._busy_window += seconds
        if self.metrics:
            self.metrics.verifier_busy(seconds)

    def _idle(self, seconds: float) -> None:
        self._idle_s += seconds
        self._idle_window += seconds
        if self.metrics:
            self.metrics.verifier_idle(seconds)

    def _fail(self, a: _Active, error: Exception) -> None:
        a.loop.call_soon_threadsafe(a.queue.put_nowait, error)
        a.work = None
        self._finish(a)

    def _finish(self, a: _Active) -> None:
        if a.drafting is not None:
            wait_quietly(a.drafting)
            a.drafting = None
        a.work = None
        a.gen.close()
        a.loop.call_soon_threadsafe(a.queue.put_nowait, _DONE)
        with self._cv:
            if a in self._running:
                self._running.remove(a)
        if self.metrics:
            reason = "abort" if a.cancelled and not a.stats.finish_reason else a.stats.finish_reason or "abort"
            self.metrics.request_finished(a.stats, time.perf_counter() - a.submitted_at, reason)

    def _record(self, a: _Active, out: StepOutput, work: VerifyWork) -> None:
        if self._drafter is not None:
            for o in out.outcomes:
                self._drafter.observe(a.request.request_id, o.drafter, o.num_draft_tokens, o.num_accepted,
                                      o.mean_confidence)
        if not self.metrics:
            return
        s = a.stats
        if work.is_prefill:
            self.metrics.first_token(s.ttft_s)
        if out.num_draft_tokens:
            self.metrics.spec_step(out.drafter, out.num_draft_tokens, out.num_accepted)


def _pass_tokens(a: _Active) -> int:
    """Tokens `a` will likely put in the next pass: its planned draft, else its last one's size."""
    return a.work.num_tokens if a.work is not None and not a.work.is_prefill else a.last_tokens


def _validate(request: GenerationRequest, max_context_tokens: int) -> None:
    if not request.prompt_ids:
        raise ValueError("prompt is empty")
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
    if len(request.prompt_ids) + request.max_tokens > max_context_tokens:
        raise ValueError(
            f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the "
            f"model's context of {max_context_tokens} tokens"
        )
