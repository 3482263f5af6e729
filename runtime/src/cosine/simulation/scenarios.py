"""The studies `cosine simulate` runs: validation against a recorded `cosine bench` run, the paper's testbed, where
disaggregated drafting pays (RTT x speed ratio), and the autoscaler at scale.

Each returns a JSON-able dict; `plots` draws them.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from pathlib import Path
from typing import Any

from cosine_spec.autoscaling import PoolLimits, ScalingPolicy

from cosine.routing import DOMAINS
from cosine.simulation import calibration, config
from cosine.simulation.cluster import (
    RequestSpec,
    SimResult,
    SimSetup,
    Workload,
    poisson_requests,
    simulate,
)
from cosine.simulation.cost_models import Profiles, load_profiles

# The paper's headline figures (Gao et al., arXiv:2503.10325, abstract and §6).
PAPER = {"latency_reduction": 0.232, "throughput_gain": 0.325}


# ------------------------------------------------------------------ validation on this machine
VALIDATED = ("vllm", "cosine-lookup", "cosine")


def bench_workload(bench: dict[str, Any], system: str, concurrency: int) -> tuple[RequestSpec, ...]:
    """The requests of one bench row, in the order it sent them: prompt tokens (counted with the
    target's tokenizer, `<bench>.meta.json`), the output tokens each produced, its domain."""
    return tuple(RequestSpec(0.0, int(bench["prompt_tokens"][x["prompt_id"]]), int(x["completion_tokens"]), x["domain"])
                 for x in calibration.records(bench, system, concurrency))


def validation(bench_json: Path, systems: tuple[str, ...] = VALIDATED, seeds: int = 5) -> dict[str, Any]:
    """Replay a recorded `cosine bench` run: each system calibrated on its concurrency-1 row
    (`calibration.calibrate`), then simulated at every concurrency of the run with the row's own
    requests (closed loop), output tokens/s averaged over `seeds` seeds. Concurrency 1 is
    in-sample (the calibration's own run), higher levels out of sample. `measured_tok_s` is the
    system's first run at the level; `measured_runs_tok_s` every run (the reference runs twice)."""
    bench = calibration.load_bench(bench_json)
    domains = tuple(sorted({x["domain"] for x in bench["records"]}))
    rows = []
    for system in systems:
        cal = calibration.calibrate(bench, system, 1)
        for c in bench["concurrency"]:
            reqs = bench_workload(bench, system, c)
            runs = [simulate(calibration.sim_setup(cal, domains, seed=i), Workload(reqs, c)).summary()
                    for i in range(seeds)]
            sim = statistics.mean(float(r["throughput_tok_s"]) for r in runs)
            measured = calibration.row(bench, system, c)
            rows.append({
                "system": system, "concurrency": c, "in_sample": c == 1,
                "measured_tok_s": measured["output_tokens_per_s"],
                "measured_runs_tok_s": [r["output_tokens_per_s"] for r in bench["rows"]
                                        if r["system"] == system and r["concurrency"] == c],
                "simulated_tok_s": sim, "error": sim / measured["output_tokens_per_s"] - 1,
                "measured_ttft_p50_s": measured["ttft_s_p50"],
                "simulated_ttft_p50_s": statistics.mean(float(r["ttft_p50_s"]) for r in runs),
                "measured_latency_p50_s": measured["latency_s_p50"],
                "simulated_latency_p50_s": statistics.mean(float(r["latency_p50_s"]) for r in runs),
            })
    return {"bench": str(bench_json), "command": bench["command"], "rows": rows,
            "calibration": {s: dataclasses.asdict(calibration.calibrate(bench, s, 1)) for s in systems}}


# ------------------------------------------------------------------ the paper's testbed
PAIRS = {
    "llama-70b": {"verifier": ("deepseek-r1-distill-llama-70b", "a100-80gb", 4),
                  "drafter": ("llama-68m", "rtx-4090"), "acceptance": "llama-68m"},
    "qwen-32b": {"verifier": ("deepseek-r1-distill-qwen-32b", "a100-80gb", 2),
                 "drafter": ("qwen2.5-0.5b", "l4"), "acceptance": "qwen2.5-0.5b"},
}


def _pair_manifest(pair: str, mode: str, specialists: bool = True) -> dict[str, Any]:
    """The paper's testbed for one pair as a manifest. `specialists`: CoSine's pools get the
    specialist acceptance profile on their domains (assumed, `profiles.yaml`); False gives them
    the generic drafter's, so only the architecture differs from a co-located drafter."""
    p = PAIRS[pair]
    vm, vhw, gpus = p["verifier"]
    dm, dhw = p["drafter"]
    spec_key = f"{p['acceptance']}-specialist" if specialists else p["acceptance"]
    pools = [{"name": n, "model": dm, "expertise": e, "replicas": 1, "minReplicas": 1, "maxReplicas": 8}
             for n, e in (("code", ["code", "edit"]), ("math", ["math"]), ("chat", ["chat"]))]
    sim_pools = {q["name"]: {"hardware": dhw, "slots": 16, "model": dm,
                             "acceptance": spec_key if mode == "cosine" else p["acceptance"]} for q in pools}
    return {
        "spec": {"verifier": {"model": vm, "maxBatchTokens": 2048, "maxNumSeqs": 256}, "drafterPools": pools,
                 "speculation": {"maxDraftLen": 8}, "autoscaling": {"enabled": False}},
        "simulation": {"mode": mode, "verifier": {"hardware": vhw, "gpus": gpus}, "pools": sim_pools,
                       "network": {"rttMs": 1.0, "bandwidthGbps": 10}, "maxDrafters": 2},
    }


def _cost_per_hour(setup: SimSetup) -> float:
    v = setup.verifier.price_per_hour_usd * setup.verifier.replicas
    return v + (sum(p.price_per_hour_usd * p.replicas for p in setup.pools) if setup.mode == "cosine" else 0.0)


def _lookup_setup(target_only: SimSetup, bench_json: Path | None) -> SimSetup:
    """Suffix-style lookup on the verifier alone (vLLM's `ngram`/`suffix` methods; CoSine without
    pools): its hit rate, draft length and per-token acceptance are those measured for
    `cosine-lookup` in the kept bench run (our CPU workloads with the 1.5B coder: an assumption
    for the paper's models and prompts)."""
    from cosine.simulation.cluster import LOOKUP, LookupModel
    from cosine.simulation.cost_models import AcceptanceModel

    cal = calibration.calibrate(calibration.load_bench(bench_json or calibration.KEPT_BENCH), "cosine-lookup", 1)
    acceptance = AcceptanceModel({(LOOKUP, d): cal.lookup_alpha for d in DOMAINS}, {LOOKUP: 8.0})
    return dataclasses.replace(target_only, mode="cosine", pools=(), acceptance=acceptance,
                               lookup=LookupModel(cal.lookup_hit_rate, cal.lookup_draft_tokens))


PAPER_SYSTEMS = ("target-only", "vanilla", "lookup", "cosine", "cosine-equal-acceptance")


def paper_testbed(profiles: Profiles | None = None, low_rate: float = 1.0, high_concurrency: int = 16,
                  saturation_concurrency: int = 96, requests: int = 96, seed: int = 0,
                  bench_json: Path | None = None) -> dict[str, Any]:
    """Latency at low load (Poisson `low_rate` req/s, 120 s) and throughput closed-loop at
    `high_concurrency` (and at `saturation_concurrency`), 256 in / 128 out, for each of
    `PAPER_SYSTEMS`: target-only; `vanilla` (a co-located draft model, vLLM's `draft_model`);
    `lookup` (suffix-style lookup on the verifier, `_lookup_setup`); `cosine` as the paper argues
    it (specialist pools with an assumed acceptance edge on their domains); and
    `cosine-equal-acceptance` (the same pools with the generic drafter's acceptance: the gain of
    the architecture alone). Ratios to target-only, and per dollar to the best baseline (the
    speculative baseline with the most tokens/s per dollar)."""
    profiles = profiles or load_profiles()
    rng = random.Random(seed)
    closed = tuple(RequestSpec(0.0, 256, 128, rng.choice(DOMAINS)) for _ in range(requests))
    open_loop = poisson_requests(low_rate, 120.0, 256, 128, DOMAINS, seed)
    table: dict[str, Any] = {}
    for pair in PAIRS:
        setups = {mode: config.build_setup(_pair_manifest(pair, mode), profiles, seed=seed)[0]
                  for mode in ("target-only", "vanilla", "cosine")}
        setups["lookup"] = _lookup_setup(setups["target-only"], bench_json)
        setups["cosine-equal-acceptance"] = config.build_setup(_pair_manifest(pair, "cosine", specialists=False),
                                                               profiles, seed=seed)[0]
        rows: dict[str, Any] = {}
        for system in PAPER_SYSTEMS:
            setup = setups[system]
            lat = simulate(setup, Workload(open_loop)).summary()
            thr = simulate(setup, Workload(closed, high_concurrency)).summary()
            sat = simulate(setup, Workload(closed, saturation_concurrency)).summary()
            usd_h = _cost_per_hour(setup)
            rows[system] = {"latency_p50_s": lat["latency_p50_s"], "throughput_tok_s": thr["throughput_tok_s"],
                            "saturated_tok_s": sat["throughput_tok_s"],
                            "usd_per_hour": usd_h, "tok_s_per_usd_h": float(thr["throughput_tok_s"]) / usd_h,
                            "mean_accepted_per_step": thr["mean_accepted_per_step"]}
        base = rows["target-only"]
        best = max(("vanilla", "lookup"), key=lambda m: float(rows[m]["tok_s_per_usd_h"]))
        rows["ratios"] = {}
        for system in ("cosine", "cosine-equal-acceptance"):
            co = rows[system]
            rows["ratios"][system] = {
                "latency_vs_target_only": float(co["latency_p50_s"]) / float(base["latency_p50_s"]) - 1,
                "throughput_vs_target_only": float(co["throughput_tok_s"]) / float(base["throughput_tok_s"]) - 1,
                "throughput_per_usd_vs_target_only": co["tok_s_per_usd_h"] / base["tok_s_per_usd_h"] - 1,
                "best_baseline": best,
                "latency_vs_best_baseline": float(co["latency_p50_s"]) / float(rows[best]["latency_p50_s"]) - 1,
                "throughput_per_usd_vs_best_baseline": co["tok_s_per_usd_h"] / rows[best]["tok_s_per_usd_h"] - 1,
            }
        table[pair] = rows
    return {"paper": PAPER, "pairs": table}


# ------------------------------------------------------------------ where disaggregation pays
def rtt_sweep(profiles: Profiles | None = None, rtts_ms: tuple[float, ...] = (0.1, 1, 5, 20, 50),
              speed_ratios: tuple[float, ...] = (0.02, 0.05, 0.1, 0.3), rates: tuple[float, ...] = (0.5, 4.0),
              duration_s: float = 60.0, seed: int = 0) -> dict[str, Any]:
    """p50 latency of remote drafting (cosine) vs co-located (vanilla) vs target-only, over RTT,
    drafter/verifier per-token time ratio t_d/t_v and load; with the closed-form server capacity
    gain 1 + gamma * t_d / t_v (gamma = draft length) that offloading drafting frees."""
    profiles = profiles or load_profiles()
    base, _ = config.build_setup(_pair_manifest("llama-70b", "cosine"), profiles, seed=seed)
    t_v = base.verifier.pass_s(1, 384)
    gamma = base.speculation.max_draft_len
    cells = []
    for rate in rates:
        reqs = poisson_requests(rate, duration_s, 256, 128, DOMAINS, seed)
        ref = {m: simulate(dataclasses.replace(base, mode="target-only"), Workload(reqs)).summary()
               for m in ("target-only",)}
        for ratio in speed_ratios:
            t_d = ratio * t_v
            pools = tuple(dataclasses.replace(p, draft_token_s=t_d) for p in base.pools)
            vanilla = dataclasses.replace(base, mode="vanilla", pools=pools,
                                          verifier=dataclasses.replace(base.verifier,
                                                                       colocated_draft_s=lambda b, t=t_d: t))
            van = simulate(vanilla, Workload(reqs)).summary()
            for rtt in rtts_ms:
                remote = dataclasses.replace(base, pools=tuple(dataclasses.replace(p, rtt_s=rtt / 1000) for p in pools))
                co = simulate(remote, Workload(reqs)).summary()
                lat = {"target-only": ref["target-only"]["latency_p50_s"], "vanilla": van["latency_p50_s"],
                       "cosine": co["latency_p50_s"]}
                cells.append({"rate": rate, "speed_ratio": ratio, "rtt_ms": rtt, "latency_p50_s": lat,
                              "best": min(lat, key=lambda k: float(lat[k])),
                              "closed_form_capacity": 1 + gamma * ratio})
    return {"t_v_s": t_v, "gamma": gamma, "cells": cells}


# ------------------------------------------------------------------ the autoscaler at scale
def _rate_trace(rate_at: Any, duration_s: float, prompt: int, output: int, seed: int) -> tuple[RequestSpec, ...]:
    """Non-homogeneous Poisson arrivals by thinning (Lewis & Shedler 1979)."""
    rng, t, out = random.Random(seed), 0.0, []
    peak = max(rate_at(x) for x in range(0, int(duration_s) + 1, 10))
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return tuple(out)
        if rng.random() < rate_at(t) / peak:
            out.append(RequestSpec(t, prompt, output, rng.choice(DOMAINS)))


def _step_manifest(gpu: tuple[int, int, int], cpu: tuple[int, int, int], autoscaled: bool,
                   token_value_per_million_usd: float) -> dict[str, Any]:
    """A GPU verifier (DeepSeek-R1-Distill-Qwen-32B on 2x A100, 2 replicas) with two pools of
    Qwen2.5-0.5B drafters: `gpu` on L4s (4 requests at once per replica) and `cpu` on CPU nodes
    (one at a time); each pool `(replicas, minReplicas, maxReplicas)`."""
    m = _pair_manifest("qwen-32b", "cosine")
    pools = []
    for name, (n, lo, hi), hardware, slots in (("gpu", gpu, "l4", 4), ("cpu", cpu, "cpu-node", 1)):
        pools.append({"name": name, "model": "qwen2.5-0.5b", "expertise": ["code", "math", "chat", "edit"],
                      "replicas": n, "minReplicas": lo, "maxReplicas": hi})
        m["simulation"]["pools"][name] = {"hardware": hardware, "slots": slots, "model": "qwen2.5-0.5b",
                                          "acceptance": "qwen2.5-0.5b"}
    for gone in ("code", "math", "chat"):
        m["simulation"]["pools"].pop(gone, None)
    m["spec"]["drafterPools"] = pools
    m["spec"]["verifier"]["replicas"] = 2
    m["spec"]["autoscaling"] = {"enabled": autoscaled, "intervalSeconds": 30, "stabilizationSeconds": 120,
                                "maxScaleDownStep": 2, "acceptedTokenValuePerMillionUsd": token_value_per_million_usd}
    return m


def autoscale_step(profiles: Profiles | None = None, phase_s: float = 240.0, rates: tuple[float, ...] = (2, 12, 4),
                   fixed_gpu: tuple[int, ...] = (1, 2, 3, 4, 6), token_value_per_million_usd: float = 5.0,
                   seed: int = 0) -> dict[str, Any]:
    """The autoscaler under a load step, against the best fixed size.

    A GPU verifier with a GPU pool that starts at zero (`minReplicas` 0) and a CPU pool (see
    `_step_manifest`); Poisson load stepping through `rates` (req/s, `phase_s` each). The rule
    (`cosine_spec.autoscaling.desired_replicas`, prices from `profiles.yaml`, accepted tokens
    valued at `token_value_per_million_usd`) against every fixed size of the GPU pool in
    `fixed_gpu` (the CPU pool at 1), all on the same requests. Reports goodput per dollar (output
    tokens per USD of GPU and node time), the rule's ratio to the best fixed size, decisions to
    settle after each step, flaps, the conditions the rule raised and the replica timelines."""
    profiles = profiles or load_profiles()
    total_s = phase_s * len(rates)
    reqs = _rate_trace(lambda t: rates[min(len(rates) - 1, int(t // phase_s))], total_s, 256, 64, seed)

    def run(m: dict[str, Any]) -> tuple[SimResult, Any]:
        setup, _ = config.build_setup(m, profiles, seed=seed)
        return simulate(setup, Workload(reqs), duration_s=total_s), setup

    fixed = {}
    for n in fixed_gpu:
        res, _ = run(_step_manifest((n, n, n), (1, 1, 1), False, token_value_per_million_usd))
        fixed[n] = res.summary() | {"tokens_per_usd": res.tokens / res.gpu_cost_usd}
    best = max(fixed, key=lambda n: fixed[n]["tokens_per_usd"])
    res, setup = run(_step_manifest((0, 0, 8), (1, 1, 8), True, token_value_per_million_usd))
    assert setup.scaling is not None
    rule = res.summary() | {"tokens_per_usd": res.tokens / res.gpu_cost_usd}
    figures = _scaling_figures(res, setup.scaling, setup.interval_s, phase_s, len(rates))
    conditions: dict[str, dict[str, Any]] = {}
    for t, pool, cond, reason in res.conditions:
        conditions.setdefault(f"{pool}:{cond}", {"first_s": t, "count": 0, "reason": reason})["count"] += 1
    gpu_tl = res.replicas_timeline["gpu"]
    return {"rates": list(rates), "phase_s": phase_s, "fixed": fixed, "best_fixed_gpu_replicas": best,
            "rule": rule, "tokens_per_usd_vs_best_fixed": rule["tokens_per_usd"] / fixed[best]["tokens_per_usd"],
            "conditions": conditions, "zero_pool_returned_s": next((t for t, n in gpu_tl if n > 0), None),
            "timeline": res.replicas_timeline, **figures}


def _scaling_figures(res: SimResult, policy: ScalingPolicy, interval_s: float, phase_s: float,
                     phases: int) -> dict[str, Any]:
    limits = {p.name: p for p in policy.pools}
    flaps, violations, convergence = 0, 0, []
    for name, tl in res.replicas_timeline.items():
        lim: PoolLimits = limits[name]
        dirs = [1 if b[1] > a[1] else -1 for a, b in zip(tl, tl[1:], strict=False) if b[1] != a[1]]
        flaps += sum(1 for a, b in zip(dirs, dirs[1:], strict=False) if a != b)
        violations += sum(1 for _, n in tl if not lim.min_replicas <= n <= lim.max_replicas)
        violations += sum(1 for a, b in zip(tl, tl[1:], strict=False) if a[1] - b[1] > policy.max_scale_down_step)
        for ph in range(phases):
            start, end = ph * phase_s, (ph + 1) * phase_s
            inside = [(t, n) for t, n in tl if start <= t < end]
            before = [n for t, n in tl if t < start]
            final = inside[-1][1] if inside else (before[-1] if before else tl[0][1])
            settle = start
            for t, n in inside:
                if abs(n - final) > 1:
                    settle = t
            convergence.append((settle - start) / interval_s)
    return {"flaps": flaps, "bound_violations": violations, "convergence_intervals_max": max(convergence),
            "convergence_intervals_mean": sum(convergence) / len(convergence),
            "peak_replicas": {n: max(x for _, x in tl) for n, tl in res.replicas_timeline.items()}}
