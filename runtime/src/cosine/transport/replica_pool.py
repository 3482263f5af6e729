"""A drafter pool of N replicas behind one name: one gRPC channel per replica, each request on one.

A pool's replicas each keep per-request state (the engine's KV sequence, the context deltas they
were sent), so gRPC's load balancing cannot spread a pool's calls: `pick_first` sends every call
to one replica, round robin splits a request's context across replicas. Instead this client:
- resolves the pool's replicas (`resolve_addresses`: a Kubernetes headless Service's DNS records,
  `dns:///name:port`, re-resolved every `resolve_every_s`; a file of addresses, `file:///path`,
  which `cosine serve` rewrites as it starts and stops local replicas; or fixed `host:port`
  addresses; a test passes its own `resolve`), with one channel per replica;
- assigns each request to one replica for its lifetime (`pool_policy.assign_replica`: the one
  holding the fewest requests), so a new replica takes new requests until the pool is even;
- re-homes a request whose replica left the address list or fails a call as unavailable: the next
  replica gets the whole context (the draft is late, the request never fails); a replica whose
  calls fail `down_after` times in a row is left out of assignments for `retry_s`;
- follows each replica's gRPC health (`RemoteDrafter.watch_health`): a replica that reports
  NOT_SERVING is draining (SIGTERM: a scale-down, a rollout, a spot node's notice). At that
  moment its requests move to the other replicas, each with its whole context at its next call,
  and are released on it (after its call in flight, if any); it gets no new request until it
  reports SERVING again, even when no other replica is left (those it holds stay, so that it
  empties and exits; a new request's draft call fails, which costs a draft, not the request);
- sends `Release` to the replica that holds the request's context (also to one it left).

Per replica it counts draft calls, errors, busy seconds (wall time with at least one call in
flight) and the requests it holds (`replica_stats`, exported as `cosine_drafter_replica_*`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from cosine.breaker import Breaker
from cosine.drafter import Draft
from cosine.pool_policy import assign_replica
from cosine.transport.remote_drafter import RemoteDrafter

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
FILE_SCHEME = "file://"


def resolve_addresses(addresses: Sequence[str]) -> list[str]:
    """The replicas' `host:port` addresses: a `dns:///host:port` entry becomes one address per
    DNS record of `host` (a headless Service has one per ready pod); a `file:///path` entry, one
    per non-empty line of the file (what `cosine serve` writes for its ready local replicas, the
    same role on one machine); others are kept as they are.
    Raises OSError when a name does not resolve or the file cannot be read."""
    out: list[str] = []
    for address in addresses:
        if address.startswith(FILE_SCHEME):
            with open(address[len(FILE_SCHEME):]) as f:
                out.extend(line.strip() for line in f if line.strip())
            continue
        if not address.startswith(DNS_SCHEME):
            out.append(address)
            continue
        host, _, port = address[len(DNS_SCHEME):].rpartition(":")
        records = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        for ip in sorted({r[4][0] for r in records}):
            out.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return list(dict.fromkeys(out))


@dataclass
class ReplicaStats:
    """One replica's counters: draft calls that returned, failed calls, seconds with a call in
    flight, the requests assigned to it now, and the requests moved off it (it drained, left the
    address list or failed)."""

    calls: int = 0
    errors: int = 0
    busy_s: float = 0.0
    held: int = 0
    rehomed: int = 0


class _Replica:
    def __init__(self, drafter: RemoteDrafter, breaker: Breaker) -> None:
        self.drafter = drafter
        self.stats = ReplicaStats()
        self.in_flight = 0
        self.busy_since = 0.0
        self.breaker = breaker  # failed calls in a row, and until when it takes no request
        self.retired = False  # left the address list; kept while it holds contexts
        self.draining = False  # reported NOT_SERVING: it takes no request and holds none once its calls end
        self.active: dict[str, int] = {}  # request id -> its calls in flight here


class ReplicaPool:
    """A pool's replicas as one `Drafter` (see the module docstring).

    Args:
        name: the pool's name.
        addresses: what `resolve_addresses` takes (`dns:///svc:port` and/or `host:port`).
        resolve: addresses of the replicas now (default: `resolve_addresses(addresses)`); called
            at most every `resolve_every_s` seconds, from the calling thread.
        connect: a client for one replica address (default: `RemoteDrafter` with `remote_kwargs`;
            with TLS and a `dns:///` address, the certificate is checked against the Service's name).
        verifier_id: this verifier replica's id, sent with every call.
        down_after / retry_s: a replica failing this many calls in a row is left out for `retry_s`.
        clock: monotonic seconds (injected for tests).

    Raises:
        ValueError: no addresses and no `resolve`.
    """

    def __init__(self, name: str, addresses: Sequence[str] = (), *,
                 resolve: Callable[[], Sequence[str]] | None = None, resolve_every_s: float = 5.0,
                 connect: Callable[[str], RemoteDrafter] | None = None, verifier_id: str = "",
                 down_after: int = 3, retry_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 **remote_kwargs: object) -> None:
        if not addresses and resolve is None:
            raise ValueError(f"pool {name!r}: no replica addresses")
        self.name = name
        self.addresses = tuple(addresses)
        self.resolve = resolve or (lambda: resolve_addresses(self.addresses))
        self.resolve_every_s = resolve_every_s
        self.down_after = down_after
        self.retry_s = retry_s
        self.clock = clock
        self.verifier_id = verifier_id
        dns_host = next((a[len(DNS_SCHEME):].rpartition(":")[0] for a in self.addresses
                         if a.startswith(DNS_SCHEME)), None)
        if remote_kwargs.get("tls_dir") and not remote_kwargs.get("tls_server_name") and dns_host:
            remote_kwargs["tls_server_name"] = dns_host
        self._connect = connect or (lambda address: RemoteDrafter(address, name, verifier_id=verifier_id,
                                                                  **remote_kwargs))  # type: ignore[arg-type]
        self._replicas: dict[str, _Replica] = {}
        self._home: dict[str, str] = {}  # request id -> replica address
        self._lock = threading.Lock()
        self._resolved_s = -float("inf")
        self._resolving = threading.Lock()  # held while one thread re-resolves
        self.rehomes = 0  # requests moved to another replica (their replica left or failed)
        self._refresh(force=True)

    # ------------------------------------------------------------ Drafter

    def propose(self, request_id: str, context_ids: Sequence[int], max_tokens: int, *, min_confidence: float = 0.0,
                expected: Sequence[int] = (), max_branches: int = 0) -> Draft:
        """Draft on the request's replica (`Drafter.propose`). A replica that is unavailable or has
        left is replaced once, within the call, by another that gets the whole context.

        Raises:
            grpc.RpcError: the call failed (and no other replica could take it).
            RuntimeError: the pool has no replica.
        """
        self._refresh()
        tried: set[str] = set()
        while True:
            address, replica = self._home_of(request_id, exclude=tried)
            tried.add(address)
            try:
                return self._call(replica, request_id, context_ids, max_tokens, min_confidence, expected,
                                  max_branches)
            except grpc.RpcError as e:
                moved = self._failed(replica, address, request_id, e)
                if not moved or len(tried) > 1:
                    raise

    def release(self, request_id: str) -> None:
        """Release the request on the replica that holds its context (best effort)."""
        with self._lock:
            address = self._home.pop(request_id, None)
            replica = self._replicas.get(address) if address else None
        if replica is not None:
            replica.drafter.release(request_id)
            self._drop_if_retired(address)

    def info(self, timeout_s: float = 5.0):
        """The pool's `Info`, from the first replica that answers. Raises grpc.RpcError if none does."""
        self._refresh()
        error: grpc.RpcError | None = None
        for replica in list(self._replicas.values()):
            try:
                return replica.drafter.info(timeout_s)
            except grpc.RpcError as e:
                error = e
        if error is None:
            raise RuntimeError(f"pool {self.name!r} has no replica")
        raise error

    def close(self) -> None:
        """Close every replica's channel."""
        with self._lock:
            replicas, self._replicas = list(self._replicas.values()), {}
        for r in replicas:
            r.drafter.close()

    # ------------------------------------------------------------ observation

    @property
    def ready(self) -> int:
        """Replicas in the address list as last resolved, draining ones included (they still draft
        for the requests they hold): 0 for a pool scaled to zero. Never blocks (the proposer asks
        on the engine's thread): a re-resolve that is due (`resolve_every_s`; DNS for a Service
        name) runs on a thread of its own, and counts from the next call."""
        if self._resolve_due(self.clock()) and not self._resolving.locked():
            threading.Thread(target=self._refresh, daemon=True, name=f"cosine-resolve-{self.name}").start()
        with self._lock:
            return sum(1 for r in self._replicas.values() if not r.retired)

    def home_of(self, request_id: str) -> str | None:
        """The address of the replica holding the request, if any."""
        with self._lock:
            return self._home.get(request_id)

    def replica_stats(self) -> dict[str, ReplicaStats]:
        """Per replica address (retired ones while they hold contexts): a snapshot of its counters,
        busy seconds up to now."""
        now = self.clock()
        out = {}
        with self._lock:
            for address, r in self._replicas.items():
                busy = r.stats.busy_s + (now - r.busy_since if r.in_flight else 0.0)
                held = sum(1 for a in self._home.values() if a == address)
                out[address] = ReplicaStats(r.stats.calls, r.stats.errors, busy, held, r.stats.rehomed)
        return out

    def num_requests(self) -> int:
        """Requests assigned to a replica (0 once every request was released)."""
        with self._lock:
            return len(self._home)

    # ------------------------------------------------------------ internals

    def _refresh(self, force: bool = False) -> None:
        """Re-resolve the replicas if `resolve_every_s` passed: new ones are connected, ones that
        left are retired (no new requests; their requests are re-homed at their next call). One
        thread at a time: another that finds a re-resolve under way goes on with the replicas known."""
        now = self.clock()
        if not force and not self._resolve_due(now):
            return
        if not self._resolving.acquire(blocking=force):
            return
        try:
            if force or self._resolve_due(now):  # (not done meanwhile by the thread that held the lock)
                self._resolved_s = now
                self._resolve()
        finally:
            self._resolving.release()

    def _resolve_due(self, now: float) -> bool:
        return now - self._resolved_s >= self.resolve_every_s

    def _resolve(self) -> None:
        try:
            current = list(dict.fromkeys(self.resolve()))
        except OSError as e:  # DNS hiccup: keep the replicas we know
            log.debug("pool %s: resolving %s failed: %s", self.name, self.addresses, e)
            return
        joined = []
        with self._lock:
            for address in current:
                if address not in self._replicas:
                    self._replicas[address] = _Replica(self._connect(address), Breaker(self.down_after, self.retry_s))
                    joined.append(address)
                    log.info("pool %s: replica %s joined", self.name, address)
                self._replicas[address].retired = False
            for address, r in self._replicas.items():
                if address not in current and not r.retired:
                    r.retired = True
                    log.info("pool %s: replica %s left", self.name, address)
        for address in joined:
            watch = getattr(self._replicas[address].drafter, "watch_health", None)
            if watch is not None:  # (a test's drafter may have no health service)
                watch(lambda serving, a=address: self._health(a, serving))
        for address in list(self._replicas):
            self._drop_if_retired(address)

    def _health(self, address: str, serving: bool) -> None:
        """A replica's health changed: NOT_SERVING drains it at once (module docstring)."""
        with self._lock:
            r = self._replicas.get(address)
            if r is None or r.draining == (not serving):
                return
            r.draining = not serving
            if serving:
                log.info("pool %s: replica %s serves again", self.name, address)
                return
            now = self.clock()
            candidates = [a for a, x in self._replicas.items()
                          if not x.retired and not x.draining and x.breaker.allows(now)]
            held: dict[str, int] = {}
            for a in self._home.values():
                held[a] = held.get(a, 0) + 1
            moved = []
            for rid, home in list(self._home.items()):
                if home != address:
                    continue
                new = assign_replica({a: n for a, n in held.items() if a != address}, candidates)
                if new is None:  # no other replica: it keeps its requests while it can
                    break
                self._home[rid] = new
                held[new] = held.get(new, 0) + 1
                self._replicas[new].drafter.forget(rid)  # its next call sends the whole context
                moved.append(rid)
            self.rehomes += len(moved)
            r.stats.rehomed += len(moved)
            now_free = [rid for rid in moved if not r.active.get(rid)]  # the others after their call
        log.info("pool %s: replica %s is draining; %d request(s) moved to %s", self.name, address, len(moved),
                 candidates)
        for rid in now_free:
            r.drafter.release(rid)

    def _home_of(self, request_id: str, exclude: set[str]) -> tuple[str, _Replica]:
        """The request's replica; a new, re-homed or moved-off request gets the least loaded one."""
        now = self.clock()
        moved_from: _Replica | None = None
        with self._lock:
            address = self._home.get(request_id)
            r = self._replicas.get(address) if address else None
            if r is not None and not r.retired and not r.draining and r.breaker.allows(now) and address not in exclude:
                return address, r  # type: ignore[return-value]
            healthy = [a for a, x in self._replicas.items()
                       if not x.retired and not x.draining and x.breaker.allows(now) and a not in exclude]
            # else one whose breaker is open; a draining replica only for the requests it holds
            # (a new one would keep it from emptying: its drain would run to the pod's deadline)
            candidates = healthy or [a for a, x in self._replicas.items()
                                     if not x.retired and a not in exclude and (not x.draining or a == address)]
            held: dict[str, int] = {}
            for a in self._home.values():
                held[a] = held.get(a, 0) + 1
            new = assign_replica(held, candidates)
            if new is None:
                draining = any(x.draining for x in self._replicas.values())
                raise RuntimeError(f"pool {self.name!r} has no replica to draft on"
                                   + (" (its replicas are draining)" if draining else ""))
            if new == address:
                return new, self._replicas[new]
            if address is not None:
                self.rehomes += 1
                moved_from = r
                if r is not None:
                    r.stats.rehomed += 1
                log.info("pool %s: request %s re-homed from %s to %s", self.name, request_id, address, new)
            self._home[request_id] = new
            target = self._replicas[new]
        if moved_from is not None:  # free its context there (best effort: it may be gone)
            moved_from.drafter.release(request_id)
            self._drop_if_retired(address)  # type: ignore[arg-type]
        target.drafter.forget(request_id)
        return new, target

    def _call(self, r: _Replica, request_id: str, context_ids: Sequence[int], max_tokens: int,
              min_confidence: float, expected: Sequence[int], max_branches: int) -> Draft:
        with self._lock:
            if r.in_flight == 0:
                r.busy_since = self.clock()
            r.in_flight += 1
            r.active[request_id] = r.active.get(request_id, 0) + 1
        try:
            draft = r.drafter.propose(request_id, context_ids, max_tokens, min_confidence=min_confidence,
                                      expected=expected, max_branches=max_branches)
            with self._lock:
                r.stats.calls += 1
                r.breaker.succeeded()
            return draft
        finally:
            with self._lock:
                r.in_flight -= 1
                if r.in_flight == 0:
                    r.stats.busy_s += self.clock() - r.busy_since
                r.active[request_id] -= 1
                if not r.active[request_id]:
                    del r.active[request_id]
                # moved off a draining replica while this call was out: hand its context back now
                handed_back = (r.draining and request_id not in r.active
                               and self._replicas.get(self._home.get(request_id, "")) is not r)
            if handed_back:
                r.drafter.release(request_id)

    def _failed(self, r: _Replica, address: str, request_id: str, e: grpc.RpcError) -> bool:
        """Count a failed call; True if the request is to move to another replica now (its replica
        is unavailable, left, or failed `down_after` calls in a row)."""
        code = e.code() if callable(getattr(e, "code", None)) else None
        with self._lock:
            r.stats.errors += 1
            gone = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            down = r.breaker.failed(self.clock(), fatal=gone)
            others = any(not x.retired and a != address for a, x in self._replicas.items())
        return (down or r.retired) and others

    def _drop_if_retired(self, address: str) -> None:
        """Close a retired replica's channel once it holds no request."""
        with self._lock:
            r = self._replicas.get(address)
            if r is None or not r.retired or r.in_flight or address in self._home.values():
                return
            del self._replicas[address]
        r.drafter.close()
