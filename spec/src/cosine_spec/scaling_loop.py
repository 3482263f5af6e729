"""The one autoscaling loop: observe, decide, actuate, report.

The operator (per ``CoSineCluster``, on its pods' ``/metrics`` or Prometheus), ``cosine serve``
(its local drafter replicas) and the simulator (its simulated counters) run this loop; each supplies
its own ``observe`` (what the pools did over the last interval), ``actuate`` (make one pool the
size decided) and ``report`` (status, events, conditions). The decision is
:func:`~cosine_spec.autoscaling.desired_replicas`, pure (STYLE #12: the timer gathers, the
rule decides, the timer patches; dask-kubernetes' scaling inside a timer full of API calls is what
this avoids).

An error in ``observe``, ``actuate`` or ``report`` is counted (:attr:`ScalingLoop.errors`), logged
with its cause and survived: the next tick tries again, as kopf retries a failed handler. A failed
``observe`` decides nothing; a failed ``actuate`` leaves that pool as it was (the next
observation shows it, and the rule decides again).

Callbacks may be plain functions or coroutine functions. :meth:`ScalingLoop.tick` is a coroutine
(the operator and ``cosine serve`` await real I/O); :meth:`ScalingLoop.tick_now` runs it at once for
callbacks that never suspend (the simulator, whose clock is simulated).
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from cosine_spec.autoscaling import Observations, ScaleDecision, ScalerState, ScalingPolicy, desired_replicas

T = TypeVar("T")
Observe = Callable[[], "Observations | None | Awaitable[Observations | None]"]
Actuate = Callable[[ScaleDecision], "None | Awaitable[None]"]
Report = Callable[[Observations, Sequence[ScaleDecision]], "None | Awaitable[None]"]
STAGES = ("observe", "actuate", "report")


async def _settle(value: T | Awaitable[T]) -> T:
    return await value if inspect.isawaitable(value) else value


class ScalingLoop:
    """One pass per :meth:`tick`: observe, decide with ``policy``, actuate each changed pool, report.

    Args:
        policy: the pools' bounds and the rule's settings (``autoscaling.policy_from_spec``).
        observe: the last interval's observations; ``None`` when there is nothing to decide on yet
            (a first scrape: rates need two).
        actuate: make ``decision.pool`` ``decision.desired`` replicas (called for changed pools only).
        report: after the decisions, all of them (changed or not), with what was observed.
        on_error: told of each failed stage (``"observe"``, ``"actuate"``, ``"report"``) and its
            exception, after it is counted and logged (e.g. a Prometheus counter).
        log: where failures and their causes go.
    """

    def __init__(self, policy: ScalingPolicy, observe: Observe, actuate: Actuate, report: Report | None = None,
                 on_error: Callable[[str, BaseException], None] | None = None,
                 log: logging.Logger | logging.LoggerAdapter[Any] | None = None) -> None:
        self.policy = policy
        self.state = ScalerState()
        self.errors: Counter[str] = Counter()  # failures per stage since the loop began
        self._observe, self._actuate, self._report = observe, actuate, report
        self._on_error = on_error
        self._log = log or logging.getLogger(__name__)

    def reset(self) -> None:
        """Forget the rule's memory (the scale-down window): autoscaling was turned off."""
        self.state = ScalerState()

    def _failed(self, stage: str, error: BaseException, pool: str | None = None) -> None:
        self.errors[stage] += 1
        where = f" of pool {pool}" if pool else ""
        self._log.warning("autoscaler: %s%s failed (%d so far): %s: %s", stage, where, self.errors[stage],
                          type(error).__name__, error)
        if self._on_error is not None:
            self._on_error(stage, error)

    async def tick(self, now_s: float) -> tuple[ScaleDecision, ...]:
        """One pass at ``now_s`` (seconds, the caller's clock). Returns the decisions (empty when
        nothing was observed). Raises nothing a callback raises (``Exception``s are counted)."""
        try:
            observed = await _settle(self._observe())
        except Exception as e:  # noqa: BLE001 - a failed scrape must not end the loop
            self._failed("observe", e)
            return ()
        if observed is None:
            return ()
        decisions, self.state = desired_replicas(observed, self.policy, self.state, now_s)
        for d in decisions:
            if d.changed:
                try:
                    await _settle(self._actuate(d))
                except Exception as e:  # noqa: BLE001 - one pool's failure must not stop the others
                    self._failed("actuate", e, d.pool)
        if self._report is not None:
            try:
                await _settle(self._report(observed, decisions))
            except Exception as e:  # noqa: BLE001
                self._failed("report", e)
        return tuple(decisions)

    def tick_now(self, now_s: float) -> tuple[ScaleDecision, ...]:
        """:meth:`tick` run to completion at once, for callbacks that never suspend (plain functions).

        Raises:
            RuntimeError: a callback awaited something that did not complete at once.
        """
        coro = self.tick(now_s)
        try:
            coro.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        coro.close()
        raise RuntimeError("ScalingLoop.tick_now: a callback suspended; await tick() in an event loop")
