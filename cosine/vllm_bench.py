"""`cosine bench --engine vllm`: CoSine on vLLM against vLLM's own speculation, same machine, same prompts.

Systems, each a real OpenAI server on this machine, driven through the official `openai` client
(streaming chat, greedy, the same prompts and `max_tokens`), closed loop at each concurrency level
(every client sends its next prompt when its last one finished):
- `vllm`: vLLM serving the target alone (the reference: ratios are to it);
- `vllm-ngram`: vLLM's prompt lookup (`method: ngram`, k = `--peer-k`);
- `vllm-draft`: vLLM's draft model (`method: draft_model`, the drafter model in-process, k = `--peer-k`);
- `cosine`: the embedded CoSine cluster (`cosine serve`): vLLM with CoSine's proposer, prompt lookup
  and the drafter pools of the manifest as separate gRPC processes;
- `cosine-lookup` (ablation): CoSine's proposer without pools (prompt lookup, suffix cache and the
  closed-loop k), i.e. what the drafting plane adds before any drafter pod.
The engine arguments (dtype, batch tokens, eager mode, KV cache size) are the same for all: they
come from the manifest's verifier spec. Servers run one at a time (their weights do not fit
together in RAM); because this machine's speed drifts, the reference runs first and again last,
and ratios use the mean of both runs (both are in the JSON).

Per system and level: output tokens/s, TPOT / TTFT / latency p50 and p99, acceptance length and
draft tokens per step (from vLLM's `vllm:spec_decode_*` counters), CoSine's drafts late and share
of steps with a draft (from its `cosine:` series), outputs identical to the reference, and
throughput per domain.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cosine import roles
from cosine.workloads import Prompt

log = logging.getLogger(__name__)

SYSTEMS = ("vllm", "vllm-ngram", "vllm-draft", "cosine", "cosine-lookup")
REFERENCE = "vllm"


@dataclass(frozen=True)
class Record:
    """One request: prompt id and domain, output text and tokens, wall times in seconds."""

    system: str
    run: int
    concurrency: int
    prompt_id: str
    domain: str
    text: str
    completion_tokens: int
    ttft_s: float
    latency_s: float

    @property
    def tpot_s(self) -> float | None:
        n = self.completion_tokens
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else None


def peer_command(system: str, manifest: Path | None, port: int, drafter_model: str, peer_k: int
                 ) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of a vLLM-only system's server, with the manifest's verifier engine arguments."""
    from cosine.runtime.model_store import resolve

    spec = roles.parse_spec(roles.load_manifest(manifest))
    args = roles.vllm_engine_args(spec.verifier, str(resolve(spec.verifier.model)), 0, [])
    if system == "vllm-ngram":
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": peer_k,
                                      "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    elif system == "vllm-draft":
        args["speculative_config"] = {"method": "draft_model", "model": str(resolve(drafter_model)),
                                      "num_speculative_tokens": peer_k}
    elif system != "vllm":
        raise ValueError(f"unknown vLLM system {system!r}")
    argv = [sys.executable, "-P", "-m", roles.VLLM_SERVER, *roles.cli_flags(args), "--host", "127.0.0.1",
            "--port", str(port), "--uvicorn-log-level", "warning"]
    return argv, {**os.environ, **roles.vllm_cpu_env(spec.verifier)}


class _Server:
    """A system's server for the duration of a `with` block (its process group is stopped after)."""

    def __init__(self, system: str, manifest: Path | None, drafter_model: str, peer_k: int, quiet: bool) -> None:
        self.system = system
        self.port = roles.free_port()
        self.metrics_port = roles.free_port() if system.startswith("cosine") else 0
        self.base = f"http://127.0.0.1:{self.port}"
        out = subprocess.DEVNULL if quiet else None
        if system == "cosine":
            cmd = [sys.executable, "-P", "-m", "cosine", "serve", "--port", str(self.port), "--metrics-port",
                   str(self.metrics_port)]
            if manifest:
                cmd += ["--cluster", str(manifest)]
            env = dict(os.environ)
        elif system == "cosine-lookup":
            cmd, env = roles.verifier_command(manifest, self.port, "127.0.0.1", [], None, self.metrics_port)
        else:
            cmd, env = peer_command(system, manifest, self.port, drafter_model, peer_k)
        self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True)

    def __enter__(self) -> _Server:
        try:
            roles.wait_ready(self.base, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        roles.stop_group(self.proc)

    def counters(self) -> dict[str, float]:
        from cosine.demo import spec_decode_counters

        out = spec_decode_counters(f"{self.base}/metrics", prefix="vllm:spec_decode_")
        if self.metrics_port:
            out.update(spec_decode_counters(f"http://127.0.0.1:{self.metrics_port}/metrics", prefix="cosine:"))
        return out


async def _closed_loop(base: str, model: str, prompts: Sequence[Prompt], concurrency: int, max_tokens: int,
                       system: str, run: int) -> list[Record]:
    """`concurrency` clients, each sending the next prompt when its previous answer ended (streamed,
    greedy: `demo.ask`, one thread per client; the OpenAI client is thread-safe)."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from cosine.demo import ask

    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=1800)
    queue: asyncio.Queue[Prompt] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    records: list[Record] = []
    loop = asyncio.get_running_loop()
    threads = ThreadPoolExecutor(max_workers=concurrency)  # asyncio's default pool would cap the load

    async def worker() -> None:
        while not queue.empty():
            p = queue.get_nowait()
            a = await loop.run_in_executor(threads, ask, client, model, p, max_tokens)
            records.append(Record(system, run, concurrency, p.id, p.domain, a.text, a.completion_tokens,
                                  a.ttft_s, a.wall_s))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    threads.shutdown()
    client.close()
    return records


def _pct(values: Sequence[float], q: float) -> float | None:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))] if v else None


def summarize(records: Sequence[Record], wall_s: float, counters: dict[str, float]) -> dict[str, Any]:
    """One (system, run, level) row: throughput, latency percentiles and speculation counters."""
    tokens = sum(r.completion_tokens for r in records)
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    drafts = counters.get("vllm:spec_decode_num_drafts_total", 0.0)
    drafted = counters.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    steps = counters.get("cosine:verifier_steps_total", 0.0)
    domains = sorted({r.domain for r in records})
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "tpot_ms_p50": (_pct(tpots, 0.5) or 0) * 1e3 if tpots else None,
        "ttft_s_p50": _pct([r.ttft_s for r in records], 0.5),
        "latency_s_p50": _pct([r.latency_s for r in records], 0.5),
        "latency_s_p99": _pct([r.latency_s for r in records], 0.99),
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_tokens": drafted,
        "drafts_late": sum(v for k, v in counters.items() if k.startswith("cosine:spec_decode_drafts_late")),
        "steps_with_draft_fraction": (counters.get("cosine:verifier_steps_with_draft_total", 0.0) / steps
                                      if steps else None),
        "per_domain_tokens_per_s": {
            d: sum(r.completion_tokens for r in records if r.domain == d)
            / max(1e-9, sum(r.latency_s for r in records if r.domain == d)) for d in domains},
    }


def run_bench(prompts: Sequence[Prompt], systems: Sequence[str], concurrencies: Sequence[int], max_tokens: int,
              manifest: Path | None, drafter_model: str, peer_k: int = 4, quiet: bool = True,
              workload: str = "") -> dict[str, Any]:
    """Every system at every level (see the module docstring); the reference runs first and last.

    Raises:
        ValueError: an unknown system.
        RuntimeError: a server that does not start.
    """
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; choose among {list(SYSTEMS)}")
    spec = roles.parse_spec(roles.load_manifest(manifest))
    model = spec.verifier.model
    order = [REFERENCE, *[s for s in systems if s != REFERENCE], REFERENCE]
    rows: list[dict[str, Any]] = []
    records: list[Record] = []
    for run, system in enumerate(order):
        log.info("bench: starting %s", system)
        with _Server(system, manifest, drafter_model, peer_k, quiet) as server:
            # warm-up: one short request (first-request overheads are not the system's speed)
            asyncio.run(_closed_loop(server.base, model, list(prompts)[:1], 1, 8, system, -1))
            for c in concurrencies:
                before = server.counters()
                t0 = time.perf_counter()
                recs = asyncio.run(_closed_loop(server.base, model, prompts, c, max_tokens, system, run))
                wall = time.perf_counter() - t0
                after = server.counters()
                delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                if system.startswith("cosine"):  # gauges are not deltas
                    delta.update({k: v for k, v in after.items() if "rtt" in k})
                row = {"system": system, "run": run, "concurrency": c, **summarize(recs, wall, delta)}
                rows.append(row)
                records.extend(recs)
                log.info("bench: %s c=%d: %.2f tok/s", system, c, row["output_tokens_per_s"] or 0)
    _add_ratios(rows, records)
    return {"workload": workload, "max_tokens": max_tokens, "systems": list(systems),
            "concurrency": list(concurrencies), "model": model, "rows": rows,
            "records": [asdict(r) for r in records]}


def _add_ratios(rows: list[dict[str, Any]], records: Sequence[Record]) -> None:
    """Ratios to the mean of the reference's runs at the same level; outputs identical to its first run."""
    ref_text = {(r.concurrency, r.prompt_id): r.text for r in records if r.system == REFERENCE and r.run == 0}
    for row in rows:
        c = row["concurrency"]
        refs = [r for r in rows if r["system"] == REFERENCE and r["concurrency"] == c]
        ref_tps = statistics.mean(r["output_tokens_per_s"] for r in refs)
        row["speedup_vs_vllm"] = row["output_tokens_per_s"] / ref_tps if ref_tps else None
        per_domain = {}
        for d, v in row["per_domain_tokens_per_s"].items():
            ref_d = statistics.mean(r["per_domain_tokens_per_s"].get(d, 0.0) for r in refs)
            per_domain[d] = v / ref_d if ref_d else None
        row["per_domain_speedup_vs_vllm"] = per_domain
        mine = [r for r in records if r.system == row["system"] and r.run == row["run"] and r.concurrency == c]
        row["identical_to_vllm"] = sum(ref_text.get((c, r.prompt_id)) == r.text for r in mine)
    for c in {r["concurrency"] for r in rows}:
        peers = [r["output_tokens_per_s"] for r in rows if r["concurrency"] == c
                 and r["system"] in ("vllm-ngram", "vllm-draft")]
        for row in rows:
            if row["concurrency"] == c and peers:
                row["speedup_vs_best_vllm_speculation"] = row["output_tokens_per_s"] / max(peers)


def format_table(report: dict[str, Any]) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = [f"{'system':>11} {'run':>3} {'c':>2} {'tok/s':>6} {'x vllm':>6} {'x best spec':>11} {'TPOT ms':>7} "
             f"{'TTFT s':>6} {'p50 s':>6} {'p99 s':>6} {'acc.len':>7} {'late':>5} {'w/draft':>7} identical"]
    for r in report["rows"]:
        lines.append(
            f"{r['system']:>11} {r['run']:>3} {r['concurrency']:>2} {f(r['output_tokens_per_s']):>6} "
            f"{f(r['speedup_vs_vllm']):>6} {f(r.get('speedup_vs_best_vllm_speculation')):>11} "
            f"{f(r['tpot_ms_p50']):>7} {f(r['ttft_s_p50']):>6} {f(r['latency_s_p50']):>6} "
            f"{f(r['latency_s_p99']):>6} {f(r['mean_acceptance_length']):>7} {f(r['drafts_late']):>5} "
            f"{f(r['steps_with_draft_fraction']):>7} {r['identical_to_vllm']}/{r['requests']}")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))


def plot(report: dict[str, Any], out: Path) -> None:
    """Throughput vs concurrency per system (reference runs averaged) and ratio to vLLM."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for system in dict.fromkeys(r["system"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["system"] == system]
        levels = sorted({r["concurrency"] for r in rows})
        tps = [statistics.mean(r["output_tokens_per_s"] for r in rows if r["concurrency"] == c) for c in levels]
        ratio = [statistics.mean(r["speedup_vs_vllm"] for r in rows if r["concurrency"] == c) for c in levels]
        a.plot(levels, tps, marker="o", label=system)
        b.plot(levels, ratio, marker="o", label=system)
    a.set_xlabel("concurrency")
    a.set_ylabel("output tokens/s")
    b.set_xlabel("concurrency")
    b.set_ylabel("x vLLM target-only")
    b.axhline(1.0, color="grey", lw=0.8)
    a.legend()
    fig.suptitle(f"{report['model']} on {report['workload']}, max_tokens {report['max_tokens']}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
