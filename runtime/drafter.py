"""Drafters: propose draft tokens (and the distributions they were drawn from) for a request.

A drafter keeps its own per-request state (a KV cache for model drafters) and continues from the
tokens the target accepted: `propose(request_id, context_ids, ...)` first syncs its cache to
`context_ids` (rolling back rejected draft tokens, feeding the accepted/recovered/bonus ones), then
drafts. Kinds here: `ModelDrafter` (a causal LM sharing the target's tokenizer).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from cosine.runtime.compression import CompressedDist, Compression, round_trip
from cosine.runtime.models import ModelRunner, Sequence
from cosine.runtime.speculative_sampling import SamplingParams, logits_to_probs


@dataclass(frozen=True)
class DraftBranch:
    """A greedy draft continuing the asked context + `expected[:prefix_len]` (see `Drafter.propose`)."""

    prefix_len: int
    token_ids: tuple[int, ...]
    confidences: tuple[float, ...]


@dataclass(frozen=True)
class Draft:
    """Draft tokens for one request.

    token_ids: k draft tokens. probs: [k, vocab] float32 q each token was sampled from, or None
    (greedy drafting, or point-mass proposals). confidences: the drafter's top probability at each
    position, in [0, 1]. drafter: name of the drafter. draft_s: wall seconds spent drafting
    (including catching up on accepted tokens). compressed: the wire form of `probs` when the
    drafter compresses (then `probs` is exactly its decompression). prefix_len: `token_ids`
    continue the context + `expected[:prefix_len]` (0 when the drafter ignores `expected`).
    branches: drafts for rejection points of `expected`.
    """

    token_ids: tuple[int, ...]
    probs: torch.Tensor | None
    confidences: tuple[float, ...]
    drafter: str
    draft_s: float
    compressed: tuple[CompressedDist, ...] = ()
    prefix_len: int = 0
    branches: tuple[DraftBranch, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Drafter(Protocol):
    name: str

    def propose(
        self,
        request_id: str,
        context_ids: Seq[int],
        max_tokens: int,
        params: SamplingParams,
        *,
        min_confidence: float = 0.0,
        generator: torch.Generator | None = None,
        expected: Seq[int] = (),
        max_branches: int = 0,
    ) -> Draft:
        """Draft up to `max_tokens` tokens continuing `context_ids`. `expected`: the draft tokens
        the target is verifying meanwhile; a drafter may draft past them (`Draft.prefix_len`) and
        for up to `max_branches` of their rejection points (`Draft.branches`), or ignore them."""
        ...

    def release(self, request_id: str) -> None: ...


class ModelDrafter:
    """Drafts with a small causal LM that shares the target's tokenizer (Leviathan et al. 2023).

    Greedy requests get the drafter's argmax; sampled requests get tokens sampled from the drafter's
    distribution q under the same temperature/top-k/top-p, and q is returned for verification.
    With `compression`, q is replaced by its top-K quantized form q~ before sampling, and q~ is
    what is returned (and sent), so verification stays exact (see `compression`).
    """

    def __init__(self, runner: ModelRunner, name: str | None = None, compression: Compression | None = None) -> None:
        self.runner = runner
        self.name = name or runner.name
        self.compression = compression
        self._seqs: dict[str, Sequence] = {}

    def propose(
        self,
        request_id: str,
        context_ids: Seq[int],
        max_tokens: int,
        params: SamplingParams,
        *,
        min_confidence: float = 0.0,
        generator: torch.Generator | None = None,
        compression: Compression | None = None,
    ) -> Draft:
        """Draft up to `max_tokens` tokens continuing `context_ids` (prompt + all emitted tokens).

        Stops early at the first position whose top probability is below `min_confidence`.
        `compression` overrides the drafter's own setting for this call. Returns an empty draft
        when `max_tokens` is 0.
        """
        compression = compression or self.compression
        t0 = time.perf_counter()
        if max_tokens <= 0:
            return Draft((), None, (), self.name, 0.0)
        seq = self._seqs.get(request_id)
        if seq is None:
            seq = self._seqs[request_id] = self.runner.new_sequence()
        todo = self.runner.sync(seq, context_ids)
        if not todo:  # everything cached: re-feed the last token to get its logits
            self.runner.rollback(seq, seq.num_tokens - 1)
            todo = [int(context_ids[-1])]
        logits = self.runner.forward(seq, todo, logits_to_keep=1)[-1]  # [vocab]
        tokens: list[int] = []
        confidences: list[float] = []
        rows: list[torch.Tensor] = []
        wire: list[CompressedDist] = []
        for i in range(max_tokens):
            if params.greedy:
                probs = None
                top = torch.softmax(logits, dim=-1).max()
                conf, tok = float(top), int(logits.argmax())
            else:
                probs = logits_to_probs(logits[None], params)[0]
                if compression is not None:
                    probs, cd = round_trip(probs, compression)
                    wire.append(cd)
                conf = float(probs.max())
                tok = int(torch.multinomial(probs, 1, generator=generator))
            if conf < min_confidence:
                break
            tokens.append(tok)
            confidences.append(conf)
            if probs is not None:
                rows.append(probs)
            if i + 1 < max_tokens:
                logits = self.runner.forward(seq, [tok])[-1]
        q = torch.stack(rows) if rows else None
        return Draft(
            tuple(tokens), q, tuple(confidences), self.name, time.perf_counter() - t0, tuple(wire[: len(tokens)])
        )

    def release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.runner.release(seq)
