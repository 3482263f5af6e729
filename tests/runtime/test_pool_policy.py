"""How the drafting plane uses pools: a pure policy, tested with plain numbers."""

import pytest

from cosine import speculation_control as sc
from cosine.pool_policy import PoolPolicy, assign_replica
from cosine.routing import RoutingSettings
from cosine.speculation_control import pool_ask


def test_assign_replica_least_held_first_on_ties():
    assert assign_replica({}, ["a", "b"]) == "a"
    assert assign_replica({"a": 2, "b": 1}, ["a", "b"]) == "b"
    assert assign_replica({"a": 1, "b": 1, "c": 0}, ["a", "b", "c"]) == "c"  # a replica just added
    assert assign_replica({"a": 0}, ["b"]) == "b"  # only the replicas offered
    assert assign_replica({"a": 0}, []) is None


def test_assignments_spread_a_closed_loop_evenly_and_fill_a_new_replica():
    """Requests come and go (each held by one replica for its life): the least-held rule keeps
    two replicas within one request of each other, and a third replica added mid-way takes new
    requests until it holds as many as the others."""
    held = {"a": 0, "b": 0}
    homes: dict[int, str] = {}
    for i in range(8):
        homes[i] = r = assign_replica(held, list(held))
        held[r] += 1
    assert held == {"a": 4, "b": 4}
    held["c"] = 0
    for i in range(8, 14):  # one finishes, one starts
        held[homes.pop(i - 8)] -= 1
        homes[i] = r = assign_replica(held, list(held))
        held[r] += 1
    assert max(held.values()) - min(held.values()) <= 1 and held["c"] >= 2


def test_skip_reason_probes_then_asks_where_it_pays_and_says_why_not():
    p = PoolPolicy(probe_every=4, min_gain_tokens=0.25)
    # probe steps: the first step, then every 4th (the caller asks there whatever the estimates)
    assert [p.probe_step(s) for s in range(1, 10)] == [True, False, False, False, True, False, False, False, True]
    assert p.skip_reason(0.0, 0.0, [(0.9, 1.0)], 8) == "yield"
    # elsewhere: beats lookup (good pool, lookup rarely hits)
    assert p.skip_reason(0.8, 1.0, [(0.8, 0.2)], 8) is None
    # a good pool whose drafts arrive too late: "late" (a larger pool would serve it)
    assert p.skip_reason(0.8, 0.1, [(0.8, 0.2)], 8) == "late"
    # a pool lookup beats even when on time: "yield"
    assert p.skip_reason(0.3, 0.1, [(0.8, 0.9)], 8) == "yield"


def test_ask_is_speculation_controls_pool_ask_with_the_policys_settings():
    p = PoolPolicy(lookahead_tokens=2, branches=2, step_budget=0.8, max_draft_tokens=32)
    assert p.ask(0.5, 0.02, 0.1, 8, verifying=True) == pool_ask(0.5, 0.02, 0.1, 8, 2, lookahead=2, budget=0.8)
    assert p.ask(0.5, 0.02, 0.1, 8, verifying=False)[1] == 0  # nothing verified: no branches
    assert p.ask(0.5, None, 0.1, 8, verifying=True) == (10, 2)  # unmeasured: k + lookahead, branches allowed


def test_estimates_are_moving_averages():
    assert PoolPolicy.on_time(1.0, False) == pytest.approx(0.95)
    assert PoolPolicy.on_time(0.0, True) == pytest.approx(0.05)
    assert PoolPolicy.hit_rate(0.5, True) == pytest.approx(0.6)
    rtt, tok = PoolPolicy.learn_speed(None, None, 0.4, 8)
    assert (rtt, tok) == (0.4, 0.05)
    rtt, tok = PoolPolicy.learn_speed(rtt, tok, 1.4, 0)  # a prefill call: per-token estimate kept
    assert rtt == pytest.approx(0.6) and tok == 0.05
    assert PoolPolicy.learn_speed(0.4, 0.05, 0.4, 4)[1] == pytest.approx(0.06)


def test_routing_with_fusion_may_use_every_pool():
    rs = RoutingSettings(max_drafters=1)
    assert PoolPolicy.routing_settings(rs, 3, fusion=True).max_drafters == 3
    assert PoolPolicy.routing_settings(rs, 3, fusion=False) is rs


def test_invalid_settings_raise():
    with pytest.raises(ValueError, match="probe_every"):
        PoolPolicy(probe_every=0)
    with pytest.raises(ValueError, match="step_budget"):
        PoolPolicy(step_budget=1.5)


def test_an_off_context_pool_is_not_late():
    """Drafts back in time that no longer continue the context (the target went elsewhere) are no
    demand for replicas: the skip is "yield"; drafts that miss the step are "late"."""
    p = PoolPolicy(probe_every=100)
    assert p.skip_reason(0.8, 1.0, [(0.8, 0.2)], 8, on_context=1.0) is None
    assert p.skip_reason(0.8, 1.0, [(0.8, 0.2)], 8, on_context=0.05) == "yield"
    assert p.skip_reason(0.8, 0.05, [(0.8, 0.2)], 8, on_context=1.0) == "late"


def test_an_ask_is_made_only_where_its_tokens_pay_for_the_pools_time():
    """With a value on accepted tokens and a price on the pool's replicas, a pool is asked where
    the tokens it adds over the best local source are worth the replica time the ask takes: at
    $0.72 an hour (2e-4 $/s) a 50 ms ask costs 1e-5 $, so at 1e-5 $ a token it must add a token."""
    p = PoolPolicy(probe_every=8, token_value_usd=1e-5, pool_prices=(("chat", 0.72),))
    assert p.price_per_hour_usd("chat") == 0.72 and p.price_per_hour_usd("code") == 0.0
    assert p.ask_pays(1.2, "chat", 0.05) and not p.ask_pays(0.8, "chat", 0.05)
    assert p.ask_pays(0.01, "code", 0.05)  # an unpriced pool: its cost is not weighed
    assert PoolPolicy().ask_pays(0.01, "chat", 10.0)  # no token value: not weighed
    # a pool that beats lookup by half a token a step (0.75 against 0.7 at k = 8: 2.70 against
    # 2.20): asked for its tokens, but they do not pay for a 50 ms ask; for a 10 ms one they do
    local = [(0.7, 1.0)]
    assert sc.pool_gain_tokens(0.75, 1.0, local, 8) == pytest.approx(0.50, abs=0.01)
    assert PoolPolicy(probe_every=8).skip_reason(0.75, 1.0, local, 8, pool="chat", ask_s=0.05) is None
    assert p.skip_reason(0.75, 1.0, local, 8, pool="chat", ask_s=0.05) == "yield"
    assert p.skip_reason(0.75, 1.0, local, 8, pool="chat", ask_s=0.01) is None
    # on time it would pay, but its drafts arrive late: "late" (the autoscaler's demand)
    assert p.skip_reason(0.95, 0.05, local, 8, pool="chat", ask_s=0.01) == "late"
    with pytest.raises(ValueError):
        PoolPolicy(pool_prices=(("chat", -1.0),))
    with pytest.raises(ValueError):
        PoolPolicy(token_value_usd=-1e-6)
