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


def test_a_context_nobody_releases_is_swept_once_idle_and_one_in_flight_never():
    """Catches: a finished request's context kept for good when its `Release` was lost (a 1 s
    deadline, a verifier restarted or killed), until least-recently-used eviction past
    `max_requests`; or a sweep freeing a context whose draft call is still running."""
    clock = Clock()
    engine = RuleEngine()
    servicer = DrafterServicer(engine, pool="code", context_idle_s=10.0, sweep_every_s=0.02, clock=clock)
    server = serve(servicer, port=0)
    remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "code")
    try:
        remote.propose("done", [1, 2, 3], 2)  # finished at t=0; its Release never arrives
        clock.now = 6.0
        remote.propose("live", [4, 5], 2)  # still drafting at t=6
        clock.now = 10.5
        _until(lambda: "done" not in servicer._contexts, "an idle context was never swept")
        assert list(servicer._contexts) == ["live"] and engine.held == {"live"}  # the engine's state freed too
        engine.hang_s = 0.5  # a draft call that runs through what would be its idle time
        call = threading.Thread(target=remote.propose, args=("live", [4, 5, 6], 2))
        call.start()
        time.sleep(0.1)
        clock.now = 100.0
        time.sleep(0.2)  # sweeps run meanwhile
        assert "live" in servicer._contexts
        call.join(5)
        engine.hang_s = 0.0
        clock.now = 105.0  # idle from its answer on: kept until 110
        time.sleep(0.1)
        assert "live" in servicer._contexts
        clock.now = 110.5
        _until(lambda: servicer.num_contexts() == 0, "the context was not swept after its call")
        assert remote.propose("live", [4, 5, 6, 7], 2).token_ids == (8, 9)  # a live one swept: resent whole
    finally:
        remote.close()
        server.stop(None)
        servicer.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _until(pred, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


CLIENT = """
import sys, time
from cosine.transport.replica_pool import ReplicaPool
pool = ReplicaPool("lookup", [sys.argv[1]], verifier_id="verifier-0")
ctx = [1, 2, 3, 1, 2]
while True:  # one request's verification steps, until the process is killed
    pool.propose("request-0", ctx, 2)
    ctx.append(ctx[-1])
    print("step", flush=True)
    time.sleep(0.05)
"""


def test_a_killed_verifier_leaves_no_context_on_a_real_drafter_past_seconds(tmp_path):
    """Real processes: a `cosine drafter` (an n-gram pool: no model to load) and a verifier's
    pool client in its own process, SIGKILLed mid-request (no `Release` is ever sent). Catches: the
    drafter keeping the context (its `cosine_drafter_contexts` gauge at 1) until its verifier
    timeout (120 s), evaluated only when some verifier calls again."""
    import signal
    import subprocess
    import sys

    import httpx
    import yaml

    from cosine.embedded import start_replica, stop_children, wait_healthy
    from cosine.manifest import load_manifest

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster",
                                    "metadata": {"name": "t"}, "spec": {"verifier": {"model": "m"},
                                    "drafterPools": [{"name": "lookup", "kind": "ngram"}]}}))
    manifest = load_manifest(path)
    drafter = start_replica(manifest, manifest.spec.pool("lookup"), "lookup-0")
    client = None
    try:
        wait_healthy([drafter], timeout_s=120)

        def contexts() -> float:
            text = httpx.get(f"http://127.0.0.1:{drafter.metrics_port}/metrics", timeout=5).text
            return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("cosine_drafter_contexts{"))

        client = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{drafter.grpc_port}"],
                                  stdout=subprocess.PIPE, text=True)
        for _ in range(3):
            assert client.stdout.readline().strip() == "step"  # drafting: the context is held
        assert contexts() == 1
        client.send_signal(signal.SIGKILL)
        client.wait()
        killed_s = time.monotonic()
        _until(lambda: contexts() == 0, "the drafter still holds the killed verifier's context", timeout_s=20)
        assert time.monotonic() - killed_s < 15  # context_idle_s (10 s) and a sweep
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        stop_children([drafter])
