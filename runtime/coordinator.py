"""The coordinator: runs many requests against one target model and its drafters.

Requests arrive from the gateway (asyncio) and are served by one engine thread that owns the
models (torch is not re-entrant per model, and a CPU pass already uses every thread it is given).
The engine thread interleaves active requests step by step (round robin over their
`generate_stream` generators), so every stream makes progress and a long request does not block
short ones. Each step's tokens are handed back to the request's asyncio queue.

Admission: at most `max_running` requests are stepped at once; up to `max_waiting` more wait in
FIFO order; beyond that `submit` raises `Overloaded` (the gateway answers 429 with Retry-After).

Drafter faults cost speed, never a request: a drafter call that raises is logged, the drafter is
marked down for `drafter_retry_s`, and the step goes on without speculation (DESIGN.md §3).
The pipelined, batched scheduler (draft one group while verifying another) replaces the
round-robin loop in `pipeline` (issue #6); this module keeps the same interface.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from cosine.runtime import routing
from cosine.runtime.collaborative import CollaborativeDrafters
from cosine.runtime.drafter import Drafter
from cosine.runtime.models import ModelRunner
from cosine.runtime.speculation_control import CostModel, SpeculationSettings, initial_state
from cosine.runtime.speculative_decoding import GenerationStats, StepOutput, generate_stream
from cosine.runtime.speculative_sampling import SamplingParams

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
    steps: Iterator[StepOutput]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stats: GenerationStats
    submitted_at: float
    cancelled: bool = False


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
            self._drafter = CollaborativeDrafters(list(drafters), expertise, fusion_width=fusion_width,
                                                  tree_budget=tree_budget, retry_s=drafter_retry_s)
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
            steps = generate_stream(
                self.target, list(request.prompt_ids), request.max_tokens, request.params,
                drafter=self._drafter, settings=self.settings, cost=self.cost,
                stop_token_ids=request.stop_token_ids, stats=stats, lookup=self.lookup, request_id=request.request_id,
                initial=initial,
            )
            active = _Active(request, steps, asyncio.get_running_loop(), asyncio.Queue(), stats, time.perf_counter())
            self._waiting.append(active)
            if self.metrics:
                self.metrics.set_queue(len(self._running), len(self._waiting))
            self._cv.notify_all()
        return active

    def _engine_loop(self) -> None:
        torch.set_grad_enabled(False)
        idle_since = time.perf_counter()
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
                batch = list(self._running)
            if self.metrics:
                self.metrics.verifier_idle(time.perf_counter() - idle_since)
            busy_from = time.perf_counter()
            for a in batch:
                self._step(a)
            if self.metrics:
                self.metrics.verifier_busy(time.perf_counter() - busy_from)
                self.metrics.set_queue(len(self._running), len(self._waiting))
            idle_since = time.perf_counter()

    def _step(self, a: _Active) -> None:
        done = a.cancelled
        if not done:
            try:
                before = (a.stats.num_drafts, a.stats.draft_tokens, a.stats.accepted_tokens)
                out = next(a.steps)
                self._record(a, out, before)
                a.loop.call_soon_threadsafe(a.queue.put_nowait, out)
                done = out.finished
            except StopIteration:
                done = True
            except Exception as e:  # a bug or a bad request: fail this request, keep serving
                log.exception("request %s failed", a.request.request_id)
                a.loop.call_soon_threadsafe(a.queue.put_nowait, e)
                done = True
        if done:
            a.steps.close()
            a.loop.call_soon_threadsafe(a.queue.put_nowait, _DONE)
            with self._cv:
                if a in self._running:
                    self._running.remove(a)
            if self.metrics:
                reason = "abort" if a.cancelled and not a.stats.finish_reason else a.stats.finish_reason or "abort"
                self.metrics.request_finished(a.stats, time.perf_counter() - a.submitted_at, reason)

    def _record(self, a: _Active, out: StepOutput, before: tuple[int, int, int]) -> None:
        if self._drafter is not None:
            for o in out.outcomes:
                self._drafter.observe(a.request.request_id, o.drafter, o.num_draft_tokens, o.num_accepted,
                                      o.mean_confidence)
        if not self.metrics:
            return
        s = a.stats
        if s.steps == 0:
            self.metrics.first_token(s.ttft_s)
        if out.num_draft_tokens:
            self.metrics.spec_step(out.drafter, out.num_draft_tokens, out.num_accepted)
        self.metrics.tokens_verified(out.num_draft_tokens + 1)


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
