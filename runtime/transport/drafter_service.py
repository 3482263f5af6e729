"""gRPC server of one drafter: `cosine drafter` runs this in its own process (one pod).

KV caches stay here, keyed by request id; the verifier sends context deltas and receives draft
tokens (and compressed q for sampled requests). Health via `grpcio-health-checking` (the pod's
readiness probe is a gRPC health check).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from cosine.runtime.compression import Compression
from cosine.runtime.cross_tokenizer_drafter import CrossTokenizerDrafter
from cosine.runtime.drafter import ModelDrafter
from cosine.runtime.ngram_drafter import NgramDrafter
from cosine.runtime.transport import codec
from cosine.runtime.transport import drafter_pb2 as pb
from cosine.runtime.transport import drafter_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "cosine.v1.Drafter"


class DrafterMetrics:
    """Drafter-side counters read by the operator's autoscaler (names: operator contract)."""

    def __init__(self, pool: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.draft_tokens = Counter(
            "cosine:drafter_draft_tokens_total", "Draft tokens produced.", ["pool"], registry=self.registry
        ).labels(pool=pool)
        self.busy_s = Counter(
            "cosine:drafter_busy_seconds_total", "Seconds spent drafting.", ["pool"], registry=self.registry
        ).labels(pool=pool)
        self.bytes_sent = Counter(
            "cosine:drafter_bytes_sent_total", "Bytes of draft responses sent.", ["pool"], registry=self.registry
        ).labels(pool=pool)


class DrafterServicer(pb_grpc.DrafterServicer):
    """Serves `Propose`/`Release`/`Info` for one drafter.

    Args:
        drafter: a `ModelDrafter`, `CrossTokenizerDrafter` or `NgramDrafter` (called by one request
            at a time).
        pool: the drafter pool's name. tokenizer_family: for the verifier's compatibility check
            (a `CrossTokenizerDrafter` drafts in the verifier's vocabulary: pass the verifier's
            family and `vocab_size`).
        max_requests: contexts kept; the least recently used beyond this are released.
    """

    def __init__(
        self, drafter: ModelDrafter | CrossTokenizerDrafter | NgramDrafter, pool: str, tokenizer_family: str = "", *,
        max_requests: int = 256, metrics: DrafterMetrics | None = None, vocab_size: int | None = None,
    ) -> None:
        self.drafter = drafter
        runner = getattr(drafter, "runner", None)
        self.vocab_size = vocab_size or (runner.vocab_size if runner is not None else 0)
        self.model_name = runner.name if runner is not None else drafter.name
        self.pool = pool
        self.tokenizer_family = tokenizer_family
        self.max_requests = max_requests
        self.metrics = metrics or DrafterMetrics(pool)
        self._contexts: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def Propose(self, request: pb.ProposeRequest, context: grpc.ServicerContext) -> pb.ProposeResponse:
        with self._lock:
            rid = request.request_id
            known = self._contexts.get(rid)
            if request.num_cached and (known is None or len(known) < request.num_cached):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"request {rid}: context not cached; resend")
            ctx = (known or [])[: request.num_cached] + list(request.new_token_ids)
            if not ctx:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty context")
            self._contexts[rid] = ctx
            self._contexts.move_to_end(rid)
            self._evict()
            params = codec.sampling_from_proto(request.sampling)
            compression = None
            generator = None
            if not params.greedy:
                generator = torch.Generator().manual_seed(int(request.seed))
                compression = codec.compression_from_proto(
                    request.compression, request.HasField("compression")
                ) or Compression(top_k=max(1, self.vocab_size), bits=32)
            t0 = time.perf_counter()
            draft = self.drafter.propose(
                rid, ctx, int(request.max_tokens), params, min_confidence=request.min_confidence,
                generator=generator, compression=compression,
            )
            self.metrics.busy_s.inc(time.perf_counter() - t0)
            self.metrics.draft_tokens.inc(draft.num_tokens)
            msg = codec.draft_to_proto(draft)
            self.metrics.bytes_sent.inc(msg.ByteSize())
            return msg

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        with self._lock:
            self._contexts.pop(request.request_id, None)
            self.drafter.release(request.request_id)
        return pb.ReleaseResponse()

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        return pb.InfoResponse(
            model=self.model_name, tokenizer_family=self.tokenizer_family,
            vocab_size=self.vocab_size, pool=self.pool,
        )

    def _evict(self) -> None:
        while len(self._contexts) > self.max_requests:
            rid, _ = self._contexts.popitem(last=False)
            self.drafter.release(rid)


def serve(servicer: DrafterServicer, port: int, host: str = "127.0.0.1", max_workers: int = 4) -> grpc.Server:
    """Start a gRPC server with the drafter and health services; returns the started server.

    Raises:
        RuntimeError: the port could not be bound.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
    pb_grpc.add_DrafterServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind the drafter's gRPC port {host}:{port}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.bound_port = bound  # type: ignore[attr-defined]
    log.info("drafter %s (pool %s) serving on %s:%d", servicer.model_name, servicer.pool, host, bound)
    return server
