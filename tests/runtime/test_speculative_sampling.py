"""Verification math: literal greedy cases and statistical losslessness of speculative sampling."""

import pytest
import torch
from scipy.stats import chisquare

from cosine.runtime.speculative_sampling import (
    SamplingParams,
    logits_to_probs,
    verify_greedy,
    verify_sampling,
)


def onehot_logits(token_ids: list[int], vocab: int = 10) -> torch.Tensor:
    """Logits whose argmax at row i is token_ids[i]."""
    x = torch.zeros(len(token_ids), vocab)
    for i, t in enumerate(token_ids):
        x[i, t] = 5.0
    return x


@pytest.mark.parametrize(
    "draft, target_argmax, accepted, output, bonus",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, (1, 2, 3, 4), True),  # all accepted + bonus
        ([1, 2, 3], [1, 5, 3, 4], 1, (1, 5), False),  # mismatch at 1: recovered 5
        ([1, 2, 3], [7, 2, 3, 4], 0, (7,), False),  # first rejected
        ([], [9], 0, (9,), True),  # no draft: plain decoding step
        ([4, 4], [4, 4, 4], 2, (4, 4, 4), True),
        ([1, 2, 3], [1, 2, 9, 4], 2, (1, 2, 9), False),  # later tokens never rescue a rejection
    ],
)
def test_greedy_literal(draft, target_argmax, accepted, output, bonus):
    r = verify_greedy(draft, onehot_logits(target_argmax))
    assert (r.num_accepted, r.output_token_ids, r.bonus) == (accepted, output, bonus)


def test_greedy_shape_error():
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify_greedy([1, 2], onehot_logits([1, 2]))


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1, top_p=0)
    with pytest.raises(ValueError, match="greedy"):
        logits_to_probs(torch.zeros(1, 4), SamplingParams())


def test_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]), atol=1e-5)
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]), atol=1e-5)
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.1))  # always keeps the top token
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0, 0]]), atol=1e-6)


VOCAB = 6
TRIALS = 12000


def _dists(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(2, VOCAB, generator=g) * 1.5, -1)  # target, 2 positions (k = 1)
    q = torch.softmax(torch.randn(1, VOCAB, generator=g) * 1.5, -1)  # drafter, different
    return p, q


def _first_token_counts(p, q, rule, point_mass=False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB)
    for _ in range(TRIALS):
        x = int(torch.multinomial(q[0], 1, generator=g))
        r = rule([x], None if point_mass else q, p, g)
        counts[r.output_token_ids[0]] += 1
    return counts


def _assert_matches(counts: torch.Tensor, p: torch.Tensor) -> None:
    support = p > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives probability 0"
    expected = p[support] * counts.sum()
    pvalue = chisquare(counts[support].numpy(), expected.numpy()).pvalue
    tv = 0.5 * float((counts / counts.sum() - p).abs().sum())
    assert pvalue > 1e-3 and tv < 0.02, f"p-value {pvalue:.2e}, TV {tv:.3f}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_matches_target_distribution(seed):
    """The first emitted token is distributed as p_1, whatever q was (Leviathan et al. 2023, Thm 1)."""
    p, q = _dists(seed)
    _assert_matches(_first_token_counts(p, q, verify_sampling), p[0])


def test_point_mass_proposal_matches_target():
    """A draft token with no q (n-gram / fused) is a point-mass proposal: still lossless."""
    p, q = _dists(3)
    _assert_matches(_first_token_counts(p, q, verify_sampling, point_mass=True), p[0])


def test_broken_sampler_is_caught():
    """The statistical test has power: a rule that accepts every draft token fails it."""
    from cosine.runtime.speculative_sampling import VerificationResult

    def accept_all(draft, q, p, g):
        return VerificationResult(len(draft), tuple(draft) + (0,), True)

    p, q = _dists(0)
    with pytest.raises(AssertionError):
        _assert_matches(_first_token_counts(p, q, accept_all), p[0])


def test_bonus_token_distribution():
    """When every draft token is accepted the bonus token is drawn from p_{k+1}."""
    p = torch.tensor([[1.0, 0, 0, 0, 0, 0], [0.1, 0.2, 0.3, 0.4, 0, 0]])
    q = torch.tensor([[1.0, 0, 0, 0, 0, 0]])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB)
    for _ in range(4000):
        r = verify_sampling([0], q, p, g)
        assert r.num_accepted == 1 and r.bonus
        counts[r.output_token_ids[1]] += 1
    _assert_matches(counts, p[1])
