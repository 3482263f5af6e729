"""gRPC server of one drafter: `cosine drafter` runs this in its own process (one pod).

The engine's KV caches stay here, keyed by verifier and request id (several verifier replicas
share a pool; the contexts of a verifier not heard from for `verifier_timeout_s` are evicted, as
vLLM's RFC #42109 for a disaggregated draft server does); the verifier sends context deltas and
receives greedy draft tokens with their confidences. A finished request's `Release` is best
effort (a 1 s deadline; the verifier may die first), so a context not drafted on for
`context_idle_s` is released too, by a sweep every second: a lost `Release` costs its memory for
seconds, and a live request whose context was swept costs one resend (`FAILED_PRECONDITION`; the
client sends the whole context again). Every `Propose` pending when a draft round
starts is drafted in that round, together, by the pool's engine (`draft_engine.DraftBatcher`): a
pool serves many requests at once and never one at a time. Health via `grpcio-health-checking`
(the pod's readiness probe is a gRPC health check).

Drafts are point-mass proposals (greedy tokens, no distribution): the verifier (vLLM's rejection
sampler) checks them losslessly under greedy decoding and sampling alike, so a request's sampling
parameters do not change how a pool drafts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from cosine_spec import metric_names as names
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily

from cosine.draft_engine import DraftBatcher, DraftEngine, DraftJob
from cosine.drafter import Draft
from cosine.transport import drafter_pb2 as pb
from cosine.transport import drafter_pb2_grpc as pb_grpc
from cosine.transport import tls

log = logging.getLogger(__name__)

SERVICE_NAME = "cosine.v1.Drafter"
# seconds a context may go without a draft call before it is released: a live request asks at
# every verification step (milliseconds apart) unless its pool is left out (a breaker: 5 s), and
# resending a context costs one prefill
CONTEXT_IDLE_S = 10.0


class DrafterMetrics:
    """Drafter-side series read by the operator's autoscaler (names: operator contract).

    PromQL: busy fraction `rate(cosine_drafter_busy_seconds_total[1m])`; seconds per draft token
    `rate(cosine_drafter_busy_seconds_total[1m]) / rate(cosine_drafter_draft_tokens_total[1m])`;
    mean requests per batched round `rate(cosine_drafter_batched_requests_total[1m]) /
    rate(cosine_drafter_rounds_total[1m])`.

    Busy seconds are read at scrape time from `busy_seconds` (the servicer sets it to its
    batcher's `DraftBatcher.busy_seconds`), the running round included: a round longer than the
    scrape interval would otherwise read as an idle interval, then a busy one.
    """

    def __init__(self, pool: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["pool"], registry=self.registry).labels(pool=pool)

        # names: cosine_spec.metric_names (the operator's autoscaler reads the first two)
        self.draft_tokens = counter(names.DRAFTER_DRAFT_TOKENS, "Draft tokens produced.")
        self.busy_seconds: Callable[[], float] = lambda: 0.0

        def collect_busy() -> list[CounterMetricFamily]:
            fam = CounterMetricFamily(names.DRAFTER_BUSY_SECONDS, "Seconds the engine spent drafting.", labels=["pool"])
            fam.add_metric([pool], self.busy_seconds())
            return [fam]

        self.registry.register(_Collector(collect_busy))
        self.bytes_sent = counter(names.DRAFTER_BYTES_SENT, "Bytes of draft responses sent.")
        self.rounds = counter(names.DRAFTER_ROUNDS, "Batched draft rounds run.")
        self.batched = counter(names.DRAFTER_BATCHED_REQUESTS, "Requests drafted, summed over rounds.")
        self.contexts = Gauge(names.DRAFTER_CONTEXTS, "Requests whose context the pool keeps.", ["pool"],
                              registry=self.registry).labels(pool=pool)


class _Collector:
    """A prometheus_client custom collector around a function."""

    def __init__(self, collect: Callable[[], list[CounterMetricFamily]]) -> None:
        self.collect = collect


class DrafterServicer(pb_grpc.DrafterServicer):
    """Serves `Propose`/`Release`/`Info` for one drafter pool replica.

    Args:
        engine: the pool's `DraftEngine` (drafts run on the batcher's one thread).
        pool: the drafter pool's name. tokenizer_family / vocab_size: reported to the verifier for
            its compatibility check (a cross-tokenizer engine drafts in the verifier's vocabulary).
        model: the model name reported by `Info`.
        max_requests: contexts kept; the least recently used beyond this are released.
        min_confidence: drafts stop at the first token whose top-1 probability is below this
            (the request's own `min_confidence`, if larger, wins).
        verifier_timeout_s: a verifier not heard from for this many seconds went away: the
            contexts it left are released.
        context_idle_s: a context with no draft call (started or answered) for this many seconds
            is released (its `Release` was lost); `sweep_every_s`: how often that is looked for.
        clock: monotonic seconds (injected for tests).
    """

    def __init__(
        self, engine: DraftEngine, pool: str, tokenizer_family: str = "", *, model: str = "",
        max_requests: int = 256, metrics: DrafterMetrics | None = None, vocab_size: int | None = None,
        min_confidence: float = 0.0, verifier_timeout_s: float = 120.0, context_idle_s: float = CONTEXT_IDLE_S,
        sweep_every_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.verifier_timeout_s = verifier_timeout_s
        self.context_idle_s = context_idle_s
        self.clock = clock
        self._last_seen: dict[str, float] = {}  # verifier id -> when it last called
        self.vocab_size = vocab_size if vocab_size is not None else engine.vocab_size
        self.model_name = model or engine.name
        self.pool = pool
        self.tokenizer_family = tokenizer_family
        self.max_requests = max_requests
        self.min_confidence = min_confidence
        self.metrics = metrics or DrafterMetrics(pool)
        self.batcher = DraftBatcher(engine, on_round=self._count_round)
        self.metrics.busy_seconds = self.batcher.busy_seconds
        self._contexts: OrderedDict[str, list[int]] = OrderedDict()
        self._touched_s: dict[str, float] = {}  # request key -> its last draft call's start or answer
        self._in_flight: dict[str, int] = {}  # request key -> its draft calls running (never swept)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._sweep_every, args=(sweep_every_s,), name=f"cosine-sweep-{pool}",
                         daemon=True).start()

    def quiet_s(self) -> float:
        """Seconds since any verifier last called (a draft or a release); infinite before the first."""
        with self._lock:
            last = max(self._last_seen.values(), default=None)
        return float("inf") if last is None else self.clock() - last

    def num_contexts(self) -> int:
        """Requests whose context this replica keeps (the engine's own count may lag by a round)."""
        with self._lock:
            return len(self._contexts)

    @staticmethod
    def key(verifier_id: str, request_id: str) -> str:
        """The engine's key of a verifier's request (request ids are unique per verifier only)."""
        return f"{verifier_id}/{request_id}" if verifier_id else request_id

    def Propose(self, request: pb.ProposeRequest, context: grpc.ServicerContext) -> pb.ProposeResponse:
        """Extend the request's kept context (`num_cached` tokens kept + `new_token_ids`) and draft
        from it in the next batched round, waiting up to the call's deadline.

        Aborts with FAILED_PRECONDITION when fewer than `num_cached` tokens are kept (the client
        resends the whole context), INVALID_ARGUMENT for an empty context, DEADLINE_EXCEEDED when
        the round does not finish in time, INTERNAL when the engine fails.
        """
        rid = self.key(request.verifier_id, request.request_id)
        with self._lock:
            self._last_seen[request.verifier_id] = self.clock()
            known = self._contexts.get(rid)
            if request.num_cached and (known is None or len(known) < request.num_cached):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"request {rid}: context not cached; resend")
            ctx = (known or [])[: request.num_cached] + list(request.new_token_ids)
            if not ctx:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id's context is empty (new_token_ids)")
            self._contexts[rid] = ctx
            self._contexts.move_to_end(rid)
            self._touched_s[rid] = self.clock()
            self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
            evicted = self._evict()
            self.metrics.contexts.set(len(self._contexts))
        for gone in evicted:
            self.batcher.release(gone)
        job = DraftJob(rid, tuple(ctx), int(request.max_tokens), max(self.min_confidence, request.min_confidence),
                       tuple(request.expected_ids), int(request.max_branches))
        try:
            fut = self.batcher.submit(job)
            remaining = context.time_remaining()
            result: Draft = fut.result(timeout=remaining if remaining is not None else None)
        except futures.TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid}: draft not ready before the deadline")
        except Exception as e:  # noqa: BLE001 - the engine's error, as a status
            context.abort(grpc.StatusCode.INTERNAL, f"{self.engine.name}: {e}")
        finally:
            self._answered(rid)
        self.metrics.draft_tokens.inc(len(result.token_ids) + sum(len(br.token_ids) for br in result.branches))
        msg = pb.ProposeResponse(
            token_ids=list(result.token_ids), confidences=list(result.confidences), draft_s=result.draft_s,
            drafter=self.pool, prefix_len=result.prefix_len,
            branches=[pb.Branch(prefix_len=br.prefix_len, token_ids=list(br.token_ids),
                                confidences=list(br.confidences)) for br in result.branches])
        self.metrics.bytes_sent.inc(msg.ByteSize())
        return msg

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        """Forget the request's context and free its engine state (idempotent)."""
        rid = self.key(request.verifier_id, request.request_id)
        with self._lock:
            self._last_seen[request.verifier_id] = self.clock()
            self._contexts.pop(rid, None)
            self._touched_s.pop(rid, None)
            self.metrics.contexts.set(len(self._contexts))
        self.batcher.release(rid)
        return pb.ReleaseResponse()

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        """The replica's model, tokenizer family, vocabulary size and pool name."""
        return pb.InfoResponse(
            model=self.model_name, tokenizer_family=self.tokenizer_family,
            vocab_size=self.vocab_size, pool=self.pool,
        )

    def sweep(self) -> int:
        """Release the contexts `_evict` finds (idle, of a verifier gone, beyond `max_requests`);
        returns how many."""
        with self._lock:
            evicted = self._evict()
            self.metrics.contexts.set(len(self._contexts))
        for rid in evicted:
            self.batcher.release(rid)
        if evicted:
            log.info("drafter %s: released %d context(s) nobody released (idle %.0f s, or their verifier gone)",
                     self.pool, len(evicted), self.context_idle_s)
        return len(evicted)

    def close(self) -> None:
        """Stop the sweep and the batcher (see `DraftBatcher.close`)."""
        self._closed.set()
        self.batcher.close()

    def _sweep_every(self, period_s: float) -> None:
        while not self._closed.wait(period_s):
            self.sweep()

    def _answered(self, rid: str) -> None:
        """A draft call of `rid` returned (answered or failed): its idle time starts now."""
        with self._lock:
            n = self._in_flight.get(rid, 0) - 1
            if n > 0:
                self._in_flight[rid] = n
            else:
                self._in_flight.pop(rid, None)
            if rid in self._touched_s:
                self._touched_s[rid] = self.clock()

    def _count_round(self, seconds: float, results: Sequence[Draft]) -> None:
        self.metrics.rounds.inc()
        self.metrics.batched.inc(len(results))

    def _evict(self) -> Sequence[str]:
        """Contexts to release (under the lock, forgotten here): those of verifiers gone for
        `verifier_timeout_s`, those with no draft call for `context_idle_s` (none running), then
        the least recently used beyond `max_requests`."""
        now = self.clock()
        gone = {v for v, t in self._last_seen.items() if now - t > self.verifier_timeout_s}
        out = []
        for v in gone:
            del self._last_seen[v]
            prefix = self.key(v, "")
            out += [r for r in self._contexts if (r.startswith(prefix) if v else "/" not in r)]
        out += [r for r, t in self._touched_s.items()
                if now - t > self.context_idle_s and not self._in_flight.get(r) and r not in out]
        for rid in out:
            del self._contexts[rid]
        while len(self._contexts) > self.max_requests:
            rid, _ = self._contexts.popitem(last=False)
            out.append(rid)
        for rid in out:
            self._touched_s.pop(rid, None)
        return out


def drain(server: grpc.Server, servicer: DrafterServicer, timeout_s: float, quiet_s: float = 3.0,
          poll_s: float = 0.1) -> int:
    """A graceful exit (on SIGTERM): report NOT_SERVING on gRPC health, so verifiers move this
    replica's requests, with their whole context, to another replica at once and send it no new
    one; answer every call meanwhile; stop once no request's context is held here, or no verifier
    has called for `quiet_s` seconds (what is held then belongs to verifiers that are gone: a live
    one releases at once), or after `timeout_s` (the pod's grace, less a margin). Returns the
    contexts still held then (0: every request was handed back)."""
    for name in ("", SERVICE_NAME):
        server.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    log.info("drafter %s: draining %d request(s), %.0f s at most", servicer.pool, servicer.num_contexts(), timeout_s)
    while servicer.num_contexts() and time.monotonic() < deadline and servicer.quiet_s() < quiet_s:
        time.sleep(poll_s)
    left = servicer.num_contexts()
    server.stop(grace=2).wait()
    log.info("drafter %s: drained (%d request(s) left)", servicer.pool, left)
    return left


def serve(
    servicer: DrafterServicer, port: int, host: str = "127.0.0.1", max_workers: int = 64, tls_dir: str | None = None
) -> grpc.Server:
    """Start a gRPC server with the drafter and health services; returns the started server.
    With `tls_dir` (`tls.crt`, `tls.key`: `transport.tls`) it serves TLS only, else plaintext.

    `max_workers` bounds concurrent `Propose` calls (each waits on the batcher, so it is the most
    requests one round can batch).

    Raises:
        RuntimeError: the port could not be bound.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
    pb_grpc.add_DrafterServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    if tls_dir is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, tls.server_credentials(tls_dir))
    if bound == 0:
        raise RuntimeError(f"could not bind the drafter's gRPC port {host}:{port}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.bound_port = bound  # type: ignore[attr-defined]
    server.health = health_servicer  # type: ignore[attr-defined]
    log.info("drafter %s (pool %s) serving on %s:%d (%s)", servicer.model_name, servicer.pool, host, bound,
             "TLS" if tls_dir else "plaintext")
    return server
