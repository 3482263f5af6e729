"""Drafter service over real gRPC on loopback: stubs current, drafts as the engine makes them,
context deltas, faults (dead, hung, restarted pool), and a soak of the proposer against two pools
that must end with no per-request state anywhere."""

from __future__ import annotations

import filecmp
import random
import threading
import time

import grpc
import pytest
from cosine_spec.cluster_spec import SpeculationSpec

from cosine.drafter import Draft, DraftBranch
from cosine.pool_policy import PoolPolicy
from cosine.proposer import CoSineProposer, ProposerSettings, RequestOutcome, StepRecord
from cosine.transport.drafter_service import DrafterServicer, serve
from cosine.transport.remote_drafter import RemoteDrafter


def _k(max_draft_len: int, **speculation) -> SpeculationSpec:
    """spec.speculation with k's upper bound `max_draft_len`."""
    return SpeculationSpec(max_draft_len=max_draft_len, **speculation)


class RuleEngine:
    """A `DraftEngine` drafting ctx[-1]+1, +2, ... (mod 50); `delay_s` per round (with `jitter_s`),
    `hang_s` to simulate a stuck engine. Keeps the set of requests it holds state for."""

    name = "rule"
    vocab_size = 50

    def __init__(self, delay_s: float = 0.0, jitter_s: float = 0.0, hang_s: float = 0.0) -> None:
        self.delay_s, self.jitter_s, self.hang_s = delay_s, jitter_s, hang_s
        self.held: set[str] = set()
        self.batch_sizes: list[int] = []
        self._lock = threading.Lock()

    def draft(self, jobs):
        time.sleep(self.hang_s + self.delay_s + random.random() * self.jitter_s)
        with self._lock:
            self.held.update(j.request_id for j in jobs)
            self.batch_sizes.append(len(jobs))
        self.jobs = list(jobs)
        return [Draft(tuple((j.context_ids[-1] + 1 + i) % 50 for i in range(j.max_tokens)),
                      (0.9,) * j.max_tokens, "fake", 0.0, len(j.expected),
                      tuple(DraftBranch(i, (40 + i,), (0.3,)) for i in range(j.max_branches))) for j in jobs]

    def release(self, request_id):
        with self._lock:
            self.held.discard(request_id)

    def num_requests(self):
        return len(self.held)


def test_generated_stubs_are_current(tmp_path):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "proto" / "codegen.py"  # a development script
    spec = importlib.util.spec_from_file_location("codegen", script)
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    codegen.generate(tmp_path)
    for name in codegen.GENERATED:
        assert filecmp.cmp(tmp_path / name, codegen.OUT / name, shallow=False), (
            f"{name} is stale: run python proto/codegen.py"
        )


@pytest.fixture()
def pool():
    engine = RuleEngine()
    servicer = DrafterServicer(engine, pool="code", tokenizer_family="tiny")
    server = serve(servicer, port=0)
    yield server, servicer, engine
    server.stop(None)
    servicer.close()


def test_remote_drafts_are_the_engines_and_info(pool):
    server, servicer, engine = pool
    remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "code")
    info = remote.info()
    assert (info.pool, info.vocab_size, info.tokenizer_family) == ("code", 50, "tiny")
    d = remote.propose("r", [1, 2, 3], 4)
    assert d.token_ids == (4, 5, 6, 7) and d.confidences == pytest.approx((0.9,) * 4)
    d = remote.propose("r", [1, 2, 3, 4, 5], 2)  # a context delta: 2 new tokens sent
    assert d.token_ids == (6, 7)
    assert servicer._contexts["r"] == [1, 2, 3, 4, 5]
    # the draft being verified goes to the engine; the main draft's prefix and the branches come back
    d = remote.propose("r", [1, 2, 3, 4, 5], 2, expected=(6, 7), max_branches=2)
    assert (engine.jobs[0].expected, engine.jobs[0].max_branches) == ((6, 7), 2)
    assert d.prefix_len == 2 and [(b.prefix_len, b.token_ids) for b in d.branches] == [(0, (40,)), (1, (41,))]
    assert d.branches[0].confidences == pytest.approx((0.3,))
    remote.release("r")
    assert servicer.num_contexts() == 0


def test_drafter_restart_is_transparent(pool):
    """The server forgets a request (restart / eviction): the client resends the whole context."""
    server, servicer, _ = pool
    remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "code")
    remote.propose("r1", [1, 2, 3, 4], 3)
    servicer._contexts.clear()
    d2 = remote.propose("r1", [1, 2, 3, 4, 5], 3)
    assert d2.token_ids == (6, 7, 8)


def test_dead_drafter_raises_quickly():
    servicer = DrafterServicer(RuleEngine(), pool="code")
    server = serve(servicer, port=0)
    remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "code", base_timeout_s=0.5)
    assert remote.propose("x", [1, 2], 2).token_ids == (3, 4)
    server.stop(None)
    servicer.close()
    with pytest.raises(grpc.RpcError) as err:
        remote.propose("x", [1, 2, 3], 2)
    # refused at once, not left to run out its deadline
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value


def test_hung_drafter_is_cut_off_by_the_deadline():
    servicer = DrafterServicer(RuleEngine(hang_s=3.0), pool="stuck")
    server = serve(servicer, port=0)
    try:
        remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "stuck", base_timeout_s=0.2,
                               per_token_timeout_s=0.01)
        with pytest.raises(grpc.RpcError) as err:
            remote.propose("r", [1, 2], 2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # cut off, not the 3 s hang's answer
        sample = servicer.metrics.registry.get_sample_value  # the stuck round shows as busy before it ends
        assert sample("cosine_drafter_rounds_total", {"pool": "stuck"}) == 0
        assert sample("cosine_drafter_busy_seconds_total", {"pool": "stuck"}) >= 0.2
    finally:
        server.stop(None)
        servicer.close()


def test_concurrent_proposes_are_batched():
    engine = RuleEngine(delay_s=0.05)
    servicer = DrafterServicer(engine, pool="code")
    server = serve(servicer, port=0)
    try:
        remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "code")
        threads = [threading.Thread(target=remote.propose, args=(f"r{i}", [i, i + 1], 3))
                   for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(engine.batch_sizes) == 12
        assert max(engine.batch_sizes) >= 4, f"rounds {engine.batch_sizes}: requests were not batched"
    finally:
        server.stop(None)
        servicer.close()


def test_soak_two_pools_rerouted_leave_no_contexts():
    """Hundreds of requests through the proposer, 8 running at a time, re-routed between two real
    gRPC pools every step (drafts made with jitter, so releases race draft calls): afterwards no
    request state remains in the proposer, the clients, the services or the engines."""
    engines = [RuleEngine(delay_s=0.001, jitter_s=0.01), RuleEngine(delay_s=0.001, jitter_s=0.01)]
    servicers = [DrafterServicer(e, pool=n) for e, n in zip(engines, ("a", "b"), strict=True)]
    servers = [serve(s, port=0) for s in servicers]
    remotes = [RemoteDrafter(f"127.0.0.1:{srv.bound_port}", n)
               for srv, n in zip(servers, ("a", "b"), strict=True)]
    p = CoSineProposer(ProposerSettings(speculation=_k(3), reroute_every=1, pool=PoolPolicy(probe_every=1)), remotes,
                       seed=3)
    rng = random.Random(0)
    running: dict[str, list[int]] = {}
    left: dict[str, int] = {}
    started = 0
    try:
        while started < 300 or running:
            while len(running) < 8 and started < 300:
                rid = f"req-{started}"
                running[rid] = [rng.randrange(50) for _ in range(rng.randrange(3, 12))]
                left[rid] = rng.randrange(2, 12)
                started += 1
            drafts = p.propose(running)
            outcomes = []
            for rid, d in drafts.items():
                n_acc = rng.randrange(len(d) + 1)
                outcomes.append(RequestOutcome(rid, len(d), n_acc, p.source_of(rid)))
                running[rid] = running[rid] + d[:n_acc] + [rng.randrange(50)]
                left[rid] -= 1
            p.observe_step(StepRecord(0.002, sum(1 + len(d) for d in drafts.values()), tuple(outcomes)))
            for rid in [r for r, n in left.items() if n <= 0]:
                del running[rid], left[rid]
            p.retain(set(running))
            time.sleep(0.001)
        assert sum(p.stats.pool_calls.values()) > 100
        assert all(p.stats.pool_calls.get(n, 0) > 30 for n in ("a", "b")), "both pools were used"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                any(s.num_contexts() for s in servicers) or any(e.num_requests() for e in engines)
                or any(r._sent for r in remotes)):
            time.sleep(0.05)
        assert p.num_requests() == 0
        assert [r._sent for r in remotes] == [{}, {}]
        assert [s.num_contexts() for s in servicers] == [0, 0]
        assert [e.num_requests() for e in engines] == [0, 0]
    finally:
        p.close()
        for srv, s in zip(servers, servicers, strict=True):
            srv.stop(None)
            s.close()
