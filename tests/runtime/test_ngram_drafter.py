"""Model-free drafting: literal prompt-lookup cases, the suffix cache, and losslessness."""

from cosine.runtime.models import tiny_qwen2
from cosine.runtime.ngram_drafter import NgramDrafter, SuffixCache, ngram_propose
from cosine.runtime.speculation_control import SpeculationSettings
from cosine.runtime.speculative_decoding import generate
from cosine.runtime.speculative_sampling import SamplingParams


def test_prompt_lookup_literal():
    ctx = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    assert ngram_propose(ctx, 3) == ([4, 5, 9], 2)  # "2 3" seen before, followed by 4 5 9
    assert ngram_propose([1, 2, 3, 1, 2, 3, 7, 1, 2, 3], 2) == ([7, 1], 3)  # latest, longest match
    assert ngram_propose([1, 2, 3, 4], 3) == ([], 0)
    assert ngram_propose([5], 3) == ([], 0)


def test_suffix_cache_across_requests():
    cache = SuffixCache(n=2)
    d = NgramDrafter(cache=cache)
    d.propose("a", [10, 11, 12, 13, 14], 4, SamplingParams())
    d.release("a")  # indexed on release
    draft = d.propose("b", [7, 8, 11, 12], 3, SamplingParams())
    assert draft.token_ids == (13, 14)
    assert draft.probs is None  # point-mass proposals


def test_ngram_greedy_is_lossless_and_accepts_repetition():
    target = tiny_qwen2(seed=0)
    prompt = [5, 6, 7, 8] * 4
    want = generate(target, prompt, 40, stop_token_ids=frozenset()).token_ids
    res = generate(
        target, prompt, 40, drafter=NgramDrafter(), settings=SpeculationSettings(max_draft_tokens=6, adaptive=False),
        stop_token_ids=frozenset(),
    )
    assert res.token_ids == want
    assert res.stats.draft_tokens > 0


def test_ngram_sampling_runs_point_mass_path():
    target = tiny_qwen2(seed=0)
    res = generate(
        target, [5, 6, 7, 8] * 4, 30, SamplingParams(temperature=1.0, seed=1), drafter=NgramDrafter(),
        settings=SpeculationSettings(max_draft_tokens=4, adaptive=False), stop_token_ids=frozenset(),
    )
    assert len(res.token_ids) == 30
