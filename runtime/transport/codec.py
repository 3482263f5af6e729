"""Protobuf <-> engine messages, in one place (protobuf stays at the edge)."""

from __future__ import annotations

import torch

from cosine.runtime.compression import CompressedDist, Compression, decompress
from cosine.runtime.drafter import Draft, DraftBranch
from cosine.runtime.speculative_sampling import SamplingParams
from cosine.runtime.transport import drafter_pb2 as pb


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)


def sampling_from_proto(m: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=max(0.0, m.temperature), top_p=m.top_p or 1.0, top_k=m.top_k)


def compression_to_proto(c: Compression | None) -> pb.Compression | None:
    return None if c is None else pb.Compression(top_k=c.top_k, bits=c.bits)


def compression_from_proto(m: pb.Compression, present: bool) -> Compression | None:
    return Compression(top_k=m.top_k, bits=m.bits) if present and m.top_k else None


def draft_to_proto(d: Draft) -> pb.ProposeResponse:
    return pb.ProposeResponse(
        token_ids=list(d.token_ids),
        confidences=list(d.confidences),
        dists=[pb.DraftDistribution(token_ids=list(c.token_ids), codes=c.codes) for c in d.compressed],
        bits=d.compressed[0].bits if d.compressed else 0,
        draft_s=d.draft_s,
        drafter=d.drafter,
    )


def draft_from_proto(m: pb.ProposeResponse, vocab_size: int, name: str) -> Draft:
    """Rebuild the draft; compressed distributions are decompressed into q~ [k, vocab]."""
    wire = tuple(CompressedDist(tuple(x.token_ids), x.codes, m.bits) for x in m.dists)
    if wire and len(wire) != len(m.token_ids):
        raise ValueError(f"{len(m.token_ids)} draft tokens but {len(wire)} distributions")
    probs = torch.stack([decompress(c, vocab_size) for c in wire]) if wire else None
    branches = tuple(DraftBranch(b.prefix_len, tuple(b.token_ids), tuple(b.confidences)) for b in m.branches)
    return Draft(tuple(m.token_ids), probs, tuple(m.confidences), name, m.draft_s, wire, m.prefix_len, branches)
