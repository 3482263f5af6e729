"""`cosine.tooling.draft_cost`: each drafter engine timed on real prompts in a child pinned to a pool's cores.

The llama.cpp case runs SmolLM2-135M's GGUF file (a few seconds); the vLLM case loads a vLLM engine
(about a minute on this CPU) and is marked slow.
"""

from __future__ import annotations

import os

import pytest

from cosine.model_store import pull
from cosine.tooling import draft_cost

SMALL = "smollm2-135m-instruct"
PROMPTS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "What is 17 times 23? Show your steps."}],
]


def _check(costs: list[draft_cost.DraftCost], engine: str, k: int, batches: list[int], cores: list[int]) -> None:
    assert [c.batch for c in costs] == batches
    for c in costs:
        assert (c.engine, c.model, c.cores, c.threads) == (engine, SMALL, tuple(cores), len(cores))
        assert 0 < c.draft_tokens <= k * c.batch
        assert c.prompt_tokens > 20 * c.batch  # the chat template and the question, per request
        assert c.prefill_tokens_per_s > 0
        assert 0 < c.draft_s_per_token <= c.draft_step_s


@pytest.mark.real_model
def test_llamacpp_draft_cost_in_a_pinned_child() -> None:
    pull(SMALL, progress=False)  # pulled here, never skipped for want of it
    cores = sorted(os.sched_getaffinity(0))[-1:]
    costs = draft_cost.measure_in_child("llamacpp", SMALL, PROMPTS, 4, [1, 2], cores, timeout_s=300)
    _check(costs, "llamacpp", 4, [1, 2], cores)
    assert costs[0].draft_tokens == 4  # greedy SmolLM2 does not end its answer within 4 tokens


@pytest.mark.slow
@pytest.mark.real_model
def test_vllm_draft_cost_in_a_pinned_child() -> None:
    pull(SMALL, progress=False)
    cores = sorted(os.sched_getaffinity(0))[-1:]
    costs = draft_cost.measure_in_child("vllm", SMALL, PROMPTS, 4, [1, 2], cores, timeout_s=900)
    _check(costs, "vllm", 4, [1, 2], cores)


def test_child_failure_names_engine_and_model() -> None:
    with pytest.raises(RuntimeError, match="(?s)draft cost of tensorrt on .*unknown drafter engine 'tensorrt'"):
        draft_cost.measure_in_child("tensorrt", SMALL, PROMPTS, 4, [1], sorted(os.sched_getaffinity(0))[:1],
                                    timeout_s=300)


@pytest.mark.parametrize(("engine", "k", "batches", "match"), [
    ("llamacpp", 0, [1], "k must be >= 1"),
    ("llamacpp", 4, [3], "need at least 3 prompts"),
    ("onnx", 4, [1], "unknown drafter engine 'onnx'"),
])
def test_bad_arguments_are_rejected_before_loading(engine: str, k: int, batches: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        draft_cost.measure(engine, SMALL, PROMPTS, k, batches, 1)
