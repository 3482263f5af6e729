"""The engine's own drafter as a draft source: vLLM's `eagle3`, `mtp` or `draft_model`, run by the
verifier's engine on its own accelerator.

vLLM drafts with it after every step, for every running request, whichever draft the step then
verifies, and hands the drafts to the scheduler (`EngineCore.post_step` ->
`Scheduler.update_draft_token_ids`, with async scheduling off); `vllm_hooks.CoSineScheduler`
`offer`s them here before the proposer chooses. Its drafts are greedy and come without
probabilities, so each token's confidence is the proposer's measured per-token acceptance of this
source for the request (calibrated per source and domain against what the target accepted, as
every source's). It costs the verifier its forward every step, paid whether its draft wins or not:
CoSine cannot save that cost, only add to what it buys (Arctic Inference's speculator + suffix
tree; Hybrid Verified Decoding, arXiv:2606.01019).

vLLM answers k zeros for a request whose input does not fit the drafter: that is no candidate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cosine.sources import Candidate, Where


class EngineSource:
    """The drafts vLLM's worker made this step, per request id (see the module docstring).

    Args:
        name: the source's name in stats and metrics (the speculator's method: `eagle3`, `mtp`,
            `draftModel`).
    """

    where = Where.ENGINE

    def __init__(self, name: str) -> None:
        self.name = name
        self._offered: dict[str, tuple[int, ...]] = {}

    def offer(self, drafts: Mapping[str, Sequence[int]]) -> None:
        """This step's drafts (vLLM's `DraftTokenIds` rows by request id); they replace the last
        step's. Empty rows and rows of zeros (the drafter could not take the input) are dropped."""
        self._offered = {rid: tuple(int(t) for t in row) for rid, row in drafts.items() if any(row)}

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        """Nothing to index: the engine holds the drafter's state (its KV cache)."""

    def candidate(self, request_id: str, context: Sequence[int], max_tokens: int,
                  acceptance_rate: float) -> Candidate | None:
        """The engine's draft for the request, at most `max_tokens`, each token at confidence
        `acceptance_rate` (the drafter gives none of its own); None without one this step."""
        draft = self._offered.get(request_id, ())[:max_tokens]
        if not draft:
            return None
        return Candidate(draft, (acceptance_rate,) * len(draft))

    def release(self, request_id: str) -> None:
        """Forget the request's offered draft."""
        self._offered.pop(request_id, None)
