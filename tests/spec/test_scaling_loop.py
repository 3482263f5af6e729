"""The one autoscaling loop (observe, decide, actuate, report) with plain callbacks: what it
survives and what it counts. The operator, `cosine serve` and the simulator run this loop."""

from __future__ import annotations

import asyncio

import pytest
from cosine_spec.autoscaling import Observations
from cosine_spec.scaling_loop import ScalingLoop
from test_autoscaling import POLICY, pool, verifier

LATE = Observations(verifier(), (pool(1, asks=20, late=40, skipped={"late": 20}, u=0.9),))  # grows to 2


def test_a_failed_observe_is_counted_and_the_next_tick_decides() -> None:
    """Catches: one failed scrape ending the loop (as `cosine serve`'s did: a thread without
    exception handling) or deciding on nothing."""
    answers: list[Observations | Exception | None] = [ConnectionError("refused"), None, LATE]
    resized, reported, errors = [], [], []

    def observe() -> Observations | None:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    loop = ScalingLoop(POLICY, observe, lambda d: resized.append((d.pool, d.desired)),
                       lambda obs, ds: reported.append(len(ds)), on_error=lambda stage, e: errors.append(stage))
    assert loop.tick_now(0.0) == () and loop.errors["observe"] == 1 and errors == ["observe"]
    assert loop.tick_now(1.0) == ()  # a first scrape: nothing to decide on yet
    (decision,) = loop.tick_now(2.0)
    assert resized == [("code", 2)] and reported == [1] and decision.changed


def test_a_failed_resize_is_counted_and_reported_all_the_same() -> None:
    """Catches: an actuation error (an API call refused) skipping the report or escaping."""
    reported = []

    def refuse(_):  # noqa: ANN001, ANN202
        raise PermissionError("forbidden")

    loop = ScalingLoop(POLICY, lambda: LATE, refuse, lambda obs, ds: reported.append(ds))
    assert loop.tick_now(0.0)[0].desired == 2
    assert loop.errors == {"actuate": 1} and len(reported) == 1


def test_async_callbacks_are_awaited_and_tick_now_refuses_one_that_suspends() -> None:
    async def observe() -> Observations:
        await asyncio.sleep(0)  # real I/O suspends
        return LATE

    resized = []
    loop = ScalingLoop(POLICY, observe, resized.append)
    (decision,) = asyncio.run(loop.tick(0.0))
    assert resized == [decision]
    with pytest.raises(RuntimeError, match="suspended"):
        ScalingLoop(POLICY, observe, resized.append).tick_now(0.0)
