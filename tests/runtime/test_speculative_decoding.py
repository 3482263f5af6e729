"""The generation loop: greedy output identical to target-only, sampled output distributed as the target's."""

import pytest
import torch
from scipy.stats import chisquare

from cosine.runtime.drafter import ModelDrafter
from cosine.runtime.models import tiny_qwen2
from cosine.runtime.speculation_control import CostModel, SpeculationSettings
from cosine.runtime.speculative_decoding import generate
from cosine.runtime.speculative_sampling import SamplingParams

NO_STOP = frozenset()


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(seed=0)


@pytest.mark.parametrize("drafter_seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_identical_to_target_only(target, drafter_seed, k):
    prompt = [5, 17, 33, 2, 8]
    want = generate(target, prompt, 40, stop_token_ids=NO_STOP).token_ids
    drafter = ModelDrafter(tiny_qwen2(seed=drafter_seed))
    got = generate(
        target, prompt, 40, drafter=drafter, stop_token_ids=NO_STOP,
        settings=SpeculationSettings(max_draft_tokens=k, adaptive=False),
    )
    assert got.token_ids == want
    assert got.stats.draft_tokens > 0
    if drafter_seed == 0:  # the drafter is the target: everything is accepted
        assert got.stats.acceptance_rate == 1.0


def test_adaptive_and_confidence_paths_are_lossless(target):
    prompt = [1, 2, 3]
    want = generate(target, prompt, 30, stop_token_ids=NO_STOP).token_ids
    cost = CostModel(draft_token_s=0.1, verify_base_s=0.3, verify_token_s=0.01)
    for settings in (SpeculationSettings(max_draft_tokens=6), SpeculationSettings(min_confidence=0.9)):
        got = generate(
            target, prompt, 30, drafter=ModelDrafter(tiny_qwen2(seed=3)), settings=settings, cost=cost,
            stop_token_ids=NO_STOP,
        )
        assert got.token_ids == want


def test_lookup_then_model_drafter_is_lossless(target):
    from cosine.runtime.ngram_drafter import NgramDrafter

    prompt = [5, 6, 7, 8] * 3 + [1, 2]
    want = generate(target, prompt, 40, stop_token_ids=NO_STOP).token_ids
    res = generate(
        target, prompt, 40, drafter=ModelDrafter(tiny_qwen2(seed=2)), lookup=NgramDrafter(),
        settings=SpeculationSettings(max_draft_tokens=4, adaptive=False), stop_token_ids=NO_STOP,
    )
    assert res.token_ids == want
    assert res.stats.draft_tokens > 0


def test_stops_at_eos_and_limit(target):
    prompt = [5, 17, 33]
    free = generate(target, prompt, 20, stop_token_ids=NO_STOP).token_ids
    stop = free[6]
    first = free.index(stop)
    for drafter in (None, ModelDrafter(tiny_qwen2(seed=0))):
        res = generate(target, prompt, 20, drafter=drafter, stop_token_ids=frozenset({stop}))
        assert res.token_ids == free[: first + 1] and res.finish_reason == "stop"
        res = generate(target, prompt, 7, drafter=drafter, stop_token_ids=NO_STOP)
        assert res.token_ids == free[:7] and res.finish_reason == "length"


def test_bad_input(target):
    with pytest.raises(ValueError, match="empty"):
        generate(target, [], 5)
    with pytest.raises(ValueError, match="max_tokens"):
        generate(target, [1], 0)
    with pytest.raises(ValueError, match="context"):
        generate(target, [1] * 10, target.max_context_tokens)


def test_sampled_generation_matches_target_distribution():
    """Joint distribution of tokens 1-2 with speculation (token 2 comes from a verification) vs the
    exact target distribution, on an 8-token vocabulary."""
    vocab = 8
    t = tiny_qwen2(vocab_size=vocab, seed=10)
    d = ModelDrafter(tiny_qwen2(vocab_size=vocab, seed=11))
    params_t = 1.5
    prompt = [1, 2, 3]
    # exact: p(a) p(b | a)
    with torch.no_grad():
        p1 = torch.softmax(t.forward(t.new_sequence(), prompt)[-1] / params_t, -1)
        exact = torch.stack(
            [p1[a] * torch.softmax(t.forward(t.new_sequence(), prompt + [a])[-1] / params_t, -1) for a in range(vocab)]
        ).flatten()
    settings = SpeculationSettings(max_draft_tokens=3, adaptive=False)
    counts = torch.zeros(vocab * vocab)
    n = 2000
    for i in range(n):
        res = generate(
            t, prompt, 2, SamplingParams(temperature=params_t, seed=i), drafter=d, settings=settings,
            stop_token_ids=NO_STOP,
        )
        a, b = res.token_ids
        counts[a * vocab + b] += 1
    keep = exact * n >= 5  # chi-square needs expected counts >= 5; pool the rest
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([exact[keep], exact[~keep].sum()[None]]) * n
    pvalue = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue
    tv = 0.5 * float((counts / n - exact).abs().sum())
    assert pvalue > 1e-3 and tv < 0.08, f"p-value {pvalue:.2e}, TV {tv:.3f}"
