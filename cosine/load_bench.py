"""`cosine bench --concurrency 1,2,4,8` (closed loop) and `--request-rate R` (open loop): serving
under load, every system through the same batched coordinator, as ratios in one run.

Systems (equal resources: every system gets the same torch threads):
- `target-only`: the coordinator with no drafter: continuous batching, k = 0 (the vLLM-like
  baseline);
- `single-coder`: standard speculative decoding with the 0.5B drafter alone at a fixed k (the
  issue's fixed-k single-drafter baseline), batched verification;
- `cosine`: prompt lookup + routed drafter with adaptive k and load feedback, batched verification;
- `cosine-pipelined`: `cosine` with drafting on its own thread while the target verifies other
  requests (threads split between drafting and verification, same total);
- `cosine-solo-k`: `cosine` with k chosen as if each request had the verifier to itself (the
  ablation of the batch-aware cost: `Coordinator(batch_aware_k=False)`);
- `hf-assisted`: `transformers` assisted generation, one request at a time (it has no batching):
  run at concurrency 1 only.

Closed loop: `c` clients, each sending its next prompt when the last one finished. Open loop:
Poisson arrivals at `request_rate` requests/s. Each `results[]` row carries `concurrency` (or
`request_rate`), throughput (output tokens/s over the run's makespan), TPOT and end-to-end
latency p50/p99, acceptance, `verifier_idle_fraction`, identity with target-only, and ratios.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from cosine.bench import BenchConfig, _run_hf
from cosine.runtime.coordinator import Coordinator, GenerationRequest
from cosine.runtime.drafter import ModelDrafter
from cosine.runtime.models import ModelRunner
from cosine.runtime.ngram_drafter import NgramDrafter
from cosine.runtime.speculative_decoding import measure_cost_model, measure_pass_curve
from cosine.workloads import Prompt

log = logging.getLogger(__name__)

LOAD_SYSTEMS = ("target-only", "hf-assisted", "single-coder", "cosine", "cosine-pipelined", "cosine-solo-k")
FIXED_K = 4


@dataclass
class LoadRecord:
    """One request under load (seconds from the run's start, tokens)."""

    system: str
    concurrency: int | None
    request_rate: float | None
    prompt_id: str
    domain: str
    output_ids: list[int]
    start_s: float
    first_token_s: float | None
    end_s: float
    draft_tokens: int = 0
    accepted_tokens: int = 0
    num_drafts: int = 0

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        n = len(self.output_ids)
        if n < 2 or self.first_token_s is None:
            return None
        return (self.end_s - self.first_token_s) / (n - 1)


@dataclass
class RunSummary:
    system: str
    concurrency: int | None
    request_rate: float | None
    makespan_s: float
    verifier_idle_fraction: float | None
    drafter_idle_fraction: float | None = None
    records: list[LoadRecord] = field(default_factory=list)


def _coordinator(system: str, target: ModelRunner, drafter: ModelRunner, config: BenchConfig, cost,
                 curve=None) -> Coordinator:
    s = config.speculation
    if system == "target-only":
        return Coordinator(target, (), s, cost, max_running=16)
    if system == "single-coder":
        return Coordinator(target, [ModelDrafter(drafter, "coder")],
                           replace(s, adaptive=False, max_draft_tokens=FIXED_K, min_confidence=0.0), cost,
                           max_running=16)
    if system in ("cosine", "cosine-pipelined", "cosine-solo-k"):
        return Coordinator(target, [ModelDrafter(drafter, "coder")], s, cost, max_running=16,
                           lookup=NgramDrafter("lookup"), pipelined=system == "cosine-pipelined", pass_curve=curve,
                           batch_aware_k=system != "cosine-solo-k")
    raise ValueError(f"unknown load system {system!r}; choose from {list(LOAD_SYSTEMS)}")


async def _one(coord: Coordinator, system: str, prompt: Prompt, ids: list[int], max_tokens: int, t0: float,
               concurrency: int | None, rate: float | None) -> LoadRecord:
    start = time.perf_counter() - t0
    out: list[int] = []
    first = None
    rec = LoadRecord(system, concurrency, rate, prompt.id, prompt.domain, out, start, None, start)
    async for step in coord.generate(GenerationRequest(tuple(ids), max_tokens, domain=prompt.domain)):
        if first is None:
            first = time.perf_counter() - t0
        out.extend(step.token_ids)
        if step.num_draft_tokens:
            rec.num_drafts += 1
            rec.draft_tokens += step.num_draft_tokens
            rec.accepted_tokens += step.num_accepted
    rec.first_token_s, rec.end_s = first, time.perf_counter() - t0
    return rec


async def _closed_loop(coord, system, prompts, encoded, max_tokens, concurrency) -> tuple[list[LoadRecord], float]:
    queue = list(range(len(prompts)))
    records: list[LoadRecord] = []
    t0 = time.perf_counter()

    async def client():
        while queue:
            i = queue.pop(0)
            records.append(await _one(coord, system, prompts[i], encoded[i], max_tokens, t0, concurrency, None))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records, time.perf_counter() - t0


async def _open_loop(coord, system, prompts, encoded, max_tokens, rate, seed=0) -> tuple[list[LoadRecord], float]:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    tasks = []
    for i in range(len(prompts)):
        tasks.append(asyncio.create_task(_one(coord, system, prompts[i], encoded[i], max_tokens, t0, None, rate)))
        await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
    records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - t0


def run_load_bench(
    prompts: Sequence[Prompt],
    target: ModelRunner,
    drafter: ModelRunner,
    systems: Sequence[str],
    config: BenchConfig,
    *,
    concurrencies: Sequence[int] = (1, 2, 4, 8),
    request_rate: float | None = None,
) -> dict:
    """Run every system at every concurrency (or at one open-loop `request_rate`), greedy.

    Raises:
        ValueError: unknown system, no prompts, a concurrency < 1 or a rate <= 0.
    """
    unknown = [s for s in systems if s not in LOAD_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown} for a load run; choose from {list(LOAD_SYSTEMS)}")
    if not prompts:
        raise ValueError("the workload has no prompts")
    if any(c < 1 for c in concurrencies) or (request_rate is not None and request_rate <= 0):
        raise ValueError("concurrency must be >= 1 and request rate > 0")
    torch.set_num_threads(config.threads)
    encoded = [target.encode_prompt(p.messages()) for p in prompts]
    cost = measure_cost_model(target, drafter)
    curve = measure_pass_curve(target)
    log.info("pass curve (tokens, s): %s", [(n, round(t, 3)) for n, t in curve.points])
    ordered = ["target-only", *[s for s in systems if s != "target-only"]]
    levels: list[tuple[int | None, float | None]] = (
        [(None, request_rate)] if request_rate is not None else [(c, None) for c in concurrencies]
    )
    runs: list[RunSummary] = []
    for system in ordered:
        for concurrency, rate in levels:
            if system == "hf-assisted":
                if concurrency != 1:
                    continue
                runs.append(_hf_run(prompts, encoded, target, drafter, config))
                continue
            threads = config.threads
            if system == "cosine-pipelined":  # drafting thread + verifying thread share the cores
                threads = max(1, config.threads // 2)
            torch.set_num_threads(threads)
            coord = _coordinator(system, target, drafter, config, cost, curve)
            try:
                asyncio.run(_warm_up(coord, encoded[0][:16]))
                coord.reset_counters()  # count the measured run only
                if rate is not None:
                    records, makespan = asyncio.run(_open_loop(coord, system, prompts, encoded, config.max_tokens,
                                                               rate))
                else:
                    records, makespan = asyncio.run(_closed_loop(coord, system, prompts, encoded,
                                                                 config.max_tokens, concurrency))
            finally:
                coord.stop()
                torch.set_num_threads(config.threads)
            runs.append(RunSummary(system, concurrency, rate, makespan, coord.verifier_idle_fraction,
                                   coord.drafter_idle_fraction if system != "target-only" else None, records))
            log.info("%s c=%s rate=%s: %.1f s, idle %.2f", system, concurrency, rate, makespan,
                     coord.verifier_idle_fraction or 0.0)
    return {
        "config": {
            "mode": "open-loop" if request_rate is not None else "closed-loop",
            "target": target.name, "drafter": drafter.name, "systems": ordered, "max_tokens": config.max_tokens,
            "threads": config.threads, "dtype": config.dtype, "decoding": "greedy", "num_prompts": len(prompts),
            "concurrency": list(concurrencies) if request_rate is None else None, "request_rate": request_rate,
            "fixed_k": FIXED_K, "speculation": asdict(config.speculation),
        },
        "cost_model": asdict(cost),
        "pass_curve": [list(p) for p in curve.points],
        "results": aggregate_load(runs),
        "requests": [{**asdict(r), "latency_s": r.latency_s, "tpot_s": r.tpot_s} for run in runs for r in run.records],
    }


async def _warm_up(coord: Coordinator, ids: list[int]) -> None:
    async for _ in coord.generate(GenerationRequest(tuple(ids), 4)):
        pass


def _hf_run(prompts, encoded, target, drafter, config) -> RunSummary:
    t0 = time.perf_counter()
    records = []
    for p, ids in zip(prompts, encoded, strict=True):
        start = time.perf_counter() - t0
        r = _run_hf("hf-assisted", target, drafter, p, ids, config)
        end = time.perf_counter() - t0
        first = start + r.ttft_s if r.ttft_s is not None else None
        records.append(LoadRecord("hf-assisted", 1, None, p.id, p.domain, r.output_ids, start, first, end))
    return RunSummary("hf-assisted", 1, None, time.perf_counter() - t0, None, None, records)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def aggregate_load(runs: Sequence[RunSummary]) -> list[dict]:
    """Per system, load level and domain (plus "all"): throughput, latencies, acceptance, idle
    share, identity with target-only at the same level, ratios to target-only and to fixed-k
    single-drafter speculation at the same level. Per domain, throughput is output tokens over
    the summed request latencies (requests overlap, so there is no per-domain makespan)."""
    reference = {r.prompt_id: r.output_ids for run in runs if run.system == "target-only" for r in run.records}
    rows: list[dict] = []
    for run in runs:
        domains = ["all", *sorted({r.domain for r in run.records})]
        for domain in domains:
            rs = [r for r in run.records if domain in ("all", r.domain)]
            tokens = sum(len(r.output_ids) for r in rs)
            if domain == "all":
                tps = tokens / run.makespan_s if run.makespan_s else 0.0
            else:
                lat = sum(r.latency_s for r in rs)
                tps = tokens / lat if lat else 0.0
            drafts, drafted, accepted = (sum(r.num_drafts for r in rs), sum(r.draft_tokens for r in rs),
                                         sum(r.accepted_tokens for r in rs))
            lats = [r.latency_s for r in rs]
            tpots = [t for r in rs if (t := r.tpot_s) is not None]
            rows.append({
                "system": run.system, "domain": domain, "concurrency": run.concurrency,
                **({"request_rate": run.request_rate} if run.request_rate is not None else {}),
                "num_requests": len(rs), "output_tokens": tokens, "makespan_s": round(run.makespan_s, 3),
                "output_tokens_per_s": round(tps, 3),
                "tpot_ms_p50": round(1e3 * statistics.median(tpots), 1) if tpots else None,
                "latency_s_p50": round(_pct(lats, 0.5) or 0.0, 3), "latency_s_p99": round(_pct(lats, 0.99) or 0.0, 3),
                "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
                "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                "verifier_idle_fraction": (round(run.verifier_idle_fraction, 4)
                                           if run.verifier_idle_fraction is not None else None),
                "drafter_idle_fraction": (round(run.drafter_idle_fraction, 4)
                                          if run.drafter_idle_fraction is not None else None),
                "identical_to_target": all(r.output_ids == reference.get(r.prompt_id) for r in rs),
            })
    for row in rows:
        for base, key in (("target-only", "speedup_vs_target_only"), ("single-coder", "speedup_vs_single_fixed_k")):
            ref = next((r for r in rows if r["system"] == base and r["domain"] == row["domain"]
                        and r["concurrency"] == row["concurrency"]
                        and r.get("request_rate") == row.get("request_rate")), None)
            row[key] = (round(row["output_tokens_per_s"] / ref["output_tokens_per_s"], 3)
                        if ref and ref["output_tokens_per_s"] else None)
    return rows


def plot_load(report: dict, out) -> None:
    """Throughput and p50 latency vs concurrency, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["domain"] == "all" and r["concurrency"] is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in dict.fromkeys(r["system"] for r in rows):
        rs = sorted((r for r in rows if r["system"] == system), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        axes[0].plot(xs, [r["output_tokens_per_s"] for r in rs], marker="o", label=system)
        axes[1].plot(xs, [r["latency_s_p50"] for r in rs], marker="o", label=system)
    axes[0].set(xlabel="concurrency (closed loop)", ylabel="output tokens/s", title="throughput")
    axes[1].set(xlabel="concurrency (closed loop)", ylabel="seconds", title="end-to-end latency p50")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_xscale("log", base=2)
    axes[0].legend()
    cfg = report["config"]
    fig.suptitle(f"{cfg['target']} + {cfg['drafter']}, {cfg['dtype']}, {cfg['max_tokens']} new tokens, "
                 f"{cfg['threads']} threads")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
