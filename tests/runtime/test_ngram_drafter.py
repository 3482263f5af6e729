"""Model-free drafting: literal prompt-lookup cases and the suffix cache (losslessness through
vLLM: `test_vllm_lossless`)."""

from cosine.ngram_drafter import NgramDrafter, SuffixCache, ngram_propose


def test_prompt_lookup_literal():
    ctx = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    assert ngram_propose(ctx, 3) == ([4, 5, 9], 2)  # "2 3" seen before, followed by 4 5 9
    assert ngram_propose([1, 2, 3, 1, 2, 3, 7, 1, 2, 3], 2) == ([7, 1], 3)  # latest, longest match
    assert ngram_propose([1, 2, 3, 4], 3) == ([], 0)
    assert ngram_propose([5], 3) == ([], 0)


def test_suffix_cache_across_requests():
    cache = SuffixCache(n=2)
    d = NgramDrafter(cache=cache)
    d.propose("a", [10, 11, 12, 13, 14], 4)
    d.release("a")  # indexed on release
    draft = d.propose("b", [7, 8, 11, 12], 3)
    assert draft.token_ids == (13, 14) and draft.confidences == (0.5, 0.5)
