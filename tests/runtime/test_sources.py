"""Draft sources as peers in the proposer (`runtime/src/cosine/sources/`): the engine's own
drafter (`sources.engine`), prompt lookup (`sources.lookup`), chosen among by the proposer without
naming them. Plain token lists; the target is a fixed token sequence checked greedily."""

from __future__ import annotations

import random

import pytest
from cosine_spec.cluster_spec import SpeculationSpec

from cosine.proposer import CoSineProposer, ProposerSettings, RequestOutcome, StepRecord
from cosine.sources import Candidate, Where
from cosine.sources.engine import EngineSource


def _settings(k: int = 4, lookup: bool = False) -> ProposerSettings:
    return ProposerSettings(speculation=SpeculationSpec(max_draft_len=k), lookup=lookup)


class ScriptedSource:
    """A local source drafting by a rule over (request, context, k): what a lookup that is
    confidently wrong, or right, looks like to the proposer."""

    where = Where.PROCESS

    def __init__(self, name: str, rule, confidence: float) -> None:
        self.name, self.rule, self.confidence = name, rule, confidence

    def start(self, request_id, prompt) -> None:
        pass

    def candidate(self, request_id, context, max_tokens, acceptance_rate):
        tokens = tuple(self.rule(list(context), max_tokens))
        return Candidate(tokens, (self.confidence,) * len(tokens)) if tokens else None

    def release(self, request_id) -> None:
        pass


def test_engine_draft_is_offered_per_request_and_zeros_are_no_draft():
    engine = EngineSource("draftModel")
    p = CoSineProposer(_settings(4), sources=[engine])
    engine.offer({"a": [7, 8, 9, 10], "b": [0, 0, 0, 0]})
    drafts = p.propose({"a": [1, 2, 3], "b": [4, 5, 6]})
    assert drafts["b"] == []  # vLLM's answer when the input does not fit the drafter
    assert drafts["a"] == [7, 8, 9, 10][: len(drafts["a"])] and drafts["a"]
    assert p.source_of("a") == "draftModel" and p.source_of("b") == ""


def test_source_names_must_be_distinct():


    with pytest.raises(ValueError, match="distinct"):
        CoSineProposer(_settings(), sources=[EngineSource("x"), EngineSource("x")])


def _run(sources_for, target: list[int], prompt_len: int, k: int, seed: int) -> float:
    """Decode `target` greedily from its first `prompt_len` tokens with a proposer over the sources
    `sources_for(rng, engine)` builds; the engine source is offered a draft each step that is right
    for a geometric(0.7) run of tokens. Returns tokens emitted per verification step."""
    rng = random.Random(seed)
    engine = EngineSource("eagle3")
    p = CoSineProposer(_settings(k), sources=sources_for(engine))
    ctx = list(target[:prompt_len])
    steps = 0
    while len(ctx) < len(target) - k - 1:
        n = len(ctx)
        right = 0
        while right < k and rng.random() < 0.7:
            right += 1
        offered = target[n:n + right] + [t + 1000 for t in target[n + right:n + k]]
        engine.offer({"r": offered})
        draft = p.propose({"r": ctx}, {"r": prompt_len})["r"]
        accepted = next((i for i, t in enumerate(draft) if t != target[n + i]), len(draft))
        p.observe_step(StepRecord(0.1, 1 + len(draft), (RequestOutcome("r", len(draft), accepted,
                                                                       p.source_of("r")),)))
        ctx = target[: n + accepted + 1]
        steps += 1
    return (len(ctx) - prompt_len) / steps


TARGET = [random.Random(1).randrange(50, 900) for _ in range(400)]


def test_never_behind_the_engine_drafter_beside_a_confidently_wrong_source():
    """A lookup that drafts confidently (0.95) but wrongly every step must not cost the head's
    acceptance: its estimate falls as its unverified drafts are scored against the target."""
    def wrong(ctx, k):
        return [t + 2000 for t in ctx[-k:]]

    alone = [_run(lambda e: [e], TARGET, 20, 4, seed) for seed in range(3)]
    both = [_run(lambda e: [e, ScriptedSource("lookup", wrong, 0.95)], TARGET, 20, 4, seed) for seed in range(3)]
    assert sum(both) >= 0.95 * sum(alone), (both, alone)


def test_a_source_that_knows_the_continuation_adds_to_the_engine_drafter():
    """Where lookup has the target's continuation (a copied span), the composite beats the head alone."""
    def right(ctx, k):
        n = len(ctx)
        return TARGET[n:n + k] if n % 3 else []  # matches on two steps in three

    alone = [_run(lambda e: [e], TARGET, 20, 4, seed) for seed in range(3)]
    both = [_run(lambda e: [e, ScriptedSource("lookup", right, 0.9)], TARGET, 20, 4, seed) for seed in range(3)]
    assert sum(both) > 1.15 * sum(alone), (both, alone)


def test_a_pool_is_not_asked_where_the_engine_drafter_already_gives_more():
    """The pool must beat the best local source, the engine drafter included (its hit rate 1)."""
    from tests.runtime.test_proposer import FakePool

    engine = EngineSource("eagle3")
    pool = FakePool("coder", rule=lambda ctx, k: [9999] * k, confidence=0.5)
    p = CoSineProposer(_settings(4), [pool], sources=[engine])
    ctx = list(range(10))
    for _ in range(40):
        engine.offer({"r": [ctx[-1] + 1 + i for i in range(4)]})
        draft = p.propose({"r": ctx})["r"]
        accepted = next((i for i, t in enumerate(draft) if t != ctx[-1] + 1 + i), len(draft))
        p.observe_step(StepRecord(0.1, 1 + len(draft), (RequestOutcome("r", len(draft), accepted,
                                                                       p.source_of("r")),)))
        ctx = ctx + [ctx[-1] + 1 + i for i in range(accepted + 1)]
    skipped = sum(v for (name, reason), v in p.stats.pool_skipped.items() if name == "coder" and reason == "yield")
    assert skipped >= 30  # asked on probe steps only
    p.close()


def test_fit_problems_name_what_cannot_run_on_the_target():
    from cosine.sources.engine import fit_problems

    qwen = {"hidden_size": 1536, "vocab_size": 151936}
    assert fit_problems("mtp", qwen, None) == [
        "spec.verifier.speculator.method: mtp needs a target with multi-token-prediction layers "
        "(none of num_nextn_predict_layers, mtp_num_hidden_layers, num_mtp_modules in its config)"]
    assert fit_problems("mtp", {**qwen, "num_nextn_predict_layers": 1}, None) == []
    assert fit_problems("mtp", {"text_config": {"mtp_num_hidden_layers": 1}}, None) == []
    head = {"hidden_size": 1024, "target_hidden_size": 1536, "vocab_size": 151936}
    assert fit_problems("eagle3", qwen, head) == []
    wrong = fit_problems("eagle3", qwen, {**head, "target_hidden_size": 4096, "vocab_size": 128256})
    assert len(wrong) == 2 and "hidden size 4096" in wrong[0] and "128256" in wrong[1]
    assert fit_problems("draftModel", qwen, {"hidden_size": 896, "vocab_size": 151936}) == []
    assert "vocabulary" in fit_problems("draftModel", qwen, {"vocab_size": 49152})[0]


def test_the_engine_drafters_paid_draft_is_not_cut_by_the_path_floor():
    """The engine drafts every step whatever wins (vLLM's eagle3 verifies every token it drafted):
    on a pass that prices extra tokens at nothing, its whole draft is verified even where its
    path probabilities fall under `min_path_prob`; a lookup draft of the same confidences is cut."""
    engine = EngineSource("eagle3")
    p = CoSineProposer(_settings(4), sources=[engine])
    p.observe_step(StepRecord(0.1, 1))  # a flat pass curve: a draft token adds nothing to the pass
    low = p._initial_state("eagle3", "chat")
    from dataclasses import replace as dc_replace

    ctx = list(range(20))
    p.propose({"r": ctx})  # the request exists; now make its estimate for the head low
    req = p._requests["r"]
    req.states["eagle3"] = dc_replace(low, accepted_ema=0.3, trials_ema=1.0)
    engine.offer({"r": [20, 21, 22, 23]})
    assert p.propose({"r": ctx}) == {"r": [20, 21, 22, 23]}
    lookup = ScriptedSource("lookup", lambda c, k: [20, 21, 22, 23][:k], 0.3)
    q = CoSineProposer(_settings(4), sources=[lookup])
    q.observe_step(StepRecord(0.1, 1))
    assert 0 < len(q.propose({"r": ctx})["r"]) < 4


def test_the_engine_drafter_drafts_no_deeper_than_the_proposer_verifies():
    """`engine_draft_len` (vLLM's `num_spec_tokens_to_schedule`): the full k before any engine draft
    was verified; down to 1 (the drafter's first forward runs at any depth) when the head's drafts
    are rejected; back up, a token a step, once they are accepted (one pass curve throughout)."""
    engine = EngineSource("eagle3")
    p = CoSineProposer(_settings(4), sources=[engine])
    assert p.engine_draft_len() == 4
    ctx = list(range(20))

    def step(right: bool) -> list[int]:
        depth = p.engine_draft_len()
        offered = [ctx[-1] + 1 + i if right else 5000 + i for i in range(depth)]
        engine.offer({"r": offered})
        draft = p.propose({"r": ctx})["r"]
        assert len(draft) <= depth
        accepted = next((i for i, t in enumerate(draft) if t != ctx[-1] + 1 + i), len(draft))
        p.observe_step(StepRecord(0.1 + 0.01 * len(draft), 1 + len(draft),
                                  (RequestOutcome("r", len(draft), accepted, p.source_of("r")),)))
        ctx.extend(ctx[-1] + 1 + i for i in range(accepted + 1))
        return draft

    depths = []
    for _ in range(30):  # rejected: k and the depth fall
        step(False)
        depths.append(p.engine_draft_len())
    assert min(depths) == 1 and depths[-1] <= 2, depths
    depths = []
    for _ in range(60):  # accepted: back to the full depth, never past it
        step(True)
        depths.append(p.engine_draft_len())
    assert depths[-1] == 4 and max(depths) == 4, depths
    assert all(b - a <= 1 for a, b in zip(depths, depths[1:], strict=False)), depths


def test_a_short_confident_candidate_does_not_cut_off_a_longer_one_worth_more():
    """Where candidates part at the first token, the chosen draft is the one with the most expected
    accepted tokens: the head's four tokens at 0.4 each (0.4 + 0.16 + ...) over lookup's one token
    at 0.5, though lookup's first token scores higher; and lookup's when its draft is worth more."""
    from cosine.fusion import DraftPath

    p = CoSineProposer(_settings(4), sources=[])
    head = DraftPath("eagle3", (1, 2, 3, 4), (0.4,) * 4)
    short = DraftPath("lookup", (9,), (0.5,))
    weights = {"eagle3": 0.4, "lookup": 0.5}
    assert p.chooser.fuse([head, short], weights)[:2] == ((1, 2, 3, 4), "eagle3")
    copy = DraftPath("lookup", (9, 8, 7, 6), (0.5, 1.0, 1.0, 1.0))
    assert p.chooser.fuse([head, copy], weights)[:2] == ((9, 8, 7, 6), "lookup")
    agree = DraftPath("lookup", (1, 2, 3, 4), (0.9,) * 4)  # agreeing candidates: the fused chain
    assert p.chooser.fuse([head, agree], weights)[0] == (1, 2, 3, 4)


def test_where_every_verified_token_costs_the_choice_is_by_goodput_not_expected_tokens():
    """On a pass whose every token costs half a one-token pass (compute-bound, as at 64 requests),
    the head's two confident tokens (path 0.9, 0.81: 1.36 tokens a pass's time at k = 2) are worth
    more than lookup's eight at 0.75 a token, though those are expected to be accepted for more
    (2.7 against 1.71 tokens: at their best k, 1.17 a pass's time); on a flat pass, lookup's.
    Catches: candidates compared by expected accepted tokens alone, with no price on the tokens
    verified (SmartSpec, arXiv:2406.14066: goodput)."""
    from cosine import speculation_control as sc
    from cosine.fusion import DraftPath

    p = CoSineProposer(_settings(8), sources=[])
    head = DraftPath("eagle3", (1, 2), (0.9, 0.9))
    copy = DraftPath("lookup", tuple(range(10, 18)), (0.75,) * 8)
    weights = {"eagle3": 0.9, "lookup": 0.75}
    steep = sc.BatchedCost(0.0, sc.PassCurve(((1, 1.0), (2, 1.5))))
    flat = sc.BatchedCost(0.0, sc.PassCurve(((1, 1.0),)))
    assert p.chooser.fuse([head, copy], weights, steep)[1] == "eagle3"
    assert p.chooser.fuse([copy, head], weights, steep)[1] == "eagle3"
    assert p.chooser.fuse([head, copy], weights, flat)[1] == "lookup"
    assert p.chooser.fuse([head, copy], weights)[1] == "lookup"


def test_the_engine_drafter_drafts_one_token_where_another_sources_draft_wins():
    """Where lookup's draft is the one verified (a copied span), the head's deeper forwards would
    be paid for nothing: the depth falls to its first, free token; it grows back once the head's
    draft wins again."""
    engine = EngineSource("eagle3")
    copy = ScriptedSource("lookup", lambda c, k: [c[-1] + 1 + i for i in range(k)], 1.0)
    p = CoSineProposer(_settings(4), sources=[engine, copy])
    ctx = list(range(20))
    engine.offer({"r": [ctx[-1] + 1, 7000, 7001, 7002]})  # the head is right on one token only
    assert p.propose({"r": ctx})["r"] == [20, 21, 22, 23] and p.source_of("r") == "lookup"
    assert p.engine_draft_len() == 1


def test_the_engine_drafter_is_not_paid_for_a_chain_lookup_also_drafted():
    """The head and lookup draft the same four tokens (code being copied): the head's draft wins
    the tie, but lookup had it too, so the head's deeper forwards buy nothing next step."""
    engine = EngineSource("eagle3")
    copy = ScriptedSource("lookup", lambda c, k: [c[-1] + 1 + i for i in range(k)], 1.0)
    p = CoSineProposer(_settings(4), sources=[engine, copy])
    ctx = list(range(20))
    engine.offer({"r": [20, 21, 22, 23]})
    assert p.propose({"r": ctx})["r"] == [20, 21, 22, 23]
    assert p.engine_draft_len() == 1


def test_mrv2_a_lookup_draft_the_step_in_flight_uses_up_does_not_spare_the_drafters_forwards():
    """The MRV2 seam verifies a step later, from candidates anchored at the context it planned
    on: a lookup draft that wins now is checked on the device after the step in flight emitted
    its tokens. A 12-token copy is all but used up by then (a 9-token step in flight), so the
    device verifies the draft model's draft, which must be drafted deep: cutting it to one forward
    because lookup "covered" it made every third step on code emit 2 tokens (MRV2 priced on an L4,
    `tools/mrv2_acceptance.py`). A 30-token copy outlasts the step: one forward will do. Through
    V1 (verified next step) the copy covers either way."""
    span = {"n": 12}
    engine = EngineSource("draftModel")
    copy = ScriptedSource("lookup", lambda c, k: [c[-1] + 1 + i for i in range(min(k, span["n"]))], 1.0)
    p = CoSineProposer(_settings(8), sources=[engine, copy])
    ctx = list(range(20))

    def plan(anchor_tokens: int = 26) -> list[int]:
        engine.on_device(["r"], 8)  # the draft model drafts on the device: placeholders here
        return p.propose({"r": ctx}, anchor_tokens=anchor_tokens)["r"]

    plan()
    for _ in range(6):  # both sources' drafts accepted whole: their rates are high
        for source in ("draftModel", "lookup"):
            p.observe_step(StepRecord(0.05, 9, (RequestOutcome("r", 8, 8, source),)))
            plan()
    assert plan() == [20 + i for i in range(8)]  # lookup's copy wins the choice here...
    assert p.engine_draft_len() > 4  # ...but the step in flight uses it up: the drafter drafts deep
    span["n"] = 30
    plan()
    assert p.engine_draft_len() == 1
    span["n"] = 12
    plan(anchor_tokens=0)
    assert p.engine_draft_len() == 1


def _cpu_pass(n: int) -> float:
    return 0.1 + 0.02 * n


def _closed_loop(depth_s: float, alpha: float, fixed: bool, steps: int = 300, requests: int = 4,
                 pass_s=_cpu_pass, ratio: float = 0.35, fixed_depth: int = 4, max_draft_len: int = 4,
                 proposer: list | None = None) -> tuple[float, float]:
    """`requests` requests decode under an engine drafter whose draft is right for a
    geometric(alpha) run of tokens, each step taking `pass_s(tokens in the pass)` + `depth_s` per
    forward of the drafter past its first: vLLM's own drafter (`fixed`: `fixed_depth` deep, all of
    it verified) or the proposer choosing k and the depth, assuming a forward of the drafter
    `ratio` of the target's (its weights' bytes) until measured. Returns (tokens per second, the
    fitted depth cost); the proposer is appended to `proposer` where given."""
    rng = random.Random(0)
    engine = EngineSource("draftModel")
    settings = ProposerSettings(speculation=SpeculationSpec(max_draft_len=max_draft_len), lookup=False,
                                engine_depth_ratio=ratio)
    p = CoSineProposer(settings, sources=[engine])
    if proposer is not None:
        proposer.append(p)
    contexts = {f"r{i}": list(range(1000 * i, 1000 * i + 20)) for i in range(requests)}
    emitted, total_s = 0, 0.0
    for _ in range(steps):
        depth = fixed_depth if fixed else p.engine_draft_len()
        offers = {}
        for rid, ctx in contexts.items():
            good = 0
            while good < depth and rng.random() < alpha:
                good += 1
            offers[rid] = [ctx[-1] + 1 + i if i < good else 99999 for i in range(depth)]
        engine.offer(offers)
        drafts = offers if fixed else p.propose(contexts)
        outcomes, n = [], 0
        for rid, ctx in contexts.items():
            d = drafts[rid]
            accepted = next((i for i, t in enumerate(d) if t != ctx[-1] + 1 + i), len(d))
            outcomes.append(RequestOutcome(rid, len(d), accepted, p.source_of(rid)))
            ctx.extend(ctx[-1] + 1 + i for i in range(accepted + 1))
            n += 1 + len(d)
            emitted += accepted + 1
        step_s = pass_s(n) + (depth - 1) * depth_s
        total_s += step_s
        if not fixed:
            p.observe_step(StepRecord(step_s, n, tuple(outcomes), engine_depth=depth, num_requests=requests))
    return emitted / total_s, p.chooser.depth_s()


def test_the_drafters_deeper_forwards_are_measured_and_paid_for_only_where_they_pay():
    """Where the drafter's forwards cost a step more than its drafts save (batch of 4, acceptance
    0.5), the proposer prices a deeper forward (from the weights' bytes until step times that vary
    in depth measure it: `fit_depth_s`) and drafts shallower (`best_depth`): well ahead of the
    drafter alone at full depth, level with its best fixed depth. Where they cost nothing and the
    head is good, it is not behind the drafter alone."""
    costly, fitted = _closed_loop(0.05, 0.5, fixed=False)
    assert costly > 1.3 * _closed_loop(0.05, 0.5, fixed=True)[0]
    assert costly >= 0.98 * max(_closed_loop(0.05, 0.5, fixed=True, fixed_depth=d)[0] for d in range(1, 5))
    # it drafts one forward deep throughout: the depth never varies, and the prior (a forward at
    # a third of the pass, from the weights' bytes) stands unmeasured
    assert fitted == pytest.approx(0.35 / 1.35 * 0.26, rel=0.05)
    assert _closed_loop(0.0, 0.8, fixed=False)[0] >= 0.98 * _closed_loop(0.0, 0.8, fixed=True)[0]


def test_a_paid_drafts_forwards_are_priced_once_where_tokens_and_depth_rise_together():
    """One request on a GPU's pass, flat in its tokens (an L4's 16.7 ms for a 1.5B target in bf16,
    the 0.5B draft model's forward 7.4 ms: `tools/mrv2_acceptance.py --gpu l4`), k up to 8, its
    drafts right for a geometric run: k and the drafter's depth rise together, so no step tells
    the pass's slope from a forward's price. A pass curve taught whole steps read the forwards as
    the price of verifying tokens and `best_depth` charged them again: 0.80-0.89x the best fixed
    depth on the old code. Now the curve learns the step less the fitted forwards and each depth
    is priced whole (forwards and the pass verifying them): within 8% of the best fixed depth
    (what is left is the acceptance estimate's noise: the depth follows it)."""
    flat = lambda n: 0.0167 + 0.0074  # noqa: E731  (the pass and the drafter's first forward)
    for alpha in (0.75, 0.85, 0.9):
        best_fixed = max(_closed_loop(0.0074, alpha, fixed=True, requests=1, pass_s=flat, fixed_depth=d,
                                      steps=400)[0] for d in range(1, 9))
        adaptive, _ = _closed_loop(0.0074, alpha, fixed=False, requests=1, pass_s=flat, ratio=0.32,
                                   max_draft_len=8, steps=400)
        assert adaptive >= 0.92 * best_fixed, alpha


def test_mrv2_rows_of_minus_one_are_no_draft():
    """MRV2 answers `take_draft_token_ids` with rows of -1 when async scheduling is off (its drafts
    stay on the device): kept as a draft they were credited to the engine's source and calibrated."""
    from cosine.sources.engine import ON_DEVICE, EngineSource
    from cosine.vllm_hooks import engine_rows

    src = EngineSource("eagle3")
    src.offer(engine_rows(["a", "b", "c"], [[-1, -1, -1], [0, 0], [7, 0, 9]]))
    assert src.candidate("a", [1, 2], 4, 0.5) is None
    assert src.candidate("b", [1, 2], 4, 0.5) is None
    assert src.candidate("c", [1, 2], 4, 0.5).token_ids == (7, 0, 9)
    src.on_device(["a"], 3)  # the MRV2 seam: drafted on the device, weighed by its rate
    assert src.candidate("a", [1, 2], 4, 0.5).token_ids == (ON_DEVICE,) * 3


def test_with_adaptive_off_the_engine_drafter_always_drafts_max_draft_len():
    """`speculation.adaptive: false` is "always maxDraftLen": the engine drafter's depth too, where
    the adaptive proposer cuts it to the first token (lookup's copied span wins, as above)."""
    from dataclasses import replace

    engine = EngineSource("eagle3")
    copy = ScriptedSource("lookup", lambda c, k: [c[-1] + 1 + i for i in range(k)], 1.0)
    settings = _settings(4)
    settings = replace(settings, speculation=replace(settings.speculation, adaptive=False))
    p = CoSineProposer(settings, sources=[engine, copy])
    ctx = list(range(20))
    engine.offer({"r": [ctx[-1] + 1, 7000, 7001, 7002]})
    assert p.propose({"r": ctx})["r"] == [20, 21, 22, 23]
    assert p.engine_draft_len() == 4
