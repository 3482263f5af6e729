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


class _AheadDrafter(ModelDrafter):
    """A model drafter with `propose_async` (as the coordinator's remote drafters have), to exercise
    post-verify drafting in-process."""

    def __init__(self, runner):
        from concurrent.futures import ThreadPoolExecutor

        super().__init__(runner)
        self._pool = ThreadPoolExecutor(1)

    def propose_async(self, *args, **kw):
        return self._pool.submit(self.propose, *args, **kw)


def test_drafting_ahead_keeps_the_target_distribution():
    """Marginal of the 5th token with post-verify drafting vs the exact target marginal (vocab 4).
    (The rejection rule makes any proposal lossless as long as q is the distribution each draft
    token was drawn from; `test_take_prefetch_alignment` checks that q stays aligned.)"""
    import itertools

    vocab, temp, prompt = 4, 1.5, [1, 2, 3]
    t = tiny_qwen2(vocab_size=vocab, seed=20)
    with torch.no_grad():
        def cond(prefix):
            return torch.softmax(t.forward(t.new_sequence(), prompt + list(prefix))[-1] / temp, -1)

        exact = torch.zeros(vocab)
        for prefix in itertools.product(range(vocab), repeat=4):
            pr = 1.0
            for i in range(4):
                pr *= float(cond(prefix[:i])[prefix[i]])
            exact += pr * cond(prefix)
    drafter = _AheadDrafter(tiny_qwen2(vocab_size=vocab, seed=20))  # q = p: many steps draft ahead
    settings = SpeculationSettings(max_draft_tokens=2, adaptive=False)
    counts, hits, n = torch.zeros(vocab), 0, 800
    for i in range(n):
        res = generate(t, prompt, 6, SamplingParams(temperature=temp, seed=i), drafter=drafter, settings=settings,
                       stop_token_ids=NO_STOP)
        counts[res.token_ids[4]] += 1
        hits += res.stats.prefetch_hits
    assert hits > n // 8, "the drafting-ahead path was exercised"
    pvalue = chisquare(counts.numpy(), (exact * n).numpy()).pvalue
    assert pvalue > 1e-3, f"p-value {pvalue:.2e}: {counts / n} vs {exact}"


def test_take_prefetch_alignment():
    """A prefetched draft for context C + D is used for C + D + b only if its first token is b, and
    then its tokens and q rows 1.. are used (row i is the distribution token i was drawn from)."""
    from concurrent.futures import Future

    from cosine.runtime.drafter import Draft
    from cosine.runtime.speculative_decoding import _Prefetch, _take_prefetch

    probs = torch.arange(12, dtype=torch.float32).reshape(4, 3)  # row i marks position i
    fut: Future = Future()
    fut.set_result(Draft((7, 8, 9, 5), probs, (0.9, 0.8, 0.7, 0.6), "d", 0.1))
    pre = _Prefetch((1, 2, 3), fut)
    got = _take_prefetch(pre, [1, 2, 3, 7], max_tokens=8)
    assert got is not None and got.token_ids == (8, 9, 5) and torch.equal(got.probs, probs[1:])
    assert _take_prefetch(pre, [1, 2, 3, 6], max_tokens=8) is None  # bonus token guessed wrong
    assert _take_prefetch(pre, [1, 2, 4, 7], max_tokens=8) is None  # a draft token was rejected
    assert _take_prefetch(pre, [1, 2, 3, 7], max_tokens=1).token_ids == (8,)
    failed: Future = Future()
    failed.set_exception(RuntimeError("drafter died"))
    assert _take_prefetch(_Prefetch((1,), failed), [1, 7], max_tokens=4) is None


def test_measure_pass_curve_on_a_model():
    from cosine.runtime.models import tiny_qwen2
    from cosine.runtime.speculative_decoding import measure_pass_curve

    runner = tiny_qwen2(seed=0)
    curve = measure_pass_curve(runner, (1, 4, 16), context_tokens=8, repeats=1)
    assert [n for n, _ in curve.points] == [1, 4, 16]
    assert 0 < curve.points[0][1] <= curve.points[1][1] <= curve.points[2][1]  # made non-decreasing
    with pytest.raises(ValueError, match="start at 1"):
        measure_pass_curve(runner, (2, 4), context_tokens=8, repeats=1)


def test_an_untried_pool_catches_up_on_a_long_prompt_and_gets_measured(target):
    """Regression: weighed at the router's pessimistic prior (0.43), the pool's catch-up on a
    300-token prompt never paid, so it never drafted and never produced the evidence that would
    have shown it pays (here it is the target itself). Weighed at the router's optimistic bound,
    its first probe catches up; then it drafts, and the router learns."""
    from cosine.runtime.collaborative import CollaborativeDrafters

    pools = CollaborativeDrafters([ModelDrafter(tiny_qwen2(seed=0), "pool")], parallel=False)
    pools.assign("r", "math")  # no expertise declared: the non-expert prior
    settings = SpeculationSettings(max_draft_tokens=4)
    cost = CostModel(draft_token_s=0.13, verify_base_s=0.37, verify_token_s=0.04, catch_up_token_s=0.0075)
    prior = pools.expected_acceptance("pool", "math")
    from cosine.runtime.speculation_control import best_draft_len, catch_up_pays, initial_state

    assert best_draft_len(prior, cost, 4) == 0 and not catch_up_pays(prior, cost, 300, 40, settings)
    prompt = [(7 * i) % 61 + 3 for i in range(300)]
    want = generate(target, prompt, 48, stop_token_ids=NO_STOP).token_ids
    got = generate(target, prompt, 48, drafter=pools, settings=settings, cost=cost, stop_token_ids=NO_STOP,
                   initial=initial_state(settings, prior), request_id="r")
    assert got.token_ids == want
    assert got.stats.draft_tokens > settings.probe_draft_tokens  # probed, then drafted on
    assert got.stats.acceptance_rate == 1.0
