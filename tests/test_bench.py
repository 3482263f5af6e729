"""`cosine bench` aggregation: ratios to target-only and to the best single drafter, identity,
and the routing summary, on hand-made records (the real run needs the real models)."""

from __future__ import annotations

import pytest

from cosine.bench import RequestRecord, aggregate, routing_summary


def _rec(system, pid, domain, n, wall, drafts=0, drafted=0, accepted=0, ids=None, **kw):
    return RequestRecord(system, pid, domain, 10, ids or list(range(n)), wall, 0.1, drafts, drafted, accepted, **kw)


def test_ratios_to_target_and_best_single():
    records = [
        _rec("target-only", "a", "code", 10, 10.0), _rec("target-only", "b", "chat", 10, 10.0),
        _rec("single-coder", "a", "code", 10, 5.0, 2, 8, 6), _rec("single-coder", "b", "chat", 10, 8.0, 4, 8, 2),
        _rec("single-ngram", "a", "code", 10, 4.0, 1, 8, 8), _rec("single-ngram", "b", "chat", 10, 10.0),
        _rec("cosine", "a", "code", 10, 4.0, 1, 12, 9, route=["coder", "smollm2"], accepted_by={"lookup": 9},
             tree_steps=1),
        _rec("cosine", "b", "chat", 10, 6.0, 2, 10, 6, ids=[9] * 10, route=["smollm2", "coder"],
             accepted_by={"smollm2": 4, "coder": 2}, tree_steps=2),
    ]
    rows = {(r["system"], r["domain"]): r for r in aggregate(records)}
    # single-coder: 20 tokens / 13 s beats single-ngram: 20 / 14 s
    assert rows[("cosine", "all")]["best_single"] == "single-coder"
    assert rows[("cosine", "all")]["speedup_vs_best_single"] == pytest.approx((20 / 10) / (20 / 13), rel=1e-3)
    assert rows[("cosine", "all")]["speedup_vs_target_only"] == pytest.approx(2.0, rel=1e-3)
    assert rows[("cosine", "all")]["acceptance_length_vs_best_single"] == pytest.approx(
        (1 + 15 / 3) / (1 + 8 / 6), rel=1e-2)
    assert rows[("cosine", "code")]["identical_to_target"] and not rows[("cosine", "chat")]["identical_to_target"]
    assert rows[("cosine", "all")]["tree_steps"] == 3
    summary = routing_summary(records)
    assert summary["cosine"]["chat"] == {"routed_first": {"smollm2": 1}, "accepted_by": {"smollm2": 4, "coder": 2}}
    assert "single-coder" not in summary
