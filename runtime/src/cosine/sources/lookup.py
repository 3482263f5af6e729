"""Prompt and suffix lookup as a draft source (SuffixDecoding, Oliaro et al., arXiv:2411.04975).

The suffix trees are `lookup.SuffixLookup` (Arctic Inference's); this is their face to the
proposer: free (microseconds on the verifier's CPU), drafted every step, each token's confidence
its empirical probability in the trees given the tokens before it (§4.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cosine.draft_chooser import conditional
from cosine.sources import Candidate, Where

LOOKUP = "lookup"  # the source's name in stats, metrics and calibration


class SuffixTrees(Protocol):
    """What `LookupSource` needs of the trees (`lookup.SuffixLookup`; the simulator's model of it)."""

    def start(self, request_id: str, prompt: Sequence[int]) -> None: ...

    def propose(self, request_id: str, context: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]: ...

    def release(self, request_id: str) -> None: ...


class LookupSource:
    """Prompt and cross-request lookup over `trees` (see the module docstring)."""

    where = Where.PROCESS

    def __init__(self, trees: SuffixTrees, name: str = LOOKUP) -> None:
        self.trees = trees
        self.name = name

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        """Index the request's prompt."""
        self.trees.start(request_id, prompt)

    def candidate(self, request_id: str, context: Sequence[int], max_tokens: int,
                  acceptance_rate: float) -> Candidate | None:
        """The trees' likeliest continuation of `context`, per token its probability given the
        ones before (the trees' path probabilities divided down); None on no match."""
        tokens, path = self.trees.propose(request_id, context, max_tokens)
        if not tokens:
            return None
        return Candidate(tuple(tokens), conditional(path))

    def release(self, request_id: str) -> None:
        """Drop the request's prompt tree (its output stays for other requests)."""
        self.trees.release(request_id)

