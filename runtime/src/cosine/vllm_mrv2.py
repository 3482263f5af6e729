"""CoSine inside vLLM's Model Runner V2 (MRV2): the seam where vLLM drafts, async scheduling on.

On a GPU vLLM 0.32 runs every in-engine drafter on MRV2 (`VllmConfig.use_v2_model_runner`), which
builds each step's draft tokens from its own device buffer (`RequestState.draft_tokens`, written
after `speculator.propose` in `GPUModelRunner.sample_tokens`) and takes only their count from the
scheduler. A scheduler that swaps draft tokens (the V1 seam, `vllm_hooks.CoSineScheduler`)
therefore composes nothing there, and it needs async scheduling off. So here the choice lives where
the draft is made:
- `CoSineAsyncScheduler` (an `AsyncScheduler`: async stays on) runs the shared proposer a step
  stale: per decoding request, how many draft tokens the next step verifies (its placeholders) and
  a `RowPlan`: the inner drafter's per-token acceptance estimate, and the best *anchored
  candidate* of the verifier's process (suffix trees, pools: `CoSineProposer.anchored`), i.e. the
  context length it continues plus its tokens and their calibrated path probabilities. The plan
  travels as an attribute of the `SchedulerOutput` every tensor-parallel rank receives (pickled
  with it by vLLM's message queue).
- `compose(runner)` wraps the runner's speculator (vLLM's own: `eagle3`, `mtp`, `draft_model`,
  or `ngram_gpu`, vLLM's prompt lookup on the device, when the target has no drafter): after it
  drafts, `choose` checks each row's anchored candidate on the device against the tokens really
  there (the tokens emitted since its anchor must be its own first tokens) and verifies
  whichever of the remainder and the inner draft has more expected accepted tokens. A stale
  candidate falls back to the inner draft. The choice is a function of tensors every rank holds
  and of the plan, so ranks agree; the policy may be a step stale, the tokens never are.
- The rows chosen are reported back with the next step's `ModelRunnerOutput` (`SOURCES_ATTR`), the
  step that verifies them, so calibration learns from the source really verified.
Draft sampling stays greedy (`draft_sample_method="greedy"`): the rejection sampler treats every
draft token as a point-mass proposal, exact for substituted rows too (Leviathan et al. 2023,
arXiv:2211.17192, with q a point mass). Precedents: Arctic Inference keeps async on and patches the
runner; vLLM's `ngram_gpu`; vLLM PR #45400 copies scheduler-proposed drafts into MRV2's buffer.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from cosine import proposer as prop
from cosine.sources.engine import EngineSource

log = logging.getLogger(__name__)

PLAN_ATTR = "cosine_plan"  # on SchedulerOutput: the StepPlan for the drafts made after this step
SOURCES_ATTR = "cosine_sources"  # on ModelRunnerOutput: request id -> source of the draft this step verified
LOOKUP_DEVICE = "ngram_gpu"  # the inner drafter's name when it is vLLM's device lookup
ANCHOR_STEPS = 3  # an anchored candidate reaches 3 k + 2 tokens: k past two steps in flight (async: the plan
# for step t + 1 is made before step t's tokens reach the scheduler)


@dataclass(frozen=True)
class RowPlan:
    """One request's plan for the draft made after a step.

    engine_rate: the inner drafter's per-token acceptance estimate for the request (0..1).
    anchor_len: the context length (tokens) the candidate continues. token_ids: the candidate
    (may be empty), path: each token's calibrated path probability (P(tokens 0..i all accepted)),
    both [num_tokens]. source: the candidate's source name."""

    engine_rate: float
    anchor_len: int = 0
    token_ids: tuple[int, ...] = ()
    path: tuple[float, ...] = ()
    source: str = ""


@dataclass(frozen=True)
class StepPlan:
    """Every decoding request's `RowPlan`, by request id; `inner`: the inner drafter's name;
    `inner_depth`: how many tokens the inner drafter drafts (`CoSineProposer.engine_draft_len`;
    0: as many as the step verifies). A row may verify more (a longer anchored candidate): past
    the inner drafter's depth its draft holds its last token (as vLLM's `ngram_gpu` pads)."""

    inner: str
    rows: Mapping[str, RowPlan] = field(default_factory=dict)
    inner_depth: int = 0


def choose(
    inner_drafts: torch.Tensor,
    token_ids: torch.Tensor,
    total_len: torch.Tensor,
    idx_mapping: torch.Tensor,
    plan: StepPlan,
    req_ids: Sequence[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the draft with the most expected accepted tokens: the inner drafter's or the rest
    of the row's anchored candidate, if the tokens emitted since its anchor are its own first ones.

    Args:
        inner_drafts: [num_reqs, K] int64, the inner speculator's drafts in batch order.
        token_ids: [max_num_reqs, max_model_len] every request's tokens (MRV2's
            `RequestState.all_token_ids`), total_len: [max_num_reqs] how many are there.
        idx_mapping: [num_reqs] batch row -> request state row. plan: the step's plan.
        req_ids: [num_reqs] the rows' request ids.
    Returns:
        (drafts [num_reqs, K] int64, on the inner drafts' device; chosen [num_reqs] bool, True
        where the anchored candidate was taken). Expected accepted tokens: the inner draft's
        sum_i rate^i over its first `plan.inner_depth` tokens (all K for 0); the candidate's, its
        path probabilities past the tokens already emitted, divided by the path probability of
        those. Past the inner depth, a row not taking its candidate repeats the inner draft's last
        token: a valid token id, verified and almost always rejected (lossless either way).
    """
    device = inner_drafts.device
    num_reqs, k = inner_drafts.shape
    depth = min(k, plan.inner_depth) if plan.inner_depth > 0 else k
    if depth < k:
        inner_drafts = torch.cat([inner_drafts[:, :depth], inner_drafts[:, depth - 1 : depth].expand(-1, k - depth)], 1)
    rows = [plan.rows.get(r) for r in req_ids]
    width = max([len(p.token_ids) for p in rows if p is not None] + [1])
    cand = torch.full((num_reqs, width), -1, dtype=torch.int64)
    path = torch.zeros((num_reqs, width), dtype=torch.float32)
    anchor = torch.zeros(num_reqs, dtype=torch.int64)
    length = torch.zeros(num_reqs, dtype=torch.int64)
    rate = torch.zeros(num_reqs, dtype=torch.float32)
    for i, p in enumerate(rows):
        if p is None:
            continue
        rate[i], anchor[i], length[i] = p.engine_rate, p.anchor_len, len(p.token_ids)
        if p.token_ids:
            cand[i, : len(p.token_ids)] = torch.tensor(p.token_ids, dtype=torch.int64)
            path[i, : len(p.path)] = torch.tensor(p.path, dtype=torch.float32)
    cand, path, anchor, length, rate = (t.to(device, non_blocking=True) for t in (cand, path, anchor, length, rate))
    idx = idx_mapping[:num_reqs].to(torch.int64)
    seq_len = total_len[idx].to(torch.int64)  # [num_reqs]
    shift = seq_len - anchor  # tokens emitted since the anchor
    j = torch.arange(width, device=device)
    seen = j[None, :] < shift[:, None]  # [num_reqs, width]: candidate positions already emitted
    pos = (anchor[:, None] + j[None, :]).clamp(0, token_ids.shape[1] - 1)
    there = token_ids[idx[:, None], pos].to(torch.int64)
    fresh = ((there == cand) | ~seen).all(dim=1) & (shift >= 0) & (length > shift)
    r = shift[:, None].clamp(min=0) + torch.arange(k, device=device)[None, :]  # [num_reqs, K]
    in_cand = r < length[:, None]
    rest = cand.gather(1, r.clamp(max=width - 1))
    emitted_path = path.gather(1, (shift - 1).clamp(0, width - 1)[:, None])[:, 0]  # [num_reqs]
    before = torch.where(shift > 0, emitted_path, torch.ones_like(rate))
    rest_value = (path.gather(1, r.clamp(max=width - 1)) / before.clamp(min=1e-9)[:, None] * in_cand).sum(dim=1)
    powers = rate[:, None] ** torch.arange(1, depth + 1, device=device, dtype=torch.float32)[None, :]
    chosen = fresh & (rest_value > powers.sum(dim=1))
    drafts = torch.where(chosen[:, None] & in_cand, rest, inner_drafts)
    return drafts, chosen


class Composer:
    """The runner-side half of the seam: wraps one MRV2 runner's speculator (see the module
    docstring). Built by `compose`; the worker hands it each step's plan (`set_plan`) and takes
    the sources of the drafts it verified (`take_sources`)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.plan: StepPlan | None = None
        # the last choice (request ids, plan, chosen [num_reqs] bool copied to the host without a
        # sync): resolved to sources only when the next step reports them, so no step waits on it
        self._last: tuple[list[str], StepPlan, torch.Tensor] | None = None
        speculator = runner.speculator
        self._inner_propose = speculator.propose
        speculator.propose = self.propose  # the one override: an instance attribute (pinned by seam_problems)

    def set_plan(self, scheduler_output: Any) -> None:
        """The plan the scheduler attached to this step's output (None: none; drafts stay the inner's)."""
        self.plan = getattr(scheduler_output, PLAN_ATTR, None)

    def take_sources(self) -> dict[str, str]:
        """Request id -> source of the draft made last step (the one this step verified)."""
        last, self._last = self._last, None
        if last is None:
            return {}
        req_ids, plan, chosen = last
        picked = chosen.tolist()  # copied a step ago: done by now
        return {
            rid: plan.rows[rid].source if picked[i] and rid in plan.rows else plan.inner
            for i, rid in enumerate(req_ids)
        }

    def propose(self, input_batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The inner speculator's `propose`, as deep as the plan's `inner_depth`, then `choose`
        against the step's plan. Returns [num_reqs, K] (K: vLLM's `num_speculative_tokens`)."""
        plan = self.plan
        if kwargs.get("dummy_run") or plan is None or not plan.rows:
            return self._inner_propose(input_batch, *args, **kwargs)
        width = self.runner.num_speculative_steps
        depth = min(kwargs.get("num_speculative_tokens") or width, plan.inner_depth or width)
        drafts = self._drafted(input_batch, depth, args, kwargs)
        if drafts.shape[1] < width:  # (a speculator drafting one token returns one column)
            drafts = torch.cat([drafts, drafts[:, -1:].expand(-1, width - drafts.shape[1])], 1)
        req_ids = list(input_batch.req_ids)[: drafts.shape[0]]
        states = self.runner.req_states
        drafts, chosen = choose(
            drafts, states.all_token_ids.gpu, states.total_len.gpu, input_batch.idx_mapping, plan, req_ids
        )
        self._last = (req_ids, plan, chosen.to("cpu", non_blocking=True))
        return drafts

    def _drafted(self, input_batch: Any, depth: int, args: tuple, kwargs: dict) -> torch.Tensor:
        """The inner drafter's drafts, `depth` deep: vLLM's `num_speculative_tokens` argument,
        which its draft-model speculator (`StandaloneARSpeculator`) ignores, drafting all of its
        `num_speculative_steps` (read by its decode loop each call): for it that count, for this call."""
        speculator = self.runner.speculator
        kwargs = {**kwargs, "num_speculative_tokens": depth}
        if not isinstance(speculator, _ignores_depth()):
            return self._inner_propose(input_batch, *args, **kwargs)
        steps = speculator.num_speculative_steps
        speculator.num_speculative_steps = depth
        try:
            return self._inner_propose(input_batch, *args, **kwargs)
        finally:
            speculator.num_speculative_steps = steps


@functools.cache
def _ignores_depth() -> tuple[type, ...]:
    """vLLM's speculators whose `propose` drafts `num_speculative_steps` whatever its
    `num_speculative_tokens` (`vllm_hooks.seam_problems` pins the loop this relies on)."""
    try:
        from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator
    except ImportError:  # pragma: no cover - pinned vLLM has it
        return ()
    return (StandaloneARSpeculator,)


def compose(runner: Any) -> Composer | None:
    """Wrap `runner`'s speculator with CoSine's choice when it is an MRV2 runner with one; None
    otherwise (the V1 runner, or no speculator)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    if not isinstance(runner, GPUModelRunner) or getattr(runner, "speculator", None) is None:
        return None
    return Composer(runner)


class MRV2SeamWorker:
    """Worker mixin (before vLLM's worker class): composes the runner's speculator after the model
    loads, hands it each step's plan and reports the sources verified with each step's output."""

    cosine_composer: Composer | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        out = super().load_model(*args, **kwargs)  # type: ignore[misc]
        config = (self.vllm_config.additional_config or {}).get("cosine") or {}  # type: ignore[attr-defined]
        if config.get("seam") == "mrv2":
            self.cosine_composer = compose(self.model_runner)  # type: ignore[attr-defined]
        return out

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if self.cosine_composer is not None:
            self.cosine_composer.set_plan(scheduler_output)
        return super().execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        composer = self.cosine_composer
        verified = composer.take_sources() if composer is not None else None
        out = super().sample_tokens(*args, **kwargs)  # type: ignore[misc]
        if verified:
            target = getattr(out, "model_runner_output", out)  # MRV2's AsyncOutput, or the output itself
            if target is not None:
                setattr(target, SOURCES_ATTR, verified)
        return out


class CoSineAsyncScheduler(AsyncScheduler):
    """vLLM's async scheduler with CoSine's plan per step (see the module docstring): the
    proposer chooses each decoding request's next k and its anchored candidate; vLLM keeps
    admission, KV blocks, preemption and the overlap of steps.

    Raises:
        ValueError: no `additional_config["cosine"]`, its maxDraftLen differs from
            `num_speculative_tokens`, or the engine runs the V1 runner (which ignores this seam's
            plan: `vllm_hooks.CoSineScheduler` is that runner's seam).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from cosine import vllm_hooks as hooks

        config = (self.vllm_config.additional_config or {}).get(hooks.CONFIG_KEY) or {}
        if not config:
            raise ValueError(f"CoSineAsyncScheduler needs additional_config[{hooks.CONFIG_KEY!r}]")
        if not self.vllm_config.use_v2_model_runner:
            raise ValueError(
                "CoSineAsyncScheduler is the MRV2 seam, and vLLM picked the V1 model runner "
                f"for this configuration: use {hooks.SCHEDULER_CLS}"
            )
        k = hooks.speculation_of(config).max_draft_len
        if k != self.num_spec_tokens:
            raise ValueError(
                f"additional_config.cosine.speculation.maxDraftLen ({k}) must equal "
                f"speculative_config.num_speculative_tokens ({self.num_spec_tokens})"
            )
        from cosine.lookup import SuffixLookup
        from cosine.sources.lookup import LookupSource

        self.inner = EngineSource(config.get("engine_source") or LOOKUP_DEVICE)
        trees = SuffixLookup() if hooks.speculation_of(config).prompt_lookup else None
        sources: list[Any] = [self.inner] + ([LookupSource(trees)] if trees is not None else [])
        spec_config = self.vllm_config.speculative_config
        ratio = (
            hooks.weights_ratio(self.vllm_config.model_config.model, getattr(spec_config, "model", None))
            if config.get("engine_source")
            else 0.0
        )
        self.cosine = hooks.build_proposer(config, self.vllm_config.model_config.max_model_len, sources, ratio)
        self._step_t0 = 0.0

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's schedule, timed from here; new requests' prompts prefetched to their pools."""
        self._step_t0 = time.perf_counter()
        out = super().schedule(*args, **kwargs)
        for new in out.scheduled_new_reqs:
            if new.prompt_token_ids:
                self.cosine.prefetch(new.req_id, new.prompt_token_ids)
        return out

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        """Plan the drafts made after this step (`_plan`), then vLLM's bookkeeping, then each
        decoding request's placeholders for the next step: its own k, not the batch's."""
        ks = self._plan(scheduler_output)
        super()._update_after_schedule(scheduler_output)
        for rid, k in ks.items():
            request = self.requests.get(rid)
            if request is not None and not request.is_prefill_chunk:
                request.spec_token_ids = [-1] * k

    def _plan(self, scheduler_output: Any) -> dict[str, int]:
        from cosine.vllm_hooks import decoding_contexts

        contexts, prompt_lens = decoding_contexts(self.requests, scheduler_output.num_scheduled_tokens)
        k_max = self.num_spec_tokens
        self.inner.on_device(list(contexts), k_max)
        drafts = self.cosine.propose(contexts, prompt_lens, anchor_tokens=ANCHOR_STEPS * k_max + 2)
        engine_depth = min(k_max, self.cosine.engine_draft_len())
        # a request's k: its inner draft's (placeholders, its tokens are on the device), or for a
        # draft known here (lookup, a pool) the longer of it and the inner depth, since the device
        # verifies whichever is worth more once it sees the tokens; none where the proposer drafts none
        ks = {
            rid: (min(engine_depth, len(d)) if d[0] < 0 else max(len(d), engine_depth)) if d else 0
            for rid, d in drafts.items()
        }
        # MRV2 sets every draft position past the step's depth to -1 after the speculator ran
        # (`GPUModelRunner.sample_tokens`): the step's depth is the most any request verifies; the
        # inner drafter drafts `engine_depth` of it (the plan's `inner_depth`)
        scheduler_output.num_spec_tokens_to_schedule = max([engine_depth, *ks.values()]) if ks else engine_depth
        rows = {}
        for rid, ctx in contexts.items():
            tokens, path, source = self.cosine.anchored(rid, ctx, ANCHOR_STEPS * k_max + 2)
            rows[rid] = RowPlan(self.cosine.acceptance_rate(rid, self.inner.name), len(ctx), tokens, path, source)
        setattr(scheduler_output, PLAN_ATTR, StepPlan(self.inner.name, rows, engine_depth))
        return ks  # the next step verifies each request's k; the device fills them with the draft it chooses

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's update, after reading each request's draft outcome (drafted, accepted = sampled - 1,
        credited to the source the device verified) for `CoSineProposer.observe_step`."""
        step_s = time.perf_counter() - self._step_t0
        verified: Mapping[str, str] = getattr(model_runner_output, SOURCES_ATTR, None) or {}
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        outcomes = []
        for rid, spec in scheduler_output.scheduled_spec_decode_tokens.items():
            i = index.get(rid)
            if i is None or not sampled or i >= len(sampled) or not sampled[i]:
                continue
            source = verified.get(rid) or self.cosine.source_of(rid)
            outcomes.append(prop.RequestOutcome(rid, len(spec), max(0, len(sampled[i]) - 1), source))
        # the forwards the inner drafter ran after this step: the plan's depth (the step's own
        # `num_spec_tokens_to_schedule` is the widest row, a longer anchored candidate's included)
        plan = getattr(scheduler_output, PLAN_ATTR, None)
        depth = (plan.inner_depth if plan is not None and plan.inner_depth
                 else scheduler_output.num_spec_tokens_to_schedule)
        has_prefill = bool(scheduler_output.scheduled_new_reqs)
        out = super().update_from_output(scheduler_output, model_runner_output)
        self.cosine.stats.observe_queue(len(self.running), len(self.waiting))
        if scheduler_output.total_num_scheduled_tokens > 0:
            self.cosine.observe_step(
                prop.StepRecord(
                    step_s,
                    scheduler_output.total_num_scheduled_tokens,
                    tuple(outcomes),
                    has_prefill,
                    depth or 0,
                    len(scheduler_output.num_scheduled_tokens),
                )
            )
        # finished in this step: released after their last outcome, not at the next plan
        self.cosine.retain(self.requests.keys())
        return out

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        """vLLM's finish (an abort), then the requests released from the proposer and their pools
        at once (`vllm_hooks.CoSineScheduler.finish_requests`)."""
        out = super().finish_requests(request_ids, finished_status)
        self.cosine.retain(self.requests.keys())
        return out

    def shutdown(self) -> None:
        """Close the proposer, then vLLM's scheduler."""
        self.cosine.close()
        super().shutdown()
