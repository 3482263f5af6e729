"""Drafter service over real gRPC on loopback: stubs current, lossless remote drafting, faults."""

import filecmp

import grpc
import pytest

from cosine.runtime.collaborative import CollaborativeDrafters
from cosine.runtime.drafter import ModelDrafter
from cosine.runtime.models import tiny_qwen2
from cosine.runtime.speculation_control import SpeculationSettings
from cosine.runtime.speculative_decoding import generate
from cosine.runtime.speculative_sampling import SamplingParams
from cosine.runtime.transport import codegen
from cosine.runtime.transport.drafter_service import DrafterServicer, serve
from cosine.runtime.transport.remote_drafter import RemoteDrafter

NO_STOP = frozenset()
K4 = SpeculationSettings(max_draft_tokens=4, adaptive=False)


def test_generated_stubs_are_current(tmp_path):
    codegen.generate(tmp_path)
    for name in codegen.GENERATED:
        assert filecmp.cmp(tmp_path / name, codegen.OUT / name, shallow=False), (
            f"{name} is stale: run python -m cosine.runtime.transport.codegen"
        )


@pytest.fixture()
def drafter_server():
    servicer = DrafterServicer(ModelDrafter(tiny_qwen2(seed=1), name="tiny-1"), pool="code", tokenizer_family="tiny")
    server = serve(servicer, port=0)
    yield server, servicer
    server.stop(None)


def test_remote_greedy_identical_and_info(drafter_server):
    server, servicer = drafter_server
    target = tiny_qwen2(seed=0)
    remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "code", target.vocab_size)
    info = remote.info()
    assert (info.pool, info.vocab_size, info.tokenizer_family) == ("code", 64, "tiny")
    want = generate(target, [4, 8, 15], 30, stop_token_ids=NO_STOP).token_ids
    got = generate(target, [4, 8, 15], 30, drafter=remote, settings=K4, stop_token_ids=NO_STOP)
    assert got.token_ids == want and got.stats.draft_tokens > 0
    assert remote.calls > 0
    assert servicer._contexts == {}  # released at the end of the request


def test_remote_sampling_sends_compressed_q(drafter_server):
    server, _ = drafter_server
    target = tiny_qwen2(seed=0)
    remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "code", target.vocab_size)
    res = generate(
        target, [1, 2, 3], 20, SamplingParams(temperature=1.0, seed=3), drafter=remote, settings=K4,
        stop_token_ids=NO_STOP,
    )
    assert len(res.token_ids) == 20
    per_token = remote.bytes_received / max(1, res.stats.draft_tokens)
    assert per_token < 64 * 4  # top-32 8-bit, not the full fp32 distribution
    assert res.stats.draft_tokens > 0


def test_drafter_restart_is_transparent(drafter_server):
    """The server forgets a request (restart / eviction): the client resends the whole context."""
    server, servicer = drafter_server
    target = tiny_qwen2(seed=0)
    remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "code", target.vocab_size)
    d1 = remote.propose("r1", [1, 2, 3, 4], 3, SamplingParams())
    servicer._contexts.clear()
    servicer.drafter.release("r1")
    d2 = remote.propose("r1", [1, 2, 3, 4, 5], 3, SamplingParams())
    assert len(d1.token_ids) == 3 and len(d2.token_ids) == 3


def test_dead_drafter_costs_speed_not_the_request():
    target = tiny_qwen2(seed=0)
    servicer = DrafterServicer(ModelDrafter(tiny_qwen2(seed=0)), pool="code")
    server = serve(servicer, port=0)
    remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "code", target.vocab_size, base_timeout_s=0.5)
    failover = CollaborativeDrafters([remote], retry_s=60)
    want = generate(target, [9, 9, 1], 40, stop_token_ids=NO_STOP).token_ids
    got = []
    from cosine.runtime.speculative_decoding import generate_stream

    for i, step in enumerate(generate_stream(target, [9, 9, 1], 40, drafter=failover, settings=K4,
                                             stop_token_ids=NO_STOP)):
        got.extend(step.token_ids)
        if i == 2:
            server.stop(None)  # the drafter dies mid-stream
    assert tuple(got) == want
    assert failover.down_until  # marked down
    with pytest.raises(grpc.RpcError):
        remote.propose("x", [1, 2], 2, SamplingParams())


def test_drafting_ahead_is_lossless_and_hits(drafter_server):
    """Post-verify drafting through the failover wrapper: greedy output unchanged, sampled output
    still valid, and with a drafter equal to the target most drafts come from the previous step."""
    target = tiny_qwen2(seed=0)
    servicer = DrafterServicer(ModelDrafter(tiny_qwen2(seed=0)), pool="same")
    server = serve(servicer, port=0)
    try:
        for seed, drafter_port in ((0, server.bound_port), (1, drafter_server[0].bound_port)):
            remote = RemoteDrafter(f"127.0.0.1:{drafter_port}", "p", target.vocab_size)
            failover = CollaborativeDrafters([remote], retry_s=5)
            want = generate(target, [7, 3, 9], 40, stop_token_ids=NO_STOP).token_ids
            got = generate(target, [7, 3, 9], 40, drafter=failover, settings=K4, stop_token_ids=NO_STOP)
            assert got.token_ids == want
            if seed == 0:
                assert got.stats.prefetch_hits >= 3
        sampled = generate(target, [7, 3, 9], 30, SamplingParams(temperature=1.0, seed=5), drafter=failover,
                           settings=K4, stop_token_ids=NO_STOP)
        assert len(sampled.token_ids) == 30
    finally:
        server.stop(None)


def test_compression_adapts_to_the_link(drafter_server):
    """The client measures the link (response bytes over the time not spent drafting) and re-chooses
    top-K / bits with the pure policy; sampling stays exact whatever is chosen."""
    from cosine.runtime.compression import Compression, choose_compression

    server, _ = drafter_server
    target = tiny_qwen2(seed=0)
    remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "code", target.vocab_size,
                           compression=Compression(8, 8), adaptive_compression=True)
    res = generate(target, [1, 2, 3], 20, SamplingParams(temperature=1.0, seed=1), drafter=remote, settings=K4,
                   stop_token_ids=NO_STOP)
    assert len(res.token_ids) == 20
    assert remote.bandwidth_bytes_per_s and remote.bandwidth_bytes_per_s > 0
    fast = choose_compression(remote.bandwidth_bytes_per_s * 1e4, draft_token_s=0.1)  # a 10,000x faster link
    assert (fast.top_k, fast.bits) > (remote.compression.top_k, remote.compression.bits) or fast.top_k == 256


class _HangingDrafter(ModelDrafter):
    """Answers after `hang_s`: a drafter that is alive but stuck."""

    hang_s = 3.0

    def propose(self, *args, **kw):
        import time

        time.sleep(self.hang_s)
        return super().propose(*args, **kw)


def test_hung_drafter_is_cut_off_by_the_deadline():
    import time

    target = tiny_qwen2(seed=0)
    server = serve(DrafterServicer(_HangingDrafter(tiny_qwen2(seed=0)), pool="stuck"), port=0)
    try:
        remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "stuck", target.vocab_size, base_timeout_s=0.2,
                               per_token_timeout_s=0.01)
        routed = CollaborativeDrafters([remote], retry_s=60)
        want = generate(target, [2, 4, 6], 20, stop_token_ids=NO_STOP).token_ids
        t0 = time.perf_counter()
        got = generate(target, [2, 4, 6], 20, drafter=routed, settings=K4, stop_token_ids=NO_STOP)
        elapsed = time.perf_counter() - t0
        assert got.token_ids == want
        assert routed.down_until, "the stuck drafter is marked down"
        assert elapsed < 2.5, f"one deadline (~0.3 s) is all a hung drafter may cost, took {elapsed:.1f} s"
    finally:
        server.stop(None)
