"""The on-demand fallback of a spot pool (cosine_spec.capacity), with plain numbers."""

from __future__ import annotations

import pytest
from cosine_spec.capacity import on_demand_fallback

TIMEOUT = 300.0


def test_pending_past_the_timeout_gets_an_on_demand_sibling_for_the_shortfall() -> None:
    f = on_demand_fallback(desired=4, ready_spot=1, pending_ages_s=[400, 320, 10], timeout_s=TIMEOUT, current=0)
    assert f.replicas == 3 and "2 spot replica(s) Pending over 300 s" in f.reason


def test_pending_for_less_than_the_timeout_is_waited_for() -> None:
    """A scale-up on a healthy spot pool is not doubled on demand."""
    assert on_demand_fallback(4, 1, [299, 5, 5], TIMEOUT, 0).replicas == 0


def test_ready_spot_replicas_take_the_load_back() -> None:
    # the spot capacity comes back: the stuck replicas land and start (Pending no more) ...
    assert on_demand_fallback(4, 1, [], TIMEOUT, current=3).replicas == 3  # ... the sibling holds until Ready
    assert on_demand_fallback(4, 3, [], TIMEOUT, current=3).replicas == 1  # two Ready on spot: two go
    f = on_demand_fallback(4, 4, [], TIMEOUT, current=1)
    assert f.replicas == 0 and "back on spot" in f.reason


def test_a_pool_scaled_down_shrinks_its_sibling() -> None:
    assert on_demand_fallback(2, 0, [900, 900, 900, 900], TIMEOUT, current=4).replicas == 2
    assert on_demand_fallback(0, 0, [], TIMEOUT, current=2).replicas == 0


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        on_demand_fallback(-1, 0, [], TIMEOUT, 0)
