"""Drafters: propose draft tokens for a request.

A drafter keeps its own per-request state and continues from the tokens the target accepted:
`propose(request_id, context_ids, max_tokens)` drafts after `context_ids` (prompt + every token
emitted so far). Drafts are point-mass proposals (greedy tokens, no distribution): vLLM's
rejection sampler verifies them losslessly under greedy decoding and sampling alike (accept x with
probability p(x), else sample from p without x). Kinds: `lookup.LookupDrafter`,
`cross_tokenizer_drafter.CrossTokenizerDrafter`, `transport.remote_drafter.RemoteDrafter` (a pool over gRPC).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DraftBranch:
    """A greedy draft continuing the asked context + `expected[:prefix_len]` (see `Drafter.propose`)."""

    prefix_len: int
    token_ids: tuple[int, ...]
    confidences: tuple[float, ...]


@dataclass(frozen=True)
class Draft:
    """Draft tokens for one request. confidences: the drafter's top probability at each position,
    in [0, 1]. drafter: name of the drafter. draft_s: wall seconds spent drafting. prefix_len:
    `token_ids` continue the context + `expected[:prefix_len]` (0 when the drafter ignores
    `expected`). branches: drafts for rejection points of `expected`."""

    token_ids: tuple[int, ...]
    confidences: tuple[float, ...]
    drafter: str
    draft_s: float
    prefix_len: int = 0
    branches: tuple[DraftBranch, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Draft length in tokens."""
        return len(self.token_ids)


class Drafter(Protocol):
    """Proposes draft tokens for requests, keeping per-request state until `release`."""

    name: str

    def propose(
        self,
        request_id: str,
        context_ids: Sequence[int],
        max_tokens: int,
        *,
        min_confidence: float = 0.0,
        expected: Sequence[int] = (),
        max_branches: int = 0,
    ) -> Draft:
        """Up to `max_tokens` draft tokens continuing `context_ids`, stopping at the first whose top
        probability is below `min_confidence`. `expected`: the draft tokens the target is verifying
        meanwhile; a drafter may draft past them (`Draft.prefix_len`) and for up to `max_branches`
        of their rejection points (`Draft.branches`), or ignore them."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished request's state (a no-op for an unknown request)."""
        ...
