"""Draft sources: everything that drafts for the verifier, each a peer of the others.

A source has a name (its key in stats, metrics, calibration and the router), where it runs
(`Where`: inside the engine, in the verifier's process, or on other machines), and, per request
and step, a `Candidate`: draft tokens with each token's confidence (its probability given the ones
before it). Sources that have no probabilities (the engine's own drafter) take theirs from what the
target has accepted of them (`sources.engine`).

The proposer (`proposer.CoSineProposer`) holds a list of *local* sources (`DraftSource`: the
engine's drafter, prompt and suffix lookup), asked every step because they cost the verifier no
extra machine, and the remote drafter pools (`pool_clients.PoolClients`), asked only where they add
enough to the best local candidate to pay (`pool_policy.PoolPolicy.skip_reason`). It fuses every
candidate by confidence and chooses k by goodput, never naming a source: adding a source is a new
file here, its field in the spec and its engine arguments.

One file per source (as vLLM's `v1/spec_decode/`): `lookup.py` (Arctic Inference's suffix trees,
SuffixDecoding), `engine.py` (vLLM's own drafter: `eagle3`, `mtp`, `draft_model`); remote pools are
`transport.replica_pool.ReplicaPool` behind `pool_clients`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class Where(StrEnum):
    """Where a source computes, which is what its draft costs the verifier."""

    ENGINE = "engine"  # inside the verifier's engine (a head or draft model): paid every step, whoever wins
    PROCESS = "process"  # in the verifier's process on the CPU (lookup): microseconds
    REMOTE = "remote"  # on other machines (drafter pools): their price, and late drafts


@dataclass(frozen=True)
class Candidate:
    """A source's draft for a request's next step: `token_ids[i]` with `confidences[i]`, the
    source's probability that token i is accepted given tokens < i are, in [0, 1] (shape: both
    [num_tokens]). on_device: the tokens are placeholders for a draft the engine makes on the device
    (the MRV2 seam), weighed by its confidences but never scored against what the target emitted."""

    token_ids: tuple[int, ...]
    confidences: tuple[float, ...]
    on_device: bool = False


class DraftSource(Protocol):
    """A local draft source, asked every step by the proposer on the engine's thread."""

    name: str
    where: Where

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        """A new request with its prompt token ids."""
        ...

    def candidate(self, request_id: str, context: Sequence[int], max_tokens: int,
                  acceptance_rate: float) -> Candidate | None:
        """Up to `max_tokens` draft tokens continuing `context` (prompt + every token emitted so
        far), or None when the source has nothing for the request this step. `acceptance_rate`:
        the proposer's per-token estimate for this source and request (what a source without
        probabilities reports as its confidence)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished request (a no-op for an unknown one)."""
        ...
