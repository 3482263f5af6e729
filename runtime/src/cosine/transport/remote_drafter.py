"""Client side of the drafter service: a `Drafter` whose model lives in another process.

Sends context deltas (the drafter keeps the tokens it was sent), with a deadline on every call;
gRPC's own retry policy (service config) retries UNAVAILABLE with backoff. A request the drafter
does not know (it restarted, or evicted it) is resent whole. Errors propagate to the caller: the
proposer counts them and, after several in a row, leaves the pool out for a while.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq

import grpc

from cosine.draft_engine import common_prefix
from cosine.drafter import Draft, DraftBranch
from cosine.transport import drafter_pb2 as pb
from cosine.transport import drafter_pb2_grpc as pb_grpc
from cosine.transport.tls import channel as drafter_channel

log = logging.getLogger(__name__)

_RETRY_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "cosine.v1.Drafter"}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "0.5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


class RemoteDrafter:
    """A drafter reached over gRPC.

    Args:
        address: gRPC target, e.g. `127.0.0.1:50052` or `dns:///demo-drafter-code.ns.svc:50052`.
        name: pool name used in metrics and routing.
        base_timeout_s, per_token_timeout_s: the deadline of a Propose call is
            base + per_token * (draft tokens + context tokens sent / 16).
        tls_dir: TLS with the CA in this directory (`transport.tls.channel`); None: plaintext.
        tls_server_name: the name the drafter's certificate must carry (default: the address's host).
        verifier_id: this verifier replica's id, sent with every call (the drafter keys per-request
            state by verifier and request); "" for none.
    """

    def __init__(
        self,
        address: str,
        name: str,
        *,
        base_timeout_s: float = 5.0,
        per_token_timeout_s: float = 1.0,
        tls_dir: str | None = None,
        tls_server_name: str | None = None,
        verifier_id: str = "",
    ) -> None:
        self.address = address
        self.name = name
        self.verifier_id = verifier_id
        self.base_timeout_s = base_timeout_s
        self.per_token_timeout_s = per_token_timeout_s
        self._channel = drafter_channel(
            address,
            tls_dir=tls_dir,
            server_name=tls_server_name,
            options=[
                ("grpc.service_config", _RETRY_CONFIG),
                ("grpc.enable_retries", 1),
                # a restarted drafter should be found within seconds, not gRPC's default 2 minutes
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self._stub = pb_grpc.DrafterStub(self._channel)
        self._closed = threading.Event()
        self._watch: grpc.Future | None = None  # the health stream, while `watch_health` follows it
        self._sent: dict[str, list[int]] = {}
        self.bytes_received = 0
        self.calls = 0

    def info(self, timeout_s: float = 5.0) -> pb.InfoResponse:
        """The pool's `Info` (model, tokenizer family, vocab size, pool). Raises grpc.RpcError on failure."""
        return self._stub.Info(pb.InfoRequest(), timeout=timeout_s)

    def propose(self, request_id: str, context_ids: Seq[int], max_tokens: int, *, min_confidence: float = 0.0,
                expected: Seq[int] = (), max_branches: int = 0) -> Draft:
        """Draft remotely (see `Drafter.propose`). Raises grpc.RpcError (deadline, unavailable, …)
        on failure."""
        if max_tokens <= 0:
            return Draft((), (), self.name, 0.0)
        sent = self._sent.get(request_id, [])
        common = common_prefix(sent, context_ids)
        try:
            resp = self._call(request_id, context_ids, common, max_tokens, min_confidence, expected, max_branches)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.info("drafter %s lost request %s; resending its context", self.name, request_id)
            resp = self._call(request_id, context_ids, 0, max_tokens, min_confidence, expected, max_branches)
        self._sent[request_id] = list(context_ids)
        self.calls += 1
        self.bytes_received += resp.ByteSize()
        branches = tuple(DraftBranch(b.prefix_len, tuple(b.token_ids), tuple(b.confidences)) for b in resp.branches)
        return Draft(tuple(resp.token_ids), tuple(resp.confidences), self.name, resp.draft_s, resp.prefix_len, branches)

    def _call(self, request_id, context_ids, common, max_tokens, min_confidence, expected=(),
              max_branches=0) -> pb.ProposeResponse:
        new = list(context_ids[common:])
        req = pb.ProposeRequest(request_id=request_id, num_cached=common, new_token_ids=new, max_tokens=max_tokens,
                                min_confidence=min_confidence, expected_ids=list(expected), max_branches=max_branches,
                                verifier_id=self.verifier_id)
        drafted = max_tokens * (1 + max_branches) + len(expected)
        timeout = self.base_timeout_s + self.per_token_timeout_s * (drafted + len(new) / 16)
        return self._stub.Propose(req, timeout=timeout)

    def release(self, request_id: str) -> None:
        """Free the request's context in the pool (always sent: a draft call may have created it
        although its answer never came back). Best effort."""
        self._sent.pop(request_id, None)
        try:
            self._stub.Release(pb.ReleaseRequest(request_id=request_id, verifier_id=self.verifier_id), timeout=1.0)
        except grpc.RpcError as e:  # best effort: the drafter evicts least-recently-used contexts anyway
            log.debug("release %s on %s failed: %s", request_id, self.name, e.code())

    def forget(self, request_id: str) -> None:
        """Drop what this client sent for the request, without telling the drafter (its next
        call sends the whole context)."""
        self._sent.pop(request_id, None)

    def watch_health(self, on_change: Callable[[bool], None], retry_s: float = 1.0) -> threading.Thread:
        """Follow the replica's gRPC health (`Health.Watch`, a server stream) in a daemon thread:
        `on_change(serving)` with each status it reports (True: SERVING). A broken stream (the
        replica exited or restarts) is opened again every `retry_s` seconds until `close()`."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)

        def follow() -> None:
            while not self._closed.is_set():
                try:
                    self._watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
                    for status in self._watch:
                        on_change(status.status == health_pb2.HealthCheckResponse.SERVING)
                except grpc.RpcError as e:
                    log.debug("drafter %s at %s: health stream ended: %s", self.name, self.address, e.code())
                except ValueError:  # the channel was closed under the stream
                    return
                self._closed.wait(retry_s)

        thread = threading.Thread(target=follow, name=f"cosine-health-{self.address}", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Close the gRPC channel (and end `watch_health`)."""
        self._closed.set()
        if self._watch is not None:
            self._watch.cancel()
        self._channel.close()
