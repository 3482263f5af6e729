"""Adaptive speculation length: a pure policy, tested with plain numbers."""

from dataclasses import dataclass
from itertools import pairwise

import pytest
from cosine_spec.cluster_spec import SpeculationSpec

from cosine.speculation_control import (
    BatchedCost,
    PassCurve,
    SpeculationSettings,
    best_depth,
    best_draft_len,
    best_path_len,
    expected_tokens,
    fit_depth_s,
    initial_state,
    next_draft_len,
    observe,
)


@dataclass(frozen=True)
class LinearCost:
    """A `Cost` of one request alone: verify_s(n) = verify_base_s + (n - 1) * verify_token_s."""

    draft_token_s: float
    verify_base_s: float
    verify_token_s: float

    def draft_s(self, k: int) -> float:
        return k * self.draft_token_s

    def verify_s(self, num_tokens: int) -> float:
        return self.verify_base_s + max(0, num_tokens - 1) * self.verify_token_s


# the default pair on our CPU, roughly: 0.5B drafts at ~0.14 s/token, 1.5B verifies at ~0.37 s/pass
CPU_PAIR = LinearCost(draft_token_s=0.14, verify_base_s=0.37, verify_token_s=0.02)
FREE_DRAFTER = LinearCost(draft_token_s=0.0005, verify_base_s=0.37, verify_token_s=0.02)


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_no_speculation_when_acceptance_is_low():
    assert best_draft_len(0.05, CPU_PAIR, 8) == 0


def test_longer_drafts_when_acceptance_is_high():
    assert best_draft_len(0.9, CPU_PAIR, 8) >= 4
    assert best_draft_len(0.9, CPU_PAIR, 8) > best_draft_len(0.7, CPU_PAIR, 8)


def test_cheap_drafter_drafts_more():
    assert best_draft_len(0.6, FREE_DRAFTER, 8) > best_draft_len(0.6, CPU_PAIR, 8)


def test_converges_to_zero_then_probes():
    s = SpeculationSettings(probe_interval_steps=4)
    state = initial_state(s)
    ks = []
    for _ in range(20):
        state, k = next_draft_len(state, SpeculationSpec(max_draft_len=8), s, CPU_PAIR)
        ks.append(k)
        state = observe(state, s, k, 0)  # nothing is ever accepted
    assert ks[0] > 0
    assert ks[-8:].count(0) >= 6  # mostly off ...
    assert any(k > 0 for k in ks[-8:])  # ... with periodic probes


def test_grows_with_acceptance():
    s, spec = SpeculationSettings(), SpeculationSpec(max_draft_len=8)
    state = initial_state(s)
    for _ in range(20):
        state, k = next_draft_len(state, spec, s, CPU_PAIR)
        state = observe(state, s, k, k)  # everything accepted
    assert next_draft_len(state, spec, s, CPU_PAIR)[1] == 8
    assert state.acceptance_rate > 0.95


def test_fixed_when_not_adaptive_or_unmeasured():
    s = SpeculationSettings()
    assert next_draft_len(initial_state(s), SpeculationSpec(max_draft_len=5, adaptive=False), s, CPU_PAIR)[1] == 5
    assert next_draft_len(initial_state(s), SpeculationSpec(max_draft_len=5), s, None)[1] == 5


def test_one_speculation_config_with_the_crds_defaults_and_bounds():
    """The CRD's spec.speculation is one typed object (`SpeculationSpec`, checked against crds/ by
    tests/spec/test_cluster_spec.py) from the manifest to the proposer and the simulator: every
    runtime default is its default. Catches: a default written twice and drifting apart."""
    import dataclasses

    from cosine_spec.cluster_spec import MAX_DRAFT_LEN

    from cosine import vllm_hooks
    from cosine.pool_policy import PoolPolicy
    from cosine.proposer import ProposerSettings

    crd = SpeculationSpec()
    assert ProposerSettings().speculation == crd and PoolPolicy().branches == crd.branches
    assert PoolPolicy().max_draft_tokens == MAX_DRAFT_LEN
    assert vllm_hooks.speculation_of(vllm_hooks.proposer_config()) == crd  # travels as itself
    spec = SpeculationSpec(max_draft_len=MAX_DRAFT_LEN, adaptive=False, fusion=False, min_confidence=0.3, branches=0)
    assert vllm_hooks.speculation_of(vllm_hooks.proposer_config(spec)) == spec
    assert "min_confidence" not in {f.name for f in dataclasses.fields(SpeculationSettings)}  # not the controller's
    with pytest.raises(ValueError, match=r"spec.speculation.maxDraftLen must be in \[0, 32\]"):
        SpeculationSpec(max_draft_len=MAX_DRAFT_LEN + 1)
    with pytest.raises(ValueError, match="spec.speculation.maxDraftLen"):
        vllm_hooks.speculation_of({"speculation": {"maxDraftLen": 33}})



# ---------------------------------------------------------------- batched cost on a measured pass curve

# the 1.5B target on our 2-core CPU (fp32, measured 2026-11-22): a second token is almost free,
# then the pass is compute-bound; a GPU keeps a pass flat up to hundreds of tokens
CPU_CURVE = PassCurve(((1, 0.38), (2, 0.40), (4, 0.55), (8, 0.85), (16, 1.30), (32, 2.25)))
GPU_CURVE = PassCurve(((1, 0.020), (64, 0.021), (256, 0.030)))


def test_pass_curve_interpolates_and_extrapolates():
    assert CPU_CURVE.seconds(1) == 0.38 and CPU_CURVE.seconds(0) == 0.38
    assert CPU_CURVE.seconds(3) == pytest.approx(0.475)
    assert CPU_CURVE.seconds(64) == pytest.approx(2.25 + 32 * 0.95 / 16)  # the last slope, on
    assert PassCurve(((1, 0.5),)).seconds(100) == 0.5
    with pytest.raises(ValueError, match="start at 1"):
        PassCurve(((2, 0.1), (4, 0.2)))
    with pytest.raises(ValueError, match="increase strictly"):
        PassCurve(((1, 0.1), (4, 0.2), (4, 0.3)))
    with pytest.raises(ValueError, match="positive"):
        PassCurve(((1, 0.0),))


def test_pass_curve_values_every_count_as_its_segment_does():
    """`PassCurve.seconds` values a block of integer counts at once when one is first asked for:
    each is exactly (to the float) what the piecewise-linear formula gives on its own segment, for
    integer and fractional counts asked in any order, inside the curve and past its last point."""
    import random

    def reference(points, num_tokens):  # the formula, by a linear search for the segment
        n = max(1.0, float(num_tokens))
        if len(points) == 1:
            return points[0][1]
        for (x0, y0), (x1, y1) in pairwise(points):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = points[-2], points[-1]
        return y1 + (y1 - y0) * (n - x1) / (x1 - x0)

    rng = random.Random(3)
    for _ in range(200):
        xs = sorted({1, *(rng.randrange(2, 3000) for _ in range(rng.randrange(0, 8)))})
        points = tuple(zip(xs, sorted(rng.uniform(1e-3, 0.5) for _ in xs), strict=True))
        curve = PassCurve(points)
        asked = [rng.randrange(-2, 6000) for _ in range(100)] + list(range(0, 200)) + [rng.uniform(0, 500)]
        rng.shuffle(asked)
        for n in asked:
            assert curve.seconds(n) == reference(points, n), (points, n)


def test_pass_curve_learns_from_passes_and_stays_monotone():
    curve = CPU_CURVE
    for _ in range(200):  # the machine got twice as slow at 6 tokens
        curve = curve.observe(6, 1.4, weight=0.2)
    assert curve.seconds(6) == pytest.approx(1.4, rel=0.02)
    assert curve.seconds(1) == 0.38 and curve.seconds(16) >= curve.seconds(8) >= curve.seconds(6)
    assert all(b[1] >= a[1] for a, b in pairwise(curve.points))
    assert curve.observe(3, -1.0) is curve and curve.observe(0, 1.0) is curve  # nothing measured: ignored


def test_a_curve_seeded_on_a_large_pass_learns_the_small_ones_it_runs():
    """Seeded flat by a first 11-token pass (0.28 s), then only 4- and 8-token passes are run (as
    at 4 requests): the 1- and 2-token points, never measured, must come down with the 4-token one,
    or the curve stays flat from 1 to 8 and prices draft tokens at nothing."""
    curve = PassCurve(((1, 0.28),)).extended(64)
    for _ in range(100):
        curve = curve.observe(4, 0.24, weight=0.2).observe(8, 0.28, weight=0.2)
    assert curve.seconds(4) == pytest.approx(0.24, rel=0.02) and curve.seconds(8) == pytest.approx(0.28, rel=0.02)
    assert curve.seconds(1) <= curve.seconds(2) <= 0.241
    assert all(b[1] >= a[1] for a, b in pairwise(curve.points))


def test_pass_curve_extends_to_the_budget_and_learns_large_passes():
    """A start-up curve up to 32 tokens says little about 100-token batched passes (8 long KV
    caches): extended to the budget, the extrapolated points are corrected by what passes take."""
    curve = CPU_CURVE.extended(128)
    assert [n for n, _ in curve.points][-3:] == [32, 64, 128]
    assert curve.seconds(100) == pytest.approx(CPU_CURVE.seconds(100))  # same shape until observed
    for _ in range(300):
        curve = curve.observe(100, 6.0, weight=0.2)
    assert curve.seconds(100) == pytest.approx(6.0, rel=0.02)
    assert curve.seconds(16) == pytest.approx(1.30)  # small passes keep their measurement
    beyond = CPU_CURVE.observe(100, 9.0, weight=0.5)  # past the last point: the last point moves
    assert beyond.seconds(32) > CPU_CURVE.seconds(32)


def test_batched_cost_alone_is_the_curve():
    alone = BatchedCost(0.1, CPU_CURVE)
    for n in (1, 2, 5, 9):
        assert alone.verify_s(n) == pytest.approx(CPU_CURVE.seconds(n))
    shared = BatchedCost(0.1, CPU_CURVE, other_tokens=7, num_requests=8)
    assert shared.verify_s(1) == pytest.approx(0.85 / 8)  # a fair share of a k = 0 pass
    assert shared.verify_s(5) - shared.verify_s(1) == pytest.approx(CPU_CURVE.seconds(12) - CPU_CURVE.seconds(8))
    with pytest.raises(ValueError):
        BatchedCost(0.1, CPU_CURVE, num_requests=0)


def test_speculation_switches_off_as_a_compute_bound_batch_grows():
    """SmartSpec / vLLM #17984: the k that pays alone is too long in a batch on a compute-bound
    pass. Prompt lookup's free drafts at alpha 0.7 shrink to k = 0 by 16 requests; a 0.5B drafter
    (0.126 s per draft token, serial) stops paying from 2 requests even at alpha 0.9."""
    sizes = (1, 2, 4, 8, 16)
    lookup = [best_draft_len(0.7, BatchedCost(0.0, CPU_CURVE, other_tokens=n - 1, num_requests=n), 8) for n in sizes]
    assert lookup[0] >= 2 and lookup[-1] == 0
    assert lookup == sorted(lookup, reverse=True)
    model = [best_draft_len(0.9, BatchedCost(0.126, CPU_CURVE, other_tokens=n - 1, num_requests=n), 8) for n in sizes]
    assert model[0] >= 1 and model[1:] == [0, 0, 0, 0]
    assert best_draft_len(0.98, BatchedCost(0.0, CPU_CURVE, other_tokens=3, num_requests=4), 8) >= 4  # code


def test_path_probabilities_are_the_acceptance_model_when_geometric():
    """With path probabilities alpha^(i+1) the per-draft rule is the per-request one."""
    for alpha in (0.3, 0.6, 0.9):
        for cost in (CPU_PAIR, FREE_DRAFTER, BatchedCost(0.0, CPU_CURVE, other_tokens=3, num_requests=4)):
            assert best_path_len([alpha ** (i + 1) for i in range(8)], cost, 8) == best_draft_len(alpha, cost, 8)


def test_a_draft_is_cut_where_its_tokens_stop_paying():
    """A tree match that is sure for three tokens and then branches: the sure tokens are kept on a
    compute-bound batch, the unlikely tail is not, however cheap; a flat pass keeps what clears
    the floor."""
    path = [0.95, 0.9, 0.88, 0.3, 0.12, 0.05]
    batch = BatchedCost(0.0, CPU_CURVE, other_tokens=3, num_requests=4)
    assert best_path_len(path, batch, 8) == 3
    assert best_path_len(path, BatchedCost(3e-5, GPU_CURVE), 8, min_path_prob=0.1) == 5
    assert best_path_len(path, BatchedCost(3e-5, GPU_CURVE), 4, min_path_prob=0.1) == 4  # k's bound
    assert best_path_len([], batch, 8) == 0
    s = SpeculationSettings()
    state = initial_state(s, 0.0)  # the request's average says nothing pays; this draft does
    assert next_draft_len(state, SpeculationSpec(max_draft_len=8), s, batch, path)[1] == 3


def test_memory_bound_pass_keeps_speculating_in_a_batch():
    """On a GPU-like flat curve (drafting batched too: a tiny per-request draft cost) a batch of 32
    drafts as long as a lone request."""
    alone = best_draft_len(0.8, BatchedCost(3e-5, GPU_CURVE), 8)
    batched = best_draft_len(0.8, BatchedCost(3e-5, GPU_CURVE, other_tokens=31, num_requests=32), 8)
    assert alone == 8 and batched >= 7


def test_pool_ask_fits_a_pools_draft_into_the_verifier_step_it_overlaps():
    from cosine.speculation_control import pool_ask as ask

    # 0.8 of a 0.7 s step at 0.03 s a token: 18 tokens; 2 branches of 6 tokens each beside the main draft
    assert ask(0.7, 0.03, 0.5, 8, 2) == (6, 2)
    assert ask(0.7, 0.03, 0.5, 8, 0) == (10, 0)  # nothing verified: one chain, k + lookahead long
    assert ask(0.7, 0.01, 0.2, 8, 2) == (10, 2)  # a fast pool: full-length candidates
    assert ask(0.7, 0.1, 0.5, 8, 2) == (5, 0)  # 5 tokens: too few to share, no branch
    # a pool slower than the step drafts past what the target emits during its round trip
    assert ask(0.3, 0.5, 1.0, 8, 2) == (12, 0)
    assert ask(0.3, 0.5, 100.0, 8, 2, max_tokens=32) == (32, 0)
    # before the pool's speed is measured: the longest ask, with every branch
    assert ask(0.3, None, 0.0, 8, 2) == (10, 2)
    assert ask(0.3, 0.01, 0.0, 1, 0, lookahead=0) == (1, 0)  # never below one token


def test_the_depth_cost_is_fitted_from_step_times_and_the_prior_stands_where_depth_never_varies():
    """step_s = 0.1 + 0.02 n + 0.05 (depth - 1) with noise: the fit finds 0.05 although the depth
    and the tokens in the pass move together; at one depth only, the prior is all there is."""
    import random

    rng = random.Random(0)
    samples = []
    for _ in range(200):
        depth = rng.randint(1, 4)
        n = 4 + rng.randint(0, 4 * (depth - 1)) + rng.randint(0, 2)
        samples.append((n, depth, (0.1 + 0.02 * n + 0.05 * (depth - 1)) * rng.uniform(0.95, 1.05)))
    assert fit_depth_s(samples, prior_s=0.2) == pytest.approx(0.05, rel=0.2)
    assert fit_depth_s(samples, prior_s=0.0) == pytest.approx(0.05, rel=0.2)
    flat = [(n, 4, 0.1 + 0.02 * n + 0.15) for n in range(4, 21)]
    assert fit_depth_s(flat, prior_s=0.03) == pytest.approx(0.03, rel=0.05)
    assert fit_depth_s([], prior_s=0.03) == 0.03


def test_the_drafters_depth_is_chosen_for_the_batch():
    """Four requests whose head drafts are accepted at 0.6 a token: where a forward of the drafter
    is a third of the pass (a 0.5B drafter of a 1.5B target on CPU) no forward past the first pays;
    where it is 2 % (an EAGLE-3 head on a GPU), the whole depth does; one request alone deep does
    not pay for the batch's forward; the depth stops where the drafts stop; a pass dearer by the
    token prices a depth's verified tokens as well as its forwards."""
    head = [tuple(0.6 ** (i + 1) for i in range(4))] * 4
    assert best_depth(head, base_tokens=4, pass_s=lambda n: 0.3, other_tokens=4, depth_s=0.1, max_depth=4) == 1
    assert best_depth(head, base_tokens=4, pass_s=lambda n: 0.03, other_tokens=4, depth_s=0.0006, max_depth=4) == 4
    one = [tuple(0.6 ** (i + 1) for i in range(4))] + [(0.6,)] * 3
    assert best_depth(one, base_tokens=4, pass_s=lambda n: 0.03, other_tokens=4, depth_s=0.006, max_depth=4) == 1
    assert best_depth([(0.9, 0.8)] * 4, base_tokens=4, pass_s=lambda n: 0.03, other_tokens=4, depth_s=0.0006,
                      max_depth=4) == 2
    # each depth is priced whole: the pass verifying what it drafted too (a pass 0.01 s a token
    # dearer: a second draft token for each of the four is 0.04 s more, for 1.44 tokens)
    assert best_depth(head, base_tokens=4, pass_s=lambda n: 0.03 + 0.01 * n, other_tokens=4, depth_s=0.0,
                      max_depth=4) == 1
    with pytest.raises(ValueError):
        best_depth(head, base_tokens=4, pass_s=lambda n: 0.0, other_tokens=4, depth_s=0.1, max_depth=4)
