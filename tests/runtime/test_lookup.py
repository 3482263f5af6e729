"""Model-free drafting on Arctic Inference's suffix trees: prompt lookup, cross-request reuse and
path probabilities as confidences (losslessness through vLLM: `test_vllm_lossless`)."""

import pytest

from cosine.lookup import LookupDrafter, SuffixLookup, SuffixSettings


def test_prompt_lookup_drafts_the_likeliest_continuation_with_its_path_probability():
    lookup = SuffixLookup()
    # "1 2" occurs 4 times: followed by 3 twice, by 4 once, and by nothing (the context's end)
    prompt = [5, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2]
    lookup.start("a", prompt)
    tokens, probs = lookup.propose("a", prompt, 4)
    assert tokens == [3, 9] and probs == pytest.approx([2 / 4, 1 / 4])  # "1 2 3" then 9 once of twice
    assert lookup.propose("a", prompt, 1) == ([3], [pytest.approx(0.5)])  # at most max_tokens


def test_outputs_serve_other_requests_after_release_but_prompts_do_not():
    lookup = SuffixLookup()
    lookup.start("a", [40, 41, 42, 43])
    lookup.propose("a", [40, 41, 42, 43, 1, 2, 3, 4, 5, 6], 4)  # output 1..6 indexed
    lookup.release("a")
    assert len(lookup) == 0
    lookup.start("b", [7, 8])
    assert lookup.propose("b", [7, 8, 3, 4], 2)[0] == [5, 6]  # from a's output
    lookup.start("c", [9, 9])
    assert lookup.propose("c", [9, 9, 41, 42], 2) == ([], [])  # a's prompt was its own only


def test_a_shorter_context_restarts_the_request_and_an_id_can_be_reused():
    lookup = SuffixLookup()
    lookup.start("a", [1, 2, 3, 1, 2])
    assert lookup.propose("a", [1, 2, 3, 1, 2], 2)[0] == [3, 1]
    lookup.propose("a", [1, 2], 2)  # preempted and recomputed from its prompt: restarted, no error
    lookup.release("a")
    lookup.start("a", [1, 2])  # a finished id reused
    assert len(lookup) == 1


def test_settings_bound_the_draft():
    lookup = SuffixLookup(SuffixSettings(max_spec_factor=0.5))
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]
    lookup.start("a", ctx)
    assert len(lookup.propose("a", ctx, 8)[0]) == 2  # matched 4 tokens, half of that drafted
    with pytest.raises(ValueError):
        SuffixSettings(min_token_prob=1.5)
    with pytest.raises(ValueError):
        SuffixSettings(max_tree_depth=0)


def test_lookup_drafter_cuts_below_min_confidence():
    d = LookupDrafter()
    ctx = [5, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2]
    draft = d.propose("a", ctx, 4)
    assert draft.token_ids == (3, 9) and draft.drafter == "ngram"
    assert d.propose("a", ctx, 4, min_confidence=0.3).token_ids == (3,)
    d.release("a")
    assert len(d.lookup) == 0


def test_what_the_trees_hold_and_how_often_they_draft_is_counted():
    """The suffix-affinity signal (cosine_suffix_tree_*): a verifier that has seen an output drafts
    it for a repeat and its hit rate rises; one that has not stays at 0. Catches: a hit rate that
    counts asks without a draft as hits, tokens that forget outputs kept for other requests."""
    from cosine.metrics import SuffixAffinity

    seen, fresh = SuffixLookup(), SuffixLookup()
    answer = list(range(100, 140))
    for lookup in (seen,):
        lookup.start("turn-1", [1, 2, 3])
        lookup.propose("turn-1", [1, 2, 3, *answer], 4)
        lookup.release("turn-1")
    assert seen.held() == (1, len(answer))  # the output stays, the prompt's tree goes
    for lookup in (seen, fresh):
        for i in range(10, 30):  # turn 2 repeats turn 1's answer (a quoted reply, an edited file)
            lookup.propose("turn-2", [7, 8, *answer[:i]], 4)
    assert (seen.hits, seen.lookups, fresh.hits) == (20, 21, 0)  # turn 1 found nothing yet
    assert seen.hit_rate > 0.3 and fresh.hit_rate == 0.0
    gauges = SuffixAffinity(seen, "m", period_s=10.0)
    gauges.update(0.0)
    families = {f.name: f.samples[0].value for f in gauges.families()}
    assert families["cosine_suffix_tree_hit_rate"] == seen.hit_rate
    assert families["cosine_suffix_tree_requests"] == 1
    assert families["cosine_suffix_tree_tokens"] == len(answer) + 2 + 29  # turn 2's prompt and output so far
    seen.propose("turn-2", [7, 8, *answer], 4)
    gauges.update(5.0)  # within the period: not read again
    assert next(iter(gauges.families())).samples[0].value == families["cosine_suffix_tree_hit_rate"]
