"""A pool's replicas over real gRPC on loopback: requests spread and stay on their replica,
replicas join and leave with the address list, a dead replica's requests are re-homed within the
call, releases reach the replica holding the context, and drafters key state by verifier."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from cosine.transport.drafter_service import DrafterServicer, serve
from cosine.transport.replica_pool import ReplicaPool, resolve_addresses

from .test_transport import RuleEngine


class Replicas:
    """N drafter replicas (gRPC servers over `RuleEngine`s) and the address list a test controls."""

    def __init__(self, n: int) -> None:
        self.engines, self.servicers, self.servers, self.addresses = [], [], [], []
        for _ in range(n):
            self.add()

    def add(self) -> str:
        engine = RuleEngine()
        servicer = DrafterServicer(engine, pool="code")
        server = serve(servicer, port=0)
        self.engines.append(engine)
        self.servicers.append(servicer)
        self.servers.append(server)
        address = f"127.0.0.1:{server.bound_port}"
        self.addresses.append(address)
        return address

    def kill(self, i: int) -> None:
        self.servers[i].stop(None)

    def close(self) -> None:
        for server, servicer in zip(self.servers, self.servicers, strict=True):
            server.stop(None)
            servicer.close()


@pytest.fixture()
def replicas():
    r = Replicas(2)
    yield r
    r.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_requests_spread_and_stay_on_their_replica(replicas):
    pool = ReplicaPool("code", replicas.addresses)
    try:
        homes = {}
        for step in range(3):
            for i in range(8):
                rid = f"r{i}"
                d = pool.propose(rid, [1, 2, 3 + step], 3)
                assert d.token_ids == ((4 + step) % 50, (5 + step) % 50, (6 + step) % 50)
                homes.setdefault(rid, pool.home_of(rid))
                assert pool.home_of(rid) == homes[rid]  # affinity: every call on one replica
        stats = pool.replica_stats()
        assert [stats[a].held for a in replicas.addresses] == [4, 4]
        assert [stats[a].calls for a in replicas.addresses] == [12, 12]
        assert all(stats[a].busy_s > 0 for a in replicas.addresses)
        assert [s.num_contexts() for s in replicas.servicers] == [4, 4]
        for i in range(8):
            pool.release(f"r{i}")
        deadline = time.monotonic() + 5
        while any(s.num_contexts() for s in replicas.servicers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [s.num_contexts() for s in replicas.servicers] == [0, 0]
        assert pool.num_requests() == 0 and pool.rehomes == 0
    finally:
        pool.close()


def test_a_replica_added_takes_new_requests_at_the_next_resolve(replicas):
    clock = Clock()
    current = [replicas.addresses[0]]
    pool = ReplicaPool("code", resolve=lambda: list(current), resolve_every_s=5.0, clock=clock)
    try:
        for i in range(4):
            pool.propose(f"old{i}", [1, 2], 2)
        current.append(replicas.addresses[1])
        clock.now = 4.9  # not yet re-resolved: the new replica is unknown
        pool.propose("early", [1, 2], 2)
        assert pool.home_of("early") == replicas.addresses[0]
        clock.now = 5.0
        for i in range(4):
            pool.propose(f"new{i}", [1, 2], 2)
        assert {pool.home_of(f"new{i}") for i in range(4)} == {replicas.addresses[1]}  # until the pool is even
        assert all(pool.home_of(f"old{i}") == replicas.addresses[0] for i in range(4))  # nothing moved
    finally:
        pool.close()


def test_a_pool_scaled_to_zero_has_no_replica_ready_until_one_is_listed(replicas):
    """`ready` (what the proposer checks, on the engine's thread, before asking) follows the
    address list: none listed (a pool the autoscaler took to zero) is 0, and a replica listed
    again counts once the next resolve is done, which runs off the caller's thread: a DNS lookup
    that hangs does not hold the engine's step."""
    clock = Clock()
    current: list[str] = []
    gate = threading.Event()
    gate.set()

    def resolve() -> list[str]:
        gate.wait(timeout=2.0)  # (a lookup that hangs, until its timeout)
        return list(current)

    pool = ReplicaPool("code", resolve=resolve, resolve_every_s=5.0, clock=clock)
    try:
        assert pool.ready == 0
        current.append(replicas.addresses[0])
        assert pool.ready == 0  # not yet re-resolved
        clock.now = 5.0
        gate.clear()  # the lookup hangs...
        t0 = time.monotonic()
        assert pool.ready == 0 and time.monotonic() - t0 < 0.5  # ...and `ready` does not wait for it
        gate.set()
        _until(lambda: pool.ready == 1, "the listed replica never counted")
        assert pool.propose("r", [1, 2], 2).token_ids == (3, 4)
        current.clear()
        clock.now = 10.0
        pool.ready  # noqa: B018 - starts the re-resolve
        _until(lambda: pool.ready == 0, "the delisted replica still counted")
    finally:
        pool.close()


def test_a_replica_removed_from_the_list_hands_its_requests_over_whole(replicas):
    clock = Clock()
    current = list(replicas.addresses)
    pool = ReplicaPool("code", resolve=lambda: list(current), resolve_every_s=1.0, clock=clock)
    try:
        for i in range(4):
            pool.propose(f"r{i}", [1, 2, 3], 2)
        gone = replicas.addresses[1]
        moved = [f"r{i}" for i in range(4) if pool.home_of(f"r{i}") == gone]
        assert len(moved) == 2
        current.remove(gone)
        clock.now = 1.0
        for rid in moved:  # the next call re-homes: the whole context goes to the other replica
            d = pool.propose(rid, [1, 2, 3, 9], 2)
            assert d.token_ids == (10, 11) and pool.home_of(rid) == replicas.addresses[0]
        assert pool.rehomes == 2
        assert replicas.servicers[1].num_contexts() == 0  # released where they were
        assert gone not in pool.replica_stats()  # its channel closed once it held nothing
    finally:
        pool.close()


def _until(pred, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_draining_replica_hands_its_requests_back_at_once_and_exits_holding_none(replicas):
    """Catches: a replica on SIGTERM (a spot node's notice) found out only by failed calls, its
    requests moved one failure at a time, new requests still sent to it, or its contexts left
    behind so that it holds on to the end of its grace."""
    import threading

    from cosine.transport.drafter_service import drain

    pool = ReplicaPool("code", replicas.addresses)
    try:
        for i in range(8):
            pool.propose(f"r{i}", [1, 2, 3], 2)
        leaving, staying = replicas.addresses
        assert pool.replica_stats()[leaving].held == 4 and replicas.servicers[0].num_contexts() == 4
        left: list[int] = []
        drainer = threading.Thread(target=lambda: left.append(drain(replicas.servers[0], replicas.servicers[0], 10)))
        drainer.start()  # what `cosine drafter` does on SIGTERM
        # on the health change, before any further call: every request moved, its context released there
        _until(lambda: pool.replica_stats()[leaving].held == 0, "requests still homed on the draining replica")
        assert pool.replica_stats()[staying].held == 8 and pool.rehomes == 4
        drainer.join(10)
        assert left == [0] and replicas.servicers[0].num_contexts() == 0  # it exited holding nothing
        for i in range(8):  # each moved request's next call sends its whole context to the other
            assert pool.propose(f"r{i}", [1, 2, 3, 9], 2).token_ids == (10, 11)
        pool.propose("new", [1, 2], 2)
        assert pool.home_of("new") == staying
        assert replicas.servicers[1].num_contexts() == 9
    finally:
        pool.close()


def test_a_dead_replica_costs_one_call_never_the_request(replicas):
    pool = ReplicaPool("code", replicas.addresses, base_timeout_s=2.0)
    try:
        for i in range(4):
            pool.propose(f"r{i}", [5, 6], 2)
        replicas.kill(1)
        for i in range(4):  # the requests of the dead replica move within the call
            d = pool.propose(f"r{i}", [5, 6, 7], 2)
            assert d.token_ids == (8, 9)
            assert pool.home_of(f"r{i}") == replicas.addresses[0]
        assert pool.rehomes == 2
        assert pool.replica_stats()[replicas.addresses[1]].errors >= 1
        pool.propose("fresh", [1], 1)  # a new request avoids the dead replica
        assert pool.home_of("fresh") == replicas.addresses[0]
        replicas.kill(0)
        with pytest.raises(grpc.RpcError):  # no replica left: the caller counts a failed draft
            pool.propose("r0", [5, 6, 7, 8], 2)
    finally:
        pool.close()


def test_two_verifiers_share_a_replica_and_a_gone_verifier_is_evicted():
    clock = Clock()
    engine = RuleEngine()
    servicer = DrafterServicer(engine, pool="code", verifier_timeout_s=60.0, context_idle_s=1000.0, clock=clock)
    server = serve(servicer, port=0)
    address = [f"127.0.0.1:{server.bound_port}"]
    a = ReplicaPool("code", address, verifier_id="verifier-a")
    b = ReplicaPool("code", address, verifier_id="verifier-b")
    try:
        a.propose("req-1", [1, 2], 2)
        assert b.propose("req-1", [7, 8], 2).token_ids == (9, 10)  # the same id, another verifier's context
        assert a.propose("req-1", [1, 2, 3], 2).token_ids == (4, 5)  # a delta on a's own context
        assert servicer.num_contexts() == 2
        clock.now = 61.0  # verifier b went away without releasing; a keeps calling
        a.propose("req-2", [4], 1)
        assert servicer.num_contexts() == 2  # a's two requests: b's context was evicted
        b.release("req-1")
        a.release("req-1")
        a.release("req-2")
        assert servicer.num_contexts() == 0
    finally:
        a.close()
        b.close()
        server.stop(None)
        servicer.close()


def test_resolve_addresses_expands_dns_names():
    assert resolve_addresses(["10.0.0.1:50052"]) == ["10.0.0.1:50052"]
    assert resolve_addresses(["dns:///localhost:50052"])[0] in ("127.0.0.1:50052", "[::1]:50052")
    with pytest.raises(OSError):
        resolve_addresses(["dns:///no-such-host.invalid:50052"])


def test_a_drain_does_not_wait_for_verifiers_that_are_gone(replicas):
    """Catches: a replica whose verifier died (SIGKILLed with `cosine serve`, or a deleted
    cluster) holding on to the end of its grace for contexts nobody will release."""
    from cosine.transport.drafter_service import drain

    pool = ReplicaPool("code", [replicas.addresses[0]])
    pool.propose("r", [1, 2, 3], 2)
    pool.close()  # the verifier is gone without a release
    assert replicas.servicers[0].num_contexts() == 1
    started = time.monotonic()
    assert drain(replicas.servers[0], replicas.servicers[0], timeout_s=30, quiet_s=0.5) == 1
    assert time.monotonic() - started < 5


def test_a_draining_pool_of_one_replica_gets_no_new_request_and_drains_at_once():
    """Catches: a single-replica pool whose replica drains (SIGTERM: a scale-down, a rollout, a
    spot notice) still given new requests (the fallback when no replica is healthy), so that it
    never empties and its drain runs to the pod's deadline while the verifier keeps calling."""
    import threading

    from cosine.transport.drafter_service import drain

    replicas = Replicas(1)
    pool = ReplicaPool("code", replicas.addresses)
    try:
        pool.propose("old", [1, 2, 3], 2)
        left: list[int] = []
        started = time.monotonic()
        drainer = threading.Thread(target=lambda: left.append(drain(replicas.servers[0], replicas.servicers[0], 20)))
        drainer.start()
        _until(lambda: pool._replicas[replicas.addresses[0]].draining, "the pool never saw the replica drain")
        assert pool.propose("old", [1, 2, 3, 4], 2).token_ids == (5, 6)  # what it holds is served to the end
        refused = 0
        for i in range(10):  # a live verifier's new requests meanwhile
            try:
                pool.propose(f"new{i}", [7, 8], 2)
            except RuntimeError as e:
                assert "draining" in str(e), repr(e)
                refused += 1
            time.sleep(0.05)
        assert refused == 10 and replicas.servicers[0].num_contexts() == 1
        pool.release("old")  # the request finished: the replica holds nothing now
        drainer.join(20)
        assert left == [0] and time.monotonic() - started < 5  # not the 20 s deadline
    finally:
        pool.close()
        replicas.close()
