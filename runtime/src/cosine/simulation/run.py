"""What `cosine simulate` does: read a manifest and a workload, simulate, optionally run the studies
(`scenarios`), return one JSON-able dict."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from cosine.routing import DOMAINS
from cosine.simulation import calibration, config, scenarios
from cosine.simulation.cluster import RequestSpec, Workload, poisson_requests, simulate

STUDIES = ("validation", "paper", "spot", "affinity", "rtt", "autoscale")


def read_trace(path: Path) -> tuple[RequestSpec, ...]:
    """A trace, JSONL: {"t": s, "prompt_tokens": n, "output_tokens": n, "domain": ...} per request."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.append(RequestSpec(float(r["t"]), int(r["prompt_tokens"]), int(r["output_tokens"]),
                                   str(r.get("domain", "chat"))))
    return tuple(sorted(out, key=lambda r: r.arrival_s))


def read_workload(path: Path) -> list[tuple[int, str]]:
    """A workload JSONL ({"domain", "prompt"}): (prompt tokens ~ chars / 3.5, domain) per prompt."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [(max(1, int(len(json.dumps(r["prompt"]) if not isinstance(r["prompt"], str) else r["prompt"]) / 3.5)),
             str(r.get("domain", "chat"))) for r in rows]


def run_simulate(cluster: Path | None, workload: Path | None = None, trace: Path | None = None,
                 duration_s: float | None = None, request_rate: float | None = None,
                 concurrency: int | None = None, mode: str | None = None, studies: tuple[str, ...] = (),
                 seed: int = 0) -> dict[str, Any]:
    obj = config.load_cluster(cluster)
    setup, w = config.build_setup(obj, mode=mode, seed=seed)
    duration = duration_s or w.duration_s
    if trace is not None:
        reqs = read_trace(trace)
    elif workload is not None:
        prompts = read_workload(workload)
        rng = random.Random(seed)
        base = poisson_requests(request_rate or w.request_rate, duration, 1, 1, DOMAINS, seed)
        reqs = tuple(RequestSpec(r.arrival_s, n, w.output_tokens, dom)
                     for r in base for n, dom in [rng.choice(prompts)])
    else:
        reqs = poisson_requests(request_rate or w.request_rate, duration, w.prompt_tokens, w.output_tokens,
                                DOMAINS, seed)
    if concurrency:
        reqs = tuple(RequestSpec(0.0, r.prompt_tokens, r.output_tokens, r.domain) for r in reqs)
    res = simulate(setup, Workload(reqs, concurrency), None if concurrency else duration)
    out: dict[str, Any] = {"run": {"mode": setup.mode, **res.summary(), "timeline": res.replicas_timeline,
                                   "scale_log": res.scale_events}}
    if "validation" in studies:
        out["validation"] = scenarios.validation(calibration.KEPT_BENCH)
    if "paper" in studies:
        out["paper_testbed"] = scenarios.paper_testbed(seed=seed)
    if "spot" in studies:
        out["spot"] = scenarios.spot_study(seed=seed)
    if "affinity" in studies:
        out["affinity"] = scenarios.affinity_study(seed=seed, seen_hit_factor=scenarios.SEEN_HIT_FACTOR)
    if "rtt" in studies:
        out["rtt_sweep"] = scenarios.rtt_sweep(seed=seed)
    if "autoscale" in studies:
        out["autoscale"] = scenarios.autoscale_step(seed=seed)
    return out

