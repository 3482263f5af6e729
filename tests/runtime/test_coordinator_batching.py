"""The coordinator's batched, pipelined engine: many concurrent requests verified in shared target
passes give each request exactly its target-only greedy output; batches really form; the verifier's
idle share is measured; drafting on threads (pipelined) changes speed, never output."""

from __future__ import annotations

import asyncio

import pytest

from cosine.runtime.coordinator import Coordinator, GenerationRequest
from cosine.runtime.drafter import ModelDrafter
from cosine.runtime.models import tiny_qwen2
from cosine.runtime.ngram_drafter import NgramDrafter
from cosine.runtime.speculation_control import SpeculationSettings
from cosine.runtime.speculative_decoding import generate
from cosine.simulation.batching import BatchBudget

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [1, 1, 2]]


class _CountingTarget:
    """Wraps the target to record the batch size of every verification pass."""

    def __init__(self, runner):
        self._runner = runner
        self.batch_sizes: list[int] = []

    def forward_batch(self, seqs, *args, **kw):
        self.batch_sizes.append(len(seqs))
        return self._runner.forward_batch(seqs, *args, **kw)

    def __getattr__(self, name):
        return getattr(self._runner, name)


async def _serve_all(coord, prompts, max_tokens):
    async def one(prompt):
        out = []
        async for step in coord.generate(GenerationRequest(tuple(prompt), max_tokens, stop_token_ids=frozenset())):
            out.extend(step.token_ids)
        return tuple(out)

    return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("speculate", [False, True])
def test_concurrent_requests_are_batched_and_identical(pipelined, speculate):
    runner = tiny_qwen2(seed=0)
    target = _CountingTarget(runner)
    drafters = [ModelDrafter(tiny_qwen2(seed=0, num_layers=2), "same"), ModelDrafter(tiny_qwen2(seed=5), "other")]
    coord = Coordinator(
        target, drafters if speculate else (), SpeculationSettings(max_draft_tokens=3, adaptive=False),
        lookup=NgramDrafter("lookup") if speculate else None, pipelined=pipelined,
        batch_budget=BatchBudget(max_tokens=64, max_kv_tokens=4096, max_requests=8),
    )
    try:
        got = asyncio.run(_serve_all(coord, PROMPTS, 24))
    finally:
        coord.stop()
    for prompt, out in zip(PROMPTS, got, strict=True):
        assert out == generate(runner, prompt, 24, stop_token_ids=frozenset()).token_ids
    assert max(target.batch_sizes) > 1, target.batch_sizes
    assert coord.verifier_idle_fraction is not None and 0.0 <= coord.verifier_idle_fraction <= 1.0
    assert coord.drafter_idle_fraction is not None and 0.0 <= coord.drafter_idle_fraction <= 1.0
    if speculate:
        assert coord.drafter_idle_fraction < 1.0  # drafting took time
    assert coord.num_running == 0


def test_token_budget_bounds_every_pass():
    runner = tiny_qwen2(seed=0)
    target = _CountingTarget(runner)
    seen: list[int] = []
    real = runner.forward_batch

    def spy(seqs, token_ids, *a, **kw):
        seen.append(sum(len(t) for t in token_ids))
        return real(seqs, token_ids, *a, **kw)

    runner.forward_batch = spy
    coord = Coordinator(target, [ModelDrafter(tiny_qwen2(seed=0), "same")],
                        SpeculationSettings(max_draft_tokens=4, adaptive=False),
                        batch_budget=BatchBudget(max_tokens=12, max_kv_tokens=4096, max_requests=8))
    try:
        got = asyncio.run(_serve_all(coord, PROMPTS[:4], 16))
    finally:
        coord.stop()
    assert all(len(o) == 16 for o in got)
    decode_passes = [n for n in seen if n <= 12]
    assert decode_passes and len(decode_passes) >= len(seen) - 4  # only lone prefills may exceed it


def test_long_prompts_are_prefilled_in_chunks_without_changing_output():
    from cosine.simulation.batching import BatchSettings

    runner = tiny_qwen2(seed=0)
    target = _CountingTarget(runner)
    long_prompt = [(7 * i) % 60 + 1 for i in range(90)]
    prompts = [long_prompt, PROMPTS[0], PROMPTS[1]]
    coord = Coordinator(target, (), SpeculationSettings(max_draft_tokens=3, adaptive=False),
                        batch_budget=BatchBudget(max_tokens=32, max_kv_tokens=4096, max_requests=8),
                        batch_settings=BatchSettings(prefill_chunk_tokens=16))
    try:
        got = asyncio.run(_serve_all(coord, prompts, 12))
    finally:
        coord.stop()
    for prompt, out in zip(prompts, got, strict=True):
        assert out == generate(runner, prompt, 12, stop_token_ids=frozenset()).token_ids
    assert len(target.batch_sizes) >= 90 // 16  # the long prompt took several passes


def test_batch_aware_k_drafts_less_when_the_pass_is_compute_bound():
    """On a compute-bound pass (flat to 8 tokens, then 0.2 s per token) with a drafter costing 0.1
    s per token, k = 4 pays for a lone request (this is what the solo policy keeps choosing), but
    not for one of five sharing the pass: the batch-aware policy (SmartSpec) drafts far less. Same
    output either way. The curve is given and held fixed (weight 0): the tiny model's own pass times
    would otherwise replace it."""
    from cosine.runtime.speculation_control import CostModel, PassCurve

    runner = tiny_qwen2(seed=0)
    curve = PassCurve(((1, 0.30), (8, 0.32), (64, 0.32 + 56 * 0.2)))
    cost = CostModel(draft_token_s=0.1, verify_base_s=0.3, verify_token_s=0.003)  # alone: the curve up to 8
    drafted = {}
    for batch_aware in (True, False):
        coord = Coordinator(runner, [ModelDrafter(tiny_qwen2(seed=0), "same")],
                            SpeculationSettings(max_draft_tokens=4, acceptance_prior=0.95), cost,
                            pass_curve=curve, pass_curve_weight=0.0, batch_aware_k=batch_aware)
        steps: list[int] = []
        try:
            got = asyncio.run(_serve_counting(coord, PROMPTS, 24, steps))
        finally:
            coord.stop()
        for p, out in zip(PROMPTS, got, strict=True):
            assert out == generate(runner, p, 24, stop_token_ids=frozenset()).token_ids
        drafted[batch_aware] = sum(steps)
    assert drafted[False] >= 40, drafted  # the solo policy speculates (acceptance 1: k = 4)
    assert drafted[True] < 0.5 * drafted[False], drafted


async def _serve_counting(coord, prompts, max_tokens, steps):
    """`_serve_all`, appending each step's draft token count to `steps`."""
    async def one(prompt):
        out = []
        async for step in coord.generate(GenerationRequest(tuple(prompt), max_tokens, stop_token_ids=frozenset())):
            out.extend(step.token_ids)
            steps.append(step.num_draft_tokens)
        return tuple(out)

    return await asyncio.gather(*(one(p) for p in prompts))
