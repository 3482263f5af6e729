"""Batch scheduling policy, tested with plain numbers (and seeded random cases)."""

import random

import pytest

from cosine.simulation.batching import (
    BatchBudget,
    BatchSettings,
    PassCost,
    ReadyRequest,
    plan_batch,
)

COST = PassCost(base_s=0.3, per_token_s=0.01, per_request_s=0.005)
BIG = BatchBudget(max_tokens=10_000, max_kv_tokens=1_000_000, max_requests=1_000)
NOW = 100.0


def req(rid, num_tokens=5, kv_tokens=100, age_s=0.1, expected=2.0, deadline_s=None, prefill=False, ready_s=None):
    """A ready request that arrived `age_s` ago and has been ready for `ready_s` (default: 0.1 s)."""
    return ReadyRequest(rid, num_tokens, kv_tokens, arrival_s=NOW - age_s, ready_since_s=NOW - (ready_s or 0.1),
                        expected_accepted=expected, deadline_s=deadline_s, is_prefill=prefill)


def plan(ready, budget=BIG, cost=COST, **settings):
    return plan_batch(ready, budget, BatchSettings(**settings), NOW, cost=cost)


def ids(p):
    return [t.request_id for t in p.taken]


def test_everything_fits():
    ready = [req("a"), req("b"), req("c")]
    p = plan(ready)
    assert sorted(ids(p)) == ["a", "b", "c"] and p.skipped == ()
    assert p.num_tokens == 15
    assert p.estimated_pass_s == pytest.approx(0.3 + 15 * 0.01 + 3 * 0.005)
    assert plan([]).taken == () and plan([]).estimated_pass_s == 0.0


def test_token_budget_and_request_limit():
    ready = [req(str(i), num_tokens=4, age_s=10 - i) for i in range(10)]
    p = plan(ready, BatchBudget(max_tokens=18, max_kv_tokens=10**6, max_requests=100), latency_weight=1.0)
    assert ids(p) == ["0", "1", "2", "3"]  # oldest first, 16 of 18 tokens
    assert set(p.skipped) == {str(i) for i in range(4, 10)}
    p = plan(ready, BatchBudget(max_tokens=100, max_kv_tokens=10**6, max_requests=3), latency_weight=1.0)
    assert ids(p) == ["0", "1", "2"]


def test_memory_bound():
    ready = [req("a", kv_tokens=900, age_s=3), req("b", kv_tokens=500, age_s=2), req("c", kv_tokens=50, age_s=1)]
    p = plan(ready, BatchBudget(max_tokens=100, max_kv_tokens=1000, max_requests=10), latency_weight=1.0)
    assert ids(p) == ["a", "c"]  # b would overflow the KV memory; the smaller c still fits
    assert p.skipped == ("b",)


def test_latency_first_and_throughput_first_differ():
    old_poor = req("old", num_tokens=9, age_s=0.9, expected=1.2)  # long wait, little expected
    new_rich = req("new", num_tokens=5, age_s=0.0, expected=4.5)  # just arrived, high acceptance
    one = BatchBudget(max_tokens=100, max_kv_tokens=10**6, max_requests=1)
    assert ids(plan([old_poor, new_rich], one, latency_weight=1.0)) == ["old"]
    assert ids(plan([old_poor, new_rich], one, latency_weight=0.0)) == ["new"]
    # a deadline makes a young request urgent
    due = req("due", age_s=0.0, deadline_s=NOW + 0.05, expected=0.5)
    assert ids(plan([old_poor, due], one, latency_weight=1.0)) == ["due"]


def test_throughput_first_uses_the_pass_cost():
    # same expected tokens: the shorter draft costs less marginal pass time, so it earns more per second
    short, long = req("short", num_tokens=2, expected=2.0), req("long", num_tokens=9, expected=2.0, age_s=5)
    one = BatchBudget(max_tokens=100, max_kv_tokens=10**6, max_requests=1)
    assert ids(plan([long, short], one, latency_weight=0.0)) == ["short"]
    # when tokens cost nothing and requests cost the same, only expected tokens matter
    flat = PassCost(base_s=0.3, per_token_s=0.0, per_request_s=0.0)
    rich = req("rich", num_tokens=9, expected=3.0)
    assert ids(plan([short, rich], one, cost=flat, latency_weight=0.0)) == ["rich"]


def test_starvation_guard_overrides_the_weight():
    fresh = [req(f"f{i}", expected=5.0) for i in range(5)]
    starved = req("starved", num_tokens=8, expected=0.1, ready_s=2.0)
    budget = BatchBudget(max_tokens=10, max_kv_tokens=10**6, max_requests=10)
    assert ids(plan([*fresh, starved], budget, latency_weight=0.0, max_wait_s=1.0))[0] == "starved"
    assert "starved" not in ids(plan([*fresh, starved], budget, latency_weight=0.0, max_wait_s=5.0))


def test_prefill_is_chunked():
    p = plan([req("p", num_tokens=2000, prefill=True, expected=1.0)], prefill_chunk_tokens=256)
    assert [(t.request_id, t.num_tokens) for t in p.taken] == [("p", 256)]
    budget = BatchBudget(max_tokens=100, max_kv_tokens=10**6, max_requests=10)
    p = plan([req("p", num_tokens=2000, prefill=True)], budget, prefill_chunk_tokens=256)
    assert p.taken[0].num_tokens == 100  # alone: the whole token budget
    # the memory bound chunks it too
    budget = BatchBudget(max_tokens=100, max_kv_tokens=1030, max_requests=10)
    assert plan([req("p", num_tokens=500, kv_tokens=1000, prefill=True)], budget).taken[0].num_tokens == 30


def test_prefill_share_while_decodes_wait():
    budget = BatchBudget(max_tokens=100, max_kv_tokens=10**6, max_requests=10)
    prefills = [req("p1", num_tokens=500, prefill=True, age_s=5), req("p2", num_tokens=500, prefill=True, age_s=4)]
    decodes = [req(f"d{i}", num_tokens=5) for i in range(4)]
    p = plan([*prefills, *decodes], budget, latency_weight=1.0, max_prefill_share=0.3)
    by_id = {t.request_id: t.num_tokens for t in p.taken}
    assert sum(n for r, n in by_id.items() if r.startswith("p")) == 30
    assert all(f"d{i}" in by_id for i in range(4))
    assert p.num_tokens <= 100
    # no decode waiting: prefills may take the whole budget
    p = plan(prefills, budget, latency_weight=1.0, max_prefill_share=0.3)
    assert p.num_tokens == 100
    # a starving prefill is not held to the share
    starving = req("p0", num_tokens=500, prefill=True, ready_s=3.0)
    p = plan([starving, *decodes], budget, max_prefill_share=0.0, max_wait_s=1.0)
    assert (p.taken[0].request_id, p.taken[0].num_tokens) == ("p0", 100)


def test_oversized_draft_is_taken_alone_clipped():
    budget = BatchBudget(max_tokens=8, max_kv_tokens=10**6, max_requests=10)
    huge = req("huge", num_tokens=30, age_s=9)
    p = plan([huge, req("b", num_tokens=3)], budget, latency_weight=1.0)
    assert [(t.request_id, t.num_tokens) for t in p.taken] == [("huge", 8)]
    # behind others, it waits for its turn, then the guard puts it first
    p = plan([huge, req("b", num_tokens=3, age_s=20)], budget, latency_weight=1.0)
    assert ids(p) == ["b"]
    p = plan([req("huge", num_tokens=30, ready_s=2.0), req("b", num_tokens=3, age_s=20)], budget)
    assert ids(p) == ["huge"]


def test_nothing_taken_only_when_nothing_fits_alone():
    budget = BatchBudget(max_tokens=10, max_kv_tokens=100, max_requests=4)
    assert plan([req("too_big", kv_tokens=200)], budget).taken == ()
    assert ids(plan([req("too_big", kv_tokens=200), req("ok", kv_tokens=10)], budget)) == ["ok"]


def test_settings_validation():
    with pytest.raises(ValueError, match="latency_weight"):
        BatchSettings(latency_weight=1.5)
    with pytest.raises(ValueError, match="max_prefill_share"):
        BatchSettings(max_prefill_share=-0.1)
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        BatchSettings(prefill_chunk_tokens=0)
    with pytest.raises(ValueError, match="positive"):
        BatchBudget(max_tokens=0, max_kv_tokens=10, max_requests=1)
    with pytest.raises(ValueError):
        PassCost(base_s=-1.0, per_token_s=0.0)
    with pytest.raises(ValueError):
        req("x", num_tokens=0)
    with pytest.raises(ValueError, match="duplicate"):
        plan([req("a"), req("a")])


def test_random_plans_respect_the_bounds():
    """Property test with seeded random cases (hypothesis is not installed in this venv)."""
    rng = random.Random(0)
    for _ in range(500):
        budget = BatchBudget(rng.randint(1, 64), rng.randint(1, 4000), rng.randint(1, 8))
        settings = BatchSettings(latency_weight=rng.random(), prefill_chunk_tokens=rng.randint(1, 64),
                                 max_prefill_share=rng.random(), max_wait_s=rng.uniform(0.1, 2.0))
        ready = [req(f"r{i}", num_tokens=rng.randint(1, 80), kv_tokens=rng.randint(0, 2000),
                     age_s=rng.uniform(0, 5), expected=rng.uniform(0, 6), prefill=rng.random() < 0.3,
                     ready_s=rng.uniform(0.01, 3), deadline_s=rng.choice([None, NOW + rng.uniform(-1, 5)]))
                 for i in range(rng.randint(0, 12))]
        by_id = {r.request_id: r for r in ready}
        p = plan_batch(ready, budget, settings, NOW, cost=COST)
        taken = ids(p)
        assert sorted(taken + list(p.skipped)) == sorted(by_id) and len(set(taken)) == len(taken)
        assert len(taken) <= budget.max_requests
        assert all(1 <= t.num_tokens <= by_id[t.request_id].num_tokens for t in p.taken)
        assert p.num_tokens <= budget.max_tokens
        assert sum(by_id[t.request_id].kv_tokens + t.num_tokens for t in p.taken) <= budget.max_kv_tokens
        fits_alone = [r for r in ready if r.kv_tokens + (1 if r.is_prefill else min(r.num_tokens, budget.max_tokens))
                      <= budget.max_kv_tokens]
        assert bool(taken) == bool(fits_alone)
        starving = [r for r in fits_alone if NOW - r.ready_since_s > settings.max_wait_s]
        if starving:  # the longest-waiting request that can run at all goes first
            assert taken[0] == min(starving, key=lambda r: (r.ready_since_s, r.arrival_s, r.request_id)).request_id
