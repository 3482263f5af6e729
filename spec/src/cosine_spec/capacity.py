"""Spot capacity with an on-demand fallback: how many on-demand replicas stand in for a spot pool.

Pure: counts and ages in, a size and its reason out; no kopf, no clock (ages are passed in). The
operator runs it for each spot pool; the simulator's spot study runs it on its own pods.

A spot pool asks its Deployment for ``desired`` replicas on spot nodes. When the provider has no
spot capacity, new replicas stay Pending. A replica Pending past ``spec.spot.pendingTimeoutSeconds``
is taken as not coming: an on-demand sibling Deployment (the same pods on demand, behind the same
Service) gets the shortfall, ``desired - ready spot replicas``. As spot replicas become Ready the
shortfall shrinks and the sibling with it, to zero: the load returns to spot. A replica that is
Pending for less than the timeout may still land, so it alone starts no fallback (a scale-up on a
healthy spot pool is never doubled on demand).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Fallback:
    """replicas: the on-demand sibling's size. reason: one line for the pool's condition."""

    replicas: int
    reason: str


def on_demand_fallback(desired: int, ready_spot: int, pending_ages_s: Sequence[float], timeout_s: float,
                       current: int) -> Fallback:
    """The on-demand sibling's replicas for a spot pool (see the module docstring).

    Args:
        desired: replicas the pool wants (its scale).
        ready_spot: its spot replicas Ready now.
        pending_ages_s: seconds each of its spot replicas has been Pending (unscheduled).
        timeout_s: ``spec.spot.pendingTimeoutSeconds``.
        current: the sibling's replicas now.

    Raises:
        ValueError: a negative count or timeout.
    """
    if min(desired, ready_spot, current) < 0 or timeout_s < 0:
        raise ValueError(f"counts and timeout must be >= 0, got {desired}, {ready_spot}, {current}, {timeout_s}")
    shortfall = max(0, desired - ready_spot)
    stuck = sum(1 for age in pending_ages_s if age >= timeout_s)
    if stuck:
        return Fallback(shortfall, f"{stuck} spot replica(s) Pending over {timeout_s:.0f} s: {shortfall} on demand "
                                   f"({ready_spot} of {desired} Ready on spot)")
    if current and shortfall:
        return Fallback(min(current, shortfall), f"spot replicas coming: {ready_spot} of {desired} Ready on spot, "
                                                 f"{min(current, shortfall)} on demand until they are")
    if current:
        return Fallback(0, f"all {desired} replicas Ready on spot: the load is back on spot")
    return Fallback(0, f"{ready_spot} of {desired} Ready on spot")
