"""What a simulation reports: per-request latencies and the cluster's counters (`SimResult`), and
their summary as the JSON `cosine simulate` writes."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class SimResult:
    """Per-request latencies and cluster counters; `summary()` for the JSON."""

    latencies_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)  # per request: (latency - TTFT) / (output tokens - 1)
    tokens: int = 0
    makespan_s: float = 0.0
    verifier_busy_s: float = 0.0
    passes: int = 0
    steps_with_draft: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    spec_steps: int = 0
    drafts_late: int = 0
    rehomes: int = 0  # requests moved to another replica of a pool (theirs was removed)
    preemptions: int = 0  # pool replicas preempted (`Preemption`)
    rehomed_requests: set[str] = field(default_factory=set)  # requests that were re-homed at least once
    replica_calls: dict[str, list[int]] = field(default_factory=dict)  # pool -> draft calls per replica
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [drafts, draft tokens, accepted]
    replicas_timeline: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    scale_events: list[tuple[float, str, int, int]] = field(default_factory=list)
    conditions: list[tuple[float, str, str, str]] = field(default_factory=list)  # (t, pool, condition, reason)
    gpu_cost_usd: float = 0.0
    verifier_replicas: int = 1
    prompt_tokens: int = 0  # prompt tokens of the finished requests
    prefix_cached_tokens: int = 0  # ... of them found in the replica's prefix cache (not prefilled)
    # MEASURED in this process, on this machine's CPU (wall seconds, not simulated time): the
    # proposer's observe_step + propose over the run's steps (with the simulated sources' own
    # work), and the steps it ran; the simulated clock charges `VerifierModel.proposer_step_s`
    proposer_cpu_s: float = 0.0
    proposer_steps: int = 0

    def summary(self) -> dict[str, float | int]:
        lat, tpot = sorted(self.latencies_s), sorted(self.tpot_s)
        return {
            "requests": len(lat),
            "tokens": self.tokens,
            "throughput_tok_s": self.tokens / self.makespan_s if self.makespan_s else 0.0,
            "latency_p50_s": statistics.median(lat) if lat else 0.0,
            "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0,
            "ttft_p50_s": statistics.median(self.ttft_s) if self.ttft_s else 0.0,
            "tpot_p50_s": statistics.median(tpot) if tpot else 0.0,
            "tpot_p99_s": tpot[min(len(tpot) - 1, int(0.99 * len(tpot)))] if tpot else 0.0,
            "mean_accepted_per_step": self.accepted / self.spec_steps if self.spec_steps else 0.0,
            "draft_tokens": self.draft_tokens,
            "acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else 0.0,
            "steps_with_draft_fraction": self.steps_with_draft / self.passes if self.passes else 0.0,
            "verifier_step_s": self.verifier_busy_s / self.passes if self.passes else 0.0,
            "drafts_late": self.drafts_late,
            "rehomes": self.rehomes,
            "preemptions": self.preemptions,
            "rehomed_requests": len(self.rehomed_requests),
            "verifier_utilization": self.verifier_busy_s / (self.makespan_s * self.verifier_replicas)
            if self.makespan_s else 0.0,
            "scale_events": len(self.scale_events),
            "usd_per_million_tokens": self.gpu_cost_usd / self.tokens * 1e6 if self.tokens else 0.0,
            "prefix_cache_hit_fraction": self.prefix_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "proposer_cpu_ms_per_step": 1e3 * self.proposer_cpu_s / self.proposer_steps if self.proposer_steps else 0.0,
        }
