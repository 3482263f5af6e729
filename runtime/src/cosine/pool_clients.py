"""The proposer's drafter pools, as clients: asks that run on threads and are never waited for.

`PoolClients` submits each draft call to an executor (the proposer's own threads, or the
simulator's simulated time) and returns its future at once; the proposer looks at the future on a
later step and takes the draft only if it has arrived (`continuation`). What each answer teaches
is kept here: the pool's round trip and seconds per draft token (`PoolPolicy.learn_speed`), its
yield (accepted tokens per call, decayed), and its `Breaker` (`pool_down_after` failures in a row
leave it out for `pool_retry_s`, with one warning per `pool_warn_every_s` at most). A request is
released on its pools only once its calls have returned: a `Release` that overtook a `Propose`
would be undone by it. A crashed or hung pool costs drafts, never a request.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

from cosine.breaker import Breaker
from cosine.drafter import Drafter
from cosine.pool_policy import PoolPolicy
from cosine.proposer_stats import ProposerStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolDraft:
    """A pool's drafts for the context it was asked about (its length and its last token): each
    candidate is (tokens after that context, their confidences): the main draft and its branches,
    with the expected tokens they continue put in front; `drafted`: the tokens the pool drafted."""

    context_len: int
    context_last: int
    candidates: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]
    drafted: int = 0  # tokens the pool drafted for the call (main draft and branches)


def continuation(d: PoolDraft, ctx: Sequence[int]) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """The longest rest of a candidate of `d` that continues `ctx`: the context `d` was asked for
    is a prefix of `ctx` and the tokens emitted since are the candidate's own first tokens."""
    skip = len(ctx) - d.context_len
    if skip < 0 or ctx[d.context_len - 1] != d.context_last:
        return None
    emitted = list(ctx[d.context_len :])
    best = None
    for tokens, confs in d.candidates:
        longer = best is None or len(tokens) - skip > len(best[0])
        if skip < len(tokens) and longer and list(tokens[:skip]) == emitted:
            best = (tokens[skip:], confs[skip:])
    return best


class PoolClients:
    """Draft calls to the pools, and what their answers teach (see the module docstring).

    Args:
        pools: the drafter pools (`Drafter`s: a `transport.replica_pool.ReplicaPool` in deployments).
        stats: where calls, errors, round trips, seconds per token and yields are counted.
        clock: monotonic seconds (the simulator's simulated time in the simulator).
        min_confidence: the pools stop a draft at the first token below this top-1 probability.
        down_after / retry_s: each pool's `Breaker`; warn_every_s: one warning per pool at most
            this often; yield_decay: per-call decay of a pool's (accepted, calls) counts.
        executor: where calls run (default: threads of this object's own, two per pool).
    """

    def __init__(self, pools: Sequence[Drafter], stats: ProposerStats, clock: Callable[[], float], *,
                 min_confidence: float = 0.0, down_after: int = 3, retry_s: float = 5.0,
                 warn_every_s: float = 60.0, yield_decay: float = 0.97, executor: Executor | None = None) -> None:
        self.pools = {p.name: p for p in pools}
        self.stats, self.clock = stats, clock
        self.breakers = {p.name: Breaker(down_after, retry_s) for p in pools}
        self._min_confidence, self._warn_every_s, self._yield_decay = min_confidence, warn_every_s, yield_decay
        self._lock = threading.Lock()
        self._yield_counts: dict[str, tuple[float, float]] = {}  # pool -> decayed (accepted, calls)
        self._warned_s: dict[str, float] = {}  # pool -> when its last warning was logged
        self._closed = False
        self._executor = executor or ThreadPoolExecutor(max_workers=max(1, 2 * len(pools)),
                                                        thread_name_prefix="cosine-pool")

    def __contains__(self, name: object) -> bool:
        return name in self.pools

    def __bool__(self) -> bool:
        return bool(self.pools)

    def allows(self, name: str, now_s: float) -> bool:
        """Whether the pool may be asked at `now_s`: its breaker is closed and it has a replica
        (`ready`, where the pool counts them: a pool the autoscaler took to zero has none, and
        asking it would only fail; the proposer counts those asks as skipped "down", the demand
        that brings it back)."""
        return self.breakers[name].allows(now_s) and getattr(self.pools[name], "ready", 1) > 0

    def ask(self, name: str, rid: str, ctx: tuple[int, ...], k: int, expected: tuple[int, ...] = (),
            branches: int = 0, *, prefill: bool = False) -> Future:
        """Submit one draft call (Future[PoolDraft]). When it returns, the pool's round trip
        (ask to answer) is learnt and, unless the call took in a whole prompt (`prefill`), its
        seconds per draft token."""
        asked_s = self.clock()
        fut = self._executor.submit(self._draft_on_pool, name, rid, ctx, k, expected, branches)
        fut.add_done_callback(lambda f: self._answered(name, asked_s, f, prefill))
        return fut

    def accepted(self, name: str, tokens: int) -> None:
        """Tokens of the pool's drafts the target accepted: its yield."""
        self._count_yield(name, accepted=tokens)

    def release(self, request_id: str, used: Collection[str], pending: Sequence[Future]) -> None:
        """Release a finished request on every pool in `used` once its `pending` calls returned
        (each has a deadline). Never blocks."""
        left, lock = [len(pending)], threading.Lock()

        def one_returned(_: Future | None = None) -> None:
            with lock:
                left[0] -= 1
                if left[0] > 0 or self._closed:  # closing: the executor's shutdown cancels calls and runs
                    return  # this callback under its own lock (a submit would deadlock); pools evict anyway
            for name in used:
                with contextlib.suppress(RuntimeError):  # shut down meanwhile
                    self._executor.submit(self._release_on_pool, name, request_id)

        if not pending:
            left[0] = 1
            one_returned()
        for f in pending:
            f.add_done_callback(one_returned)

    def replica_stats(self) -> dict[str, dict]:
        """Per pool with replicas (`ReplicaPool`), its per-replica counters (`replica_stats()`)."""
        return {name: pool.replica_stats() for name, pool in self.pools.items() if hasattr(pool, "replica_stats")}

    def close(self) -> None:
        """Stop the call threads without waiting; queued calls are cancelled."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _answered(self, name: str, asked_s: float, fut: Future, prefill: bool) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        d: PoolDraft = fut.result()
        rtt_s, token_s = PoolPolicy.learn_speed(self.stats.pool_rtt_s.get(name), self.stats.pool_token_s.get(name),
                                                self.clock() - asked_s, 0 if prefill else d.drafted)
        self.stats.set(self.stats.pool_rtt_s, name, rtt_s)
        if token_s is not None:
            self.stats.set(self.stats.pool_token_s, name, token_s)
        self._count_yield(name, call=True)

    def _draft_on_pool(self, name: str, rid: str, ctx: tuple[int, ...], k: int, expected: tuple[int, ...] = (),
                       branches: int = 0) -> PoolDraft:
        """One draft call (on the executor)."""
        try:
            d = self.pools[name].propose(rid, ctx, k, min_confidence=self._min_confidence,
                                         expected=expected, max_branches=branches)
        except Exception as e:
            self._failed(name, e)
            raise
        with self._lock:
            recovered = self.breakers[name].succeeded()
        if recovered:
            log.info("drafter pool %s answers again", name)
        candidates = [(expected[: d.prefix_len] + tuple(d.token_ids), (1.0,) * d.prefix_len + tuple(d.confidences))]
        candidates += [(expected[: b.prefix_len] + tuple(b.token_ids), (1.0,) * b.prefix_len + tuple(b.confidences))
                       for b in d.branches]
        drafted = len(d.token_ids) + sum(len(b.token_ids) for b in d.branches)
        return PoolDraft(len(ctx), ctx[-1], tuple(candidates), drafted)

    def _count_yield(self, name: str, *, accepted: int = 0, call: bool = False) -> None:
        """Fold a returned draft call (`call`) or tokens accepted from the pool's drafts into its yield."""
        with self._lock:
            acc, calls = self._yield_counts.get(name, (0.0, 0.0))
            if call:
                acc, calls = acc * self._yield_decay, calls * self._yield_decay + 1.0
                self.stats.add(self.stats.pool_calls, name)
            acc += accepted
            self._yield_counts[name] = (acc, calls)
            if calls > 0:
                self.stats.set(self.stats.pool_yield, name, acc / calls)

    def _failed(self, name: str, e: Exception) -> None:
        """Count a failed draft call; its breaker may open (see the module docstring)."""
        now = self.clock()
        self.stats.add(self.stats.pool_errors, name)
        with self._lock:
            breaker = self.breakers[name]
            if not breaker.failed(now):
                return
            n = breaker.failures
        if now - self._warned_s.get(name, -math.inf) >= self._warn_every_s:
            self._warned_s[name] = now
            log.warning("drafter pool %s failed %d calls in a row (%s); left out for %.0f s at a time",
                        name, n, _reason(e), breaker.retry_s)

    def _release_on_pool(self, name: str, rid: str) -> None:
        try:
            self.pools[name].release(rid)
        except Exception as e:  # noqa: BLE001 - best effort; pools evict old contexts anyway
            log.debug("release %s on %s failed: %s", rid, name, e)


def _reason(e: Exception) -> str:
    """One line for a failed draft call: a gRPC status (``DEADLINE_EXCEEDED: ...``) or the exception."""
    code = getattr(e, "code", None)
    if callable(code):
        try:
            return f"{code().name}: {e.details()}"  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001
            pass
    return repr(e)
