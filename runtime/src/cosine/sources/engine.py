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

vLLM answers k zeros for a request whose input does not fit the drafter, and MRV2 rows of -1 for
every request (its drafts stay on the device): neither is a candidate. On MRV2 the seam is
`vllm_mrv2`, where the device chooses between this source's draft and anchored candidates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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
        self._on_device = False  # the offered drafts are `on_device` placeholders

    def offer(self, drafts: Mapping[str, Sequence[int]]) -> None:
        """This step's drafts (vLLM's `DraftTokenIds` rows by request id); they replace the last
        step's. Empty rows and rows of zeros (the drafter could not take the input) are dropped
        (MRV2's rows of -1 are dropped before they get here: `vllm_hooks.engine_rows`)."""
        self._offered = {rid: tuple(int(t) for t in row) for rid, row in drafts.items() if any(row)}
        self._on_device = False

    def on_device(self, request_ids: Sequence[str], num_tokens: int) -> None:
        """The MRV2 seam: the engine drafts `num_tokens` for each request on the device after the
        coming step, tokens the proposer never sees. Each is offered as `ON_DEVICE` placeholders,
        so the proposer weighs the draft by the source's acceptance rate (its tokens match no other
        source's, and the device substitutes the real ones)."""
        self._offered = {rid: (ON_DEVICE,) * num_tokens for rid in request_ids} if num_tokens > 0 else {}
        self._on_device = True

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        """Nothing to index: the engine holds the drafter's state (its KV cache)."""

    def candidate(self, request_id: str, context: Sequence[int], max_tokens: int,
                  acceptance_rate: float) -> Candidate | None:
        """The engine's draft for the request, at most `max_tokens`, each token at confidence
        `acceptance_rate` (the drafter gives none of its own); None without one this step."""
        draft = self._offered.get(request_id, ())[:max_tokens]
        if not draft:
            return None
        return Candidate(draft, (acceptance_rate,) * len(draft), on_device=self._on_device)

    def release(self, request_id: str) -> None:
        """Forget the request's offered draft."""
        self._offered.pop(request_id, None)


ON_DEVICE = -1  # a draft token the engine makes on the device (MRV2), unknown to the proposer

MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules")  # vLLM 0.32's
# SpeculativeConfig reads a target's MTP layers under these names (vllm/config/speculative.py)


def fit_problems(method: str, target: Mapping[str, Any], drafter: Mapping[str, Any] | None) -> list[str]:
    """What stops the engine drafter `method` (`spec.verifier.speculator.method`) from running on
    this target, read from the models' `config.json` dicts (`drafter`: the head's or draft
    model's; None for `mtp`), one message per problem naming the field: `mtp` on a target
    without MTP layers; an EAGLE-3 head built for another hidden size (its `target_hidden_size`)
    or vocabulary; a draft model with another vocabulary than the target's."""
    where = "spec.verifier.speculator"
    text = {**target, **(target.get("text_config") or {})}
    if method == "mtp":
        if not any(text.get(k) for k in MTP_LAYER_KEYS):
            return [f"{where}.method: mtp needs a target with multi-token-prediction layers "
                    f"(none of {', '.join(MTP_LAYER_KEYS)} in its config)"]
        return []
    if drafter is None:
        return [f"{where}.model: {method} needs a model"]
    problems = []
    vocab = text.get("vocab_size")
    if method in ("eagle3", "eagle"):
        hidden = drafter.get("target_hidden_size", drafter.get("hidden_size"))
        if hidden != text.get("hidden_size"):
            problems.append(f"{where}.model: the EAGLE head was built for hidden size {hidden}, "
                            f"the target's is {text.get('hidden_size')}")
    if drafter.get("vocab_size") != vocab:
        problems.append(f"{where}.model: vocabulary of {drafter.get('vocab_size')} tokens, the target's has {vocab}")
    return problems
