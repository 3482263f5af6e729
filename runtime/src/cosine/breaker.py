"""A circuit breaker: after enough failures in a row, leave a thing out for a while.

The proposer keeps one per drafter pool (a pool whose calls keep failing is not asked, so its
requests draft by prompt lookup), a `transport.replica_pool.ReplicaPool` one per replica (a replica
that keeps failing takes no request, and its requests move to another). Both follow the pattern
of Nygard's *Release It!* (2007, "Circuit Breaker"): closed while calls succeed, open for
`retry_s` after `down_after` failures in a row (or one fatal failure), then closed again so the
next call probes it. Pure: the caller passes the time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Breaker:
    """Failures in a row and until when the thing is left out.

    Args:
        down_after: failures in a row that open the breaker (>= 1).
        retry_s: seconds it stays open, after which the next call probes the thing again.
    Raises:
        ValueError: `down_after` below 1 or a negative `retry_s`.
    """

    down_after: int = 3
    retry_s: float = 5.0
    failures: int = 0  # failed calls in a row
    down_until_s: float = 0.0  # closed (usable) from this time on

    def __post_init__(self) -> None:
        if self.down_after < 1 or self.retry_s < 0:
            raise ValueError(f"need down_after >= 1 and retry_s >= 0, got {self.down_after}, {self.retry_s}")

    def allows(self, now_s: float) -> bool:
        """Whether a call may go to the thing at `now_s` (the breaker is closed)."""
        return self.down_until_s <= now_s

    def succeeded(self) -> bool:
        """A call returned. Returns whether it had been failing long enough to open the breaker
        (the thing answers again)."""
        recovered = self.failures >= self.down_after
        self.failures = 0
        return recovered

    def failed(self, now_s: float, fatal: bool = False) -> bool:
        """A call failed at `now_s` (`fatal`: one that says the thing is gone, e.g. a refused
        connection). Returns whether the breaker is open now, until `now_s + retry_s`."""
        self.failures += 1
        if fatal or self.failures >= self.down_after:
            self.down_until_s = now_s + self.retry_s
            return True
        return False
