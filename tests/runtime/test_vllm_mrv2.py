"""The MRV2 seam's pure parts (`vllm_mrv2.choose`, the plan, the scheduler's placeholders), with
plain tensors: the real runner is exercised by `test_vllm_mrv2_lossless.py`."""

from __future__ import annotations

import pickle

import torch

from cosine.vllm_mrv2 import PLAN_ATTR, RowPlan, StepPlan, choose

INNER = "draftModel"


def _history(rows: list[list[int]], width: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros((len(rows) + 1, width), dtype=torch.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return tokens, torch.tensor([len(r) for r in rows] + [0], dtype=torch.int32)


def test_a_fresh_candidate_with_more_expected_tokens_replaces_the_inner_draft() -> None:
    # anchored at 3 tokens; the device has 5 since (the step in flight emitted 7, 8): the candidate
    # begins 7, 8, so its rest 9, 10, 11, 12 is drafted
    tokens, total = _history([[1, 2, 3, 7, 8]])
    plan = StepPlan(INNER, {"a": RowPlan(0.3, 3, (7, 8, 9, 10, 11, 12), (0.9, 0.9, 0.9, 0.9, 0.9, 0.9), "lookup")})
    inner = torch.tensor([[50, 51, 52, 53]])
    drafts, chosen = choose(inner, tokens, total, torch.tensor([0]), plan, ["a"])
    assert drafts.tolist() == [[9, 10, 11, 12]]
    assert chosen.tolist() == [True]


def test_a_stale_candidate_falls_back_to_the_inner_draft() -> None:
    # the step in flight emitted 7, 6: the candidate guessed 7, 8, so it no longer continues the tokens there
    tokens, total = _history([[1, 2, 3, 7, 6]])
    plan = StepPlan(INNER, {"a": RowPlan(0.3, 3, (7, 8, 9, 10, 11, 12), (0.9,) * 6, "lookup")})
    inner = torch.tensor([[50, 51, 52, 53]])
    drafts, chosen = choose(inner, tokens, total, torch.tensor([0]), plan, ["a"])
    assert drafts.tolist() == [[50, 51, 52, 53]]
    assert chosen.tolist() == [False]


def test_a_candidate_used_up_by_the_tokens_emitted_is_no_draft() -> None:
    tokens, total = _history([[1, 2, 3, 7, 8]])
    plan = StepPlan(INNER, {"a": RowPlan(0.0, 3, (7, 8), (0.9, 0.9), "lookup")})
    drafts, chosen = choose(torch.tensor([[50, 51]]), tokens, total, torch.tensor([0]), plan, ["a"])
    assert chosen.tolist() == [False] and drafts.tolist() == [[50, 51]]


def test_the_inner_draft_wins_where_it_is_worth_more() -> None:
    # the candidate's rest: 2 tokens at path 0.5, 0.25 (0.75 expected) against the head's 4 at 0.8 (2.36)
    tokens, total = _history([[1, 2, 3]])
    plan = StepPlan(INNER, {"a": RowPlan(0.8, 3, (9, 10), (0.5, 0.25), "lookup")})
    drafts, chosen = choose(torch.tensor([[50, 51, 52, 53]]), tokens, total, torch.tensor([0]), plan, ["a"])
    assert chosen.tolist() == [False] and drafts.tolist() == [[50, 51, 52, 53]]
    # the path past the emitted tokens is conditional on them: (0.5, 0.45, 0.4) after a 0.5 first token
    # is worth 0.9 + 0.8 = 1.7 expected tokens, more than a head at 0.5 (0.94)
    tokens, total = _history([[1, 2, 3, 9]])
    plan = StepPlan(INNER, {"a": RowPlan(0.5, 3, (9, 10, 11), (0.5, 0.45, 0.4), "lookup")})
    drafts, chosen = choose(torch.tensor([[50, 51]]), tokens, total, torch.tensor([0]), plan, ["a"])
    assert chosen.tolist() == [True] and drafts.tolist() == [[10, 11]]


def test_rows_follow_the_batch_through_idx_mapping_and_unplanned_rows_keep_the_inner_draft() -> None:
    tokens, total = _history([[5, 5, 5], [1, 2, 3]])  # state rows: request b at 0, request a at 1
    plan = StepPlan(INNER, {"a": RowPlan(0.0, 3, (4, 5), (0.9, 0.8), "lookup")})
    inner = torch.tensor([[60, 61], [70, 71], [80, 81]])
    drafts, chosen = choose(inner, tokens, total, torch.tensor([1, 0, 2]), plan, ["a", "b", "c"])
    assert drafts.tolist() == [[4, 5], [70, 71], [80, 81]]
    assert chosen.tolist() == [True, False, False]


def test_two_ranks_given_the_same_scheduler_output_choose_the_same_drafts() -> None:
    # tensor-parallel ranks: each unpickles the scheduler output (vLLM's message queue pickles it) and
    # holds the same token history; the choice is a function of those alone
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    setattr(
        out,
        PLAN_ATTR,
        StepPlan(
            INNER,
            {"a": RowPlan(0.2, 2, (3, 4, 5), (0.9, 0.8, 0.7), "lookup"), "b": RowPlan(0.9, 2, (9,), (0.1,), "pool")},
        ),
    )
    tokens, total = _history([[1, 2, 3], [1, 2, 8]])
    inner = torch.tensor([[11, 12, 13], [21, 22, 23]])
    results = []
    for _ in range(2):
        plan = getattr(pickle.loads(pickle.dumps(out)), PLAN_ATTR)
        drafts, chosen = choose(inner.clone(), tokens.clone(), total.clone(), torch.tensor([0, 1]), plan, ["a", "b"])
        results.append((drafts.tolist(), chosen.tolist()))
    assert results[0] == results[1] == ([[4, 5, 13], [21, 22, 23]], [True, False])


def test_the_composer_wraps_the_speculator_and_reports_each_rows_source_with_the_next_step() -> None:
    from types import SimpleNamespace

    from vllm.v1.core.sched.output import SchedulerOutput

    from cosine.vllm_mrv2 import Composer

    tokens, total = _history([[1, 2, 3, 7], [4, 5, 6]])
    inner = torch.tensor([[50, 51], [60, 61]])
    speculator = SimpleNamespace(propose=lambda input_batch, *a, **kw: inner.clone())
    runner = SimpleNamespace(
        speculator=speculator,
        num_speculative_steps=2,
        req_states=SimpleNamespace(all_token_ids=SimpleNamespace(gpu=tokens), total_len=SimpleNamespace(gpu=total)),
    )
    composer = Composer(runner)
    batch = SimpleNamespace(req_ids=["a", "b"], idx_mapping=torch.tensor([0, 1]))
    out = SchedulerOutput.make_empty()
    composer.set_plan(out)  # no plan on the step: the inner drafts as they are
    assert speculator.propose(batch).tolist() == [[50, 51], [60, 61]] and composer.take_sources() == {}
    setattr(
        out,
        PLAN_ATTR,
        StepPlan(
            INNER,
            {"a": RowPlan(0.1, 3, (7, 8, 9), (0.9, 0.9, 0.9), "lookup"), "b": RowPlan(0.9, 3, (1,), (0.9,), "pool")},
        ),
    )
    composer.set_plan(out)
    assert speculator.propose(batch).tolist() == [[8, 9], [60, 61]]
    assert composer.take_sources() == {"a": "lookup", "b": INNER}
    assert composer.take_sources() == {}  # reported once, with the step that verifies them
    assert speculator.propose(batch, dummy_run=True).tolist() == [[50, 51], [60, 61]]  # warm-up: untouched


def test_past_the_inner_depth_a_row_repeats_the_inner_drafts_last_token_and_is_valued_to_its_depth() -> None:
    # the inner drafted 2 of K = 4 (the plan's inner_depth): its stale columns 2, 3 (-1 here) are never
    # verified as they are (-1 is no token id); its value is 2 tokens at 0.9 (1.71), not 4 (3.10), so a
    # candidate worth 2.0 (4 tokens at path 0.5 each) wins only where the depth is 2
    tokens, total = _history([[1, 2, 3]])
    cand = RowPlan(0.9, 3, (9, 10, 11, 12), (0.5, 0.5, 0.5, 0.5), "lookup")
    inner = torch.tensor([[50, 51, -1, -1]])
    drafts, chosen = choose(inner, tokens, total, torch.tensor([0]), StepPlan(INNER, {"a": cand}, 2), ["a"])
    assert chosen.tolist() == [True] and drafts.tolist() == [[9, 10, 11, 12]]
    drafts, chosen = choose(inner, tokens, total, torch.tensor([0]), StepPlan(INNER, {"a": cand}, 4), ["a"])
    assert chosen.tolist() == [False]
    stale = RowPlan(0.9, 3, (8, 10), (0.5, 0.5), "lookup")  # its anchor's next token is not there: no candidate
    tokens, total = _history([[1, 2, 3, 9]])
    drafts, chosen = choose(inner, tokens, total, torch.tensor([0]), StepPlan(INNER, {"a": stale}, 2), ["a"])
    assert chosen.tolist() == [False] and drafts.tolist() == [[50, 51, 51, 51]]


def test_the_inner_drafter_is_asked_for_the_plans_depth_and_a_draft_model_drafts_no_deeper() -> None:
    # vLLM's draft-model speculator drafts num_speculative_steps deep whatever num_speculative_tokens
    # says: the composer sets that count for the call (and puts it back)
    from types import SimpleNamespace

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

    from cosine.vllm_mrv2 import Composer

    seen = []
    for speculator in (SimpleNamespace(num_speculative_steps=4), object.__new__(StandaloneARSpeculator)):
        speculator.num_speculative_steps = 4

        def propose(input_batch, *a, _s=speculator, **kw):
            seen.append((kw["num_speculative_tokens"], _s.num_speculative_steps))
            return torch.tensor([[50, 51, 52, 53]])[:, : _s.num_speculative_steps]

        speculator.propose = propose
        tokens, total = _history([[1, 2, 3]])
        runner = SimpleNamespace(
            speculator=speculator,
            num_speculative_steps=4,
            req_states=SimpleNamespace(all_token_ids=SimpleNamespace(gpu=tokens), total_len=SimpleNamespace(gpu=total)),
        )
        composer = Composer(runner)
        out = SchedulerOutput.make_empty()
        setattr(out, PLAN_ATTR, StepPlan(INNER, {"a": RowPlan(0.5, 3)}, 1))
        composer.set_plan(out)
        batch = SimpleNamespace(req_ids=["a"], idx_mapping=torch.tensor([0]))
        drafts = speculator.propose(batch, num_speculative_tokens=4)
        assert speculator.num_speculative_steps == 4  # put back
        assert drafts.shape == (1, 4)  # vLLM writes all K columns of its draft buffer
    assert seen[0] == (1, 4) and seen[1] == (1, 1), seen  # the draft model: one forward, not four


def test_a_steps_engine_depth_is_the_forwards_the_inner_drafter_ran_not_the_widest_row(monkeypatch) -> None:
    """The proposer fits the inner drafter's seconds per forward to the steps' times against their
    depth: a step whose widest row is a longer anchored candidate (6 tokens) ran the inner drafter
    only the plan's `inner_depth` (2) forwards, so that is the depth it is recorded with; finished
    requests are released once the step is folded in."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.output import SchedulerOutput

    from cosine.vllm_mrv2 import CoSineAsyncScheduler

    steps, kept = [], []
    cosine = SimpleNamespace(
        observe_step=steps.append, source_of=lambda rid: "", retain=lambda live: kept.append(set(live)),
        stats=SimpleNamespace(observe_queue=lambda running, waiting: None),
    )
    monkeypatch.setattr(AsyncScheduler, "update_from_output", lambda self, so, mro: "vllm's")
    scheduler = object.__new__(CoSineAsyncScheduler)  # vLLM's own state is not read by this method
    scheduler.cosine, scheduler._step_t0, scheduler.running, scheduler.waiting = cosine, 0.0, [], []
    scheduler.requests = {"b": None}  # "a" finished in this step
    out = SchedulerOutput.make_empty()
    out.scheduled_spec_decode_tokens = {"a": [-1] * 6}
    out.num_scheduled_tokens, out.total_num_scheduled_tokens = {"a": 7}, 7
    out.num_spec_tokens_to_schedule = 6
    setattr(out, PLAN_ATTR, StepPlan(INNER, {"a": RowPlan(0.5, 3, tuple(range(10, 19)), (0.9,) * 9, "lookup")}, 2))
    result = SimpleNamespace(sampled_token_ids=[[1, 2, 3]], req_id_to_index={"a": 0})
    assert scheduler.update_from_output(out, result) == "vllm's"
    assert [(s.engine_depth, s.num_tokens, s.outcomes[0].num_draft_tokens) for s in steps] == [(2, 7, 6)]
    assert kept == [{"b"}]
