"""Compressed draft distributions: top-K of q, quantized (after COACH, arXiv:2501.12388).

A full draft distribution over Qwen's vocabulary is 151,936 x 4 bytes = 607,744 bytes per draft
token. The drafter instead keeps the K most likely tokens and quantizes their probabilities to
`bits` (8: uint8 relative to the largest; 16: float16; 32: float32). Losslessness is kept by
construction: the drafter samples from exactly the decompressed distribution q~ it transmits, and
the verifier rebuilds the same q~ from the same bytes with the same code (`decompress`), so the
rejection test of Leviathan et al. 2023 uses the true proposal distribution. Compression only
costs acceptance (q~ is a coarser proposal), never correctness.

`choose_compression` is the pure policy that picks K and bits for a link from its measured
bandwidth, keeping transfer time a small share of the drafting time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BITS = (8, 16, 32)


@dataclass(frozen=True)
class Compression:
    """top_k: tokens kept per position (>= 1). bits: 8, 16 or 32 per kept probability."""

    top_k: int = 32
    bits: int = 8

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"compression top_k must be >= 1, got {self.top_k}")
        if self.bits not in BITS:
            raise ValueError(f"compression bits must be one of {BITS}, got {self.bits}")


@dataclass(frozen=True)
class CompressedDist:
    """One position's q~: token ids [K'] (K' <= K, zero-probability entries dropped) and their
    quantized probabilities as bytes (K' values of `bits` bits)."""

    token_ids: tuple[int, ...]
    codes: bytes
    bits: int

    @property
    def num_bytes(self) -> int:
        """Payload size: ids as 4-byte integers plus the codes (protobuf varints are smaller)."""
        return 4 * len(self.token_ids) + len(self.codes)


def compress(probs: torch.Tensor, c: Compression) -> CompressedDist:
    """Compress one distribution.

    Args:
        probs: [vocab] float32 probabilities.
    Returns:
        the top-K entries with quantized probabilities; entries that quantize to 0 are dropped
        (the top token never is).
    """
    k = min(c.top_k, probs.shape[-1])
    vals, ids = torch.topk(probs.float(), k)
    v = vals.numpy().astype(np.float64)
    if c.bits == 8:
        codes = np.rint(v / max(v[0], 1e-30) * 255.0).astype(np.uint8)
    elif c.bits == 16:
        codes = v.astype(np.float16)
    else:
        codes = v.astype(np.float32)
    keep = codes.astype(np.float64) > 0
    keep[0] = True
    if c.bits == 8:
        codes[0] = max(int(codes[0]), 1)
    elif codes[0] <= 0:
        codes[0] = np.finfo(codes.dtype).tiny
    return CompressedDist(tuple(int(i) for i in ids[torch.from_numpy(keep)].tolist()), codes[keep].tobytes(), c.bits)


def decompress(d: CompressedDist, vocab_size: int) -> torch.Tensor:
    """Rebuild q~ as a [vocab_size] float32 distribution (the same floats on both ends of the link)."""
    dtype = {8: np.uint8, 16: np.float16, 32: np.float32}[d.bits]
    vals = torch.from_numpy(np.frombuffer(d.codes, dtype=dtype).astype(np.float32))
    if len(vals) != len(d.token_ids):
        raise ValueError(f"{len(d.token_ids)} token ids but {len(vals)} probabilities")
    q = torch.zeros(vocab_size, dtype=torch.float32)
    q[torch.tensor(d.token_ids, dtype=torch.long)] = vals
    return q / q.sum()


def round_trip(probs: torch.Tensor, c: Compression) -> tuple[torch.Tensor, CompressedDist]:
    """q~ = decompress(compress(q)): what the drafter samples from and sends."""
    d = compress(probs, c)
    return decompress(d, probs.shape[-1]), d


def wire_bytes_per_token(c: Compression) -> float:
    """Estimated bytes on the wire per draft token: K * (3 + bits / 8) (protobuf varint ids of ~3
    bytes plus the codes); the estimate `choose_compression` budgets with."""
    return c.top_k * (3 + c.bits / 8)


def choose_compression(
    bandwidth_bytes_per_s: float,
    draft_token_s: float,
    *,
    max_share: float = 0.05,
    top_k_choices: tuple[int, ...] = (8, 16, 32, 64, 128, 256),
) -> Compression:
    """Largest (K, bits) whose transfer time per draft token stays within `max_share` of the time
    to draft it; at least K = 8 with 8 bits. Pure policy: measured numbers in, a setting out.

    Bytes per token are estimated as K * (3 + bits / 8) (protobuf varint ids of ~3 bytes).
    """
    budget_bytes = bandwidth_bytes_per_s * draft_token_s * max_share
    best = Compression(top_k_choices[0], 8)
    for bits in (8, 16, 32):
        for k in top_k_choices:
            if wire_bytes_per_token(Compression(k, bits)) <= budget_bytes and (k, bits) > (best.top_k, best.bits):
                best = Compression(k, bits)
    return best
