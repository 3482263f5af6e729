"""Real models (pulled on first use): CoSine greedy output is token-identical to target-only greedy
decoding in float32, on real prompts of each domain; bad inputs give clear errors.

Marked `real_model`: loads Qwen2.5-Coder 1.5B (target) and 0.5B (drafter), about 9 GB of RAM.
"""

from __future__ import annotations

import pytest
import torch

from cosine.runtime.drafter import ModelDrafter
from cosine.runtime.model_store import ModelPullError, pull
from cosine.runtime.models import ModelRunner
from cosine.runtime.ngram_drafter import NgramDrafter
from cosine.runtime.speculation_control import SpeculationSettings
from cosine.runtime.speculative_decoding import generate, measure_cost_model

pytestmark = pytest.mark.real_model

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(2)
    pull(TARGET, progress=False)
    pull(DRAFTER, progress=False)
    return ModelRunner.load(TARGET), ModelRunner.load(DRAFTER)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from cosine.workloads import build, load

    paths = build(tmp_path_factory.mktemp("workloads"), per_domain=2, progress=False)
    return {d: load(paths[d]) for d in ("code", "math", "chat")}


# The reference engine's exact pair on every domain costs ~2 min more: code by default, the rest with -m slow.
@pytest.mark.parametrize(
    "domain", ["code", pytest.param("math", marks=pytest.mark.slow), pytest.param("chat", marks=pytest.mark.slow)]
)
def test_greedy_identical_to_target_only(pair, prompts, domain):
    target, drafter_runner = pair
    cost = measure_cost_model(target, drafter_runner, repeats=1)
    for p in prompts[domain]:
        ids = target.encode_prompt(p.messages())
        want = generate(target, ids, NEW_TOKENS)
        got = generate(target, ids, NEW_TOKENS, drafter=ModelDrafter(drafter_runner), cost=cost,
                       settings=SpeculationSettings(max_draft_tokens=6, min_confidence=0.3))
        assert got.token_ids == want.token_ids, f"{p.id}: {target.decode(got.token_ids)!r}"
        assert want.stats.draft_tokens == 0


def test_ngram_path_identical_on_real_model(pair, prompts):
    target, _ = pair
    p = prompts["code"][0]
    ids = target.encode_prompt(p.messages())
    want = generate(target, ids, NEW_TOKENS).token_ids
    got = generate(target, ids, NEW_TOKENS, drafter=NgramDrafter(),
                   settings=SpeculationSettings(max_draft_tokens=6, adaptive=False))
    assert got.token_ids == want


def test_bad_inputs(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="empty"):
        target.encode_prompt("   ")
    with pytest.raises(ValueError, match="max_tokens"):
        generate(target, target.encode_prompt("hi"), 0)
    with pytest.raises(ModelPullError, match="no-such-model"):
        pull("no-such-model", progress=False)


def test_cli_errors_are_clear(capsys):
    from cosine.cli import main

    assert main(["generate", "--prompt", "hi", "--max-tokens", "0", "--drafter", "none"]) == 2
    assert "max-tokens" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--target", "no-such-model", "--drafter", "none"]) == 2
    assert "no-such-model" in capsys.readouterr().err
