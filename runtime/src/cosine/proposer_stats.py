"""The proposer's counters since start: the first of the three metrics layers (vLLM's
`spec_decode/metrics.py` keeps the same: these counters, an aggregator, an exporter, here
`metrics.ProposerCollector`). Written from the engine's thread and the pool calls' threads, read
at scrape time: every write goes through a method, under one lock; readers take a `snapshot`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class ProposerStats:
    """Counters since start (the metrics layer turns them into `cosine_` series).

    Written from the engine's thread (steps, the queue) and the pool calls' threads (calls,
    errors, speeds), read at scrape time from the metrics server's: every write goes through a
    method here, under one lock, and readers take a `snapshot`. (vLLM's spec-decode stats keep
    the same three layers: these counters, an aggregator, the exporter, `metrics.ProposerCollector`.)
    """

    steps: int = 0
    steps_with_draft: int = 0
    draft_tokens: dict[str, int] = field(default_factory=dict)
    accepted_tokens: dict[str, int] = field(default_factory=dict)
    drafts: dict[str, int] = field(default_factory=dict)
    drafts_late: dict[str, int] = field(default_factory=dict)
    pool_errors: dict[str, int] = field(default_factory=dict)
    pool_rtt_s: dict[str, float] = field(default_factory=dict)  # EMA of a pool call's wall time
    pool_token_s: dict[str, float] = field(default_factory=dict)  # EMA of a call's wall time per draft token
    pool_calls: dict[str, int] = field(default_factory=dict)  # draft calls that returned
    pool_yield: dict[str, float] = field(default_factory=dict)  # accepted tokens per draft call (recent)
    pool_on_time: dict[str, float] = field(default_factory=dict)  # EMA over looks: a pool draft had arrived in time
    pool_on_context: dict[str, float] = field(default_factory=dict)  # EMA over arrived drafts: it continued the context
    # asks not made, by (pool, reason): "late"/"yield" (`PoolPolicy.skip_reason`), "down" (no replica answers)
    pool_skipped: dict[tuple[str, str], int] = field(default_factory=dict)
    # asks made only to probe: on a request's probe step, where the pool would be skipped as "yield"
    pool_probes: dict[str, int] = field(default_factory=dict)
    # expected accepted tokens over the best local source (`PoolPolicy.gain_tokens`), summed over
    # the steps a request wanted the pool: asks but probes, steps its draft was in flight, skips as
    # "late" or "down" (the autoscaler's demand)
    pool_gain_tokens: dict[str, float] = field(default_factory=dict)
    busy_s: float = 0.0  # seconds in engine steps
    tokens_verified: int = 0  # tokens computed by the steps (pending + draft + prefill)
    requests_running: int = 0
    requests_waiting: int = 0

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, counter: dict[Any, Any], key: Any, n: float = 1) -> None:
        """Add `n` to `counter[key]` (one of this object's per-source counters)."""
        with self._lock:
            counter[key] = counter.get(key, 0) + n

    def observe_draft(self, source: str, draft_tokens: int, accepted: int) -> None:
        """One verified draft of `source`: `draft_tokens` tokens, `accepted` of them accepted."""
        with self._lock:
            self.draft_tokens[source] = self.draft_tokens.get(source, 0) + draft_tokens
            self.accepted_tokens[source] = self.accepted_tokens.get(source, 0) + accepted
            self.drafts[source] = self.drafts.get(source, 0) + 1

    def set(self, gauge: dict[Any, float], key: Any, value: float) -> None:
        """Set `gauge[key]` (one of this object's per-pool estimates) to `value`."""
        with self._lock:
            gauge[key] = value

    def observe_step(self, step_s: float, num_tokens: int, with_draft: bool) -> None:
        """One engine step: `step_s` seconds computing `num_tokens` tokens; `with_draft`: it verified a draft."""
        with self._lock:
            self.steps += 1
            self.busy_s += max(0.0, step_s)
            self.tokens_verified += num_tokens
            self.steps_with_draft += int(with_draft)

    def observe_queue(self, running: int, waiting: int) -> None:
        """The engine's requests running and waiting now (the scheduler's queues)."""
        with self._lock:
            self.requests_running, self.requests_waiting = running, waiting

    def snapshot(self) -> ProposerStats:
        """A consistent copy to read (the counters go on changing under the original)."""
        with self._lock:
            values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
            return ProposerStats(**{k: dict(v) if isinstance(v, dict) else v for k, v in values.items()})
