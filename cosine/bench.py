"""`cosine bench`: every system on the same prompts in one run, as ratios to target-only.

Systems:
- `target-only`: our runtime, no speculation (k = 0), KV cache, one token per target pass;
- `hf-generate`: plain `transformers` `generate` (greedy) on the same weights;
- `hf-assisted`: `transformers` assisted generation with the same drafter (the peer to beat);
- `single-coder`, `single-smollm2`, `single-ngram`: standard speculative decoding with one drafter
  alone (adaptive speculation length, acceptance carried across requests): the same-tokenizer
  0.5B model, the cross-tokenizer SmolLM2-135M (point-mass drafts translated through text), and
  model-free prompt lookup with the suffix cache;
- `cosine-routing`: collaborative drafting without fusion: each request routed to one model pool
  by expertise and measured acceptance (re-routed as it runs), prompt lookup first at each step;
- `cosine`: routing + fusion: the two best routed pools and prompt lookup draft every step, their
  drafts are fused by confidence into a token tree and verified in one pass;
- `cosine-cluster`: the deployment path: `cosine serve` in child processes (drafter and verifier
  processes over gRPC, one torch thread each, per the default manifest), prompts sent over HTTP
  with the OpenAI client; identity is checked on the text.

Each request records its output token ids, wall time, TTFT and draft/accept counters; results are
aggregated per system and domain (plus `"all"`) into `results[]` objects with the fields named in
issue #2, written as JSON with the raw per-request records, and drawn as a PNG.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from cosine.runtime.drafter import ModelDrafter
from cosine.runtime.models import ModelRunner
from cosine.runtime.ngram_drafter import NgramDrafter
from cosine.runtime.speculation_control import CostModel, SpeculationSettings, initial_state
from cosine.runtime.speculative_decoding import (
    GenerationResult,
    GenerationStats,
    generate_stream,
    measure_cost_model,
)
from cosine.workloads import Prompt

log = logging.getLogger(__name__)

SYSTEMS = (
    "target-only", "hf-generate", "hf-assisted", "single-coder", "single-smollm2", "single-ngram", "cosine-routing",
    "cosine", "cosine-cluster",
)
SINGLE_PREFIX = "single-"
EXPERTISE = {"coder": ("code", "math", "edit"), "smollm2": ("chat",)}


@dataclass
class RequestRecord:
    """One request of one system (seconds, tokens)."""

    system: str
    prompt_id: str
    domain: str
    prompt_tokens: int
    output_ids: list[int]
    wall_s: float
    ttft_s: float | None
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    output_text: str = ""
    http_tokens: int = 0  # tokens reported by the server, when only text came back (cosine-cluster)
    route: list[str] = field(default_factory=list)  # pools in routed order (collaborative systems)
    accepted_by: dict[str, int] = field(default_factory=dict)  # accepted draft tokens per drafter
    tree_steps: int = 0  # verifications of a fused token tree
    draft_lens: list[int] = field(default_factory=list)  # draft tokens (tree nodes) per verification

    @property
    def num_tokens(self) -> int:
        return len(self.output_ids) or self.http_tokens

    @property
    def tpot_s(self) -> float | None:
        n = self.num_tokens
        if n < 2 or self.ttft_s is None:
            return None
        return (self.wall_s - self.ttft_s) / (n - 1)


@dataclass
class BenchConfig:
    max_tokens: int = 64
    dtype: str = "float32"
    threads: int = os.cpu_count() or 1
    speculation: SpeculationSettings = SpeculationSettings()
    tree_budget: int = 16


Runner = Callable[[Prompt, list[int]], RequestRecord]


def run_bench(
    prompts: Sequence[Prompt],
    target: ModelRunner,
    drafter: ModelRunner,
    systems: Sequence[str],
    config: BenchConfig,
    *,
    cross_drafter: ModelRunner | None = None,
    progress: bool = True,
) -> dict:
    """Run `systems` over `prompts` (greedy) and return the JSON-ready report.

    `drafter` shares the target's tokenizer; `cross_drafter` (needed by `single-smollm2` and the
    collaborative systems) has its own and drafts through text.

    Raises:
        ValueError: unknown system name, no prompts, or a system needing `cross_drafter` without it.
    """
    from cosine.runtime.collaborative import CollaborativeDrafters
    from cosine.runtime.cross_tokenizer_drafter import CrossTokenizerDrafter

    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    if not prompts:
        raise ValueError("the workload has no prompts")
    needs_cross = [s for s in systems if s in ("single-smollm2", "cosine-routing", "cosine")]
    if needs_cross and cross_drafter is None:
        raise ValueError(f"systems {needs_cross} need a cross-tokenizer drafter (--cross-drafter)")
    torch.set_num_threads(config.threads)
    ordered = ["target-only", *[s for s in systems if s != "target-only"]]  # the reference runs first
    encoded = [target.encode_prompt(p.messages()) for p in prompts]
    cost = measure_cost_model(target, drafter)
    costs = {"coder": cost, "ngram": replace(cost, draft_token_s=0.0, catch_up_token_s=0.0)}
    coder = ModelDrafter(drafter, "coder")
    lookup = NgramDrafter  # a fresh one (own suffix cache) per system: no system sees another's outputs
    pools: dict[str, tuple] = {}  # system -> (drafter, lookup, cost)
    if cross_drafter is not None:
        cross = CrossTokenizerDrafter(cross_drafter, target.tokenizer, name="smollm2")
        small = measure_cost_model(target, cross_drafter)
        costs["smollm2"] = replace(cost, draft_token_s=small.draft_token_s, catch_up_token_s=small.catch_up_token_s)
        fused_cost = replace(cost, draft_token_s=cost.draft_token_s + small.draft_token_s,
                             catch_up_token_s=cost.catch_up_token_s + small.catch_up_token_s)
        pools["single-smollm2"] = (cross, None, costs["smollm2"])
        pools["cosine-routing"] = (CollaborativeDrafters([coder, cross], EXPERTISE, parallel=False),
                                   lookup("lookup"), cost)
        pools["cosine"] = (CollaborativeDrafters([coder, cross], EXPERTISE, fusion_width=2, parallel=False,
                                                 tree_budget=config.tree_budget), lookup("lookup"), fused_cost)
    pools["single-coder"] = (coder, None, cost)
    pools["single-ngram"] = (NgramDrafter("ngram"), None, costs["ngram"])
    log.info("cost model: %s", costs)
    measured: dict[str, float] = {}
    runners: dict[str, Runner] = {
        "target-only": lambda p, ids: _run_ours("target-only", target, None, None, p, ids, config=config, cost=cost,
                                                     measured=measured),
        "hf-generate": lambda p, ids: _run_hf("hf-generate", target, None, p, ids, config),
        "hf-assisted": lambda p, ids: _run_hf("hf-assisted", target, drafter, p, ids, config),
    }
    for name, (d, lk, c) in pools.items():
        runners[name] = functools.partial(_run_ours, name, target, d, lk, config=config, cost=c, measured=measured)
    cluster = _Cluster(target, config) if "cosine-cluster" in ordered else None
    if cluster is not None:
        runners["cosine-cluster"] = cluster.run
    records: list[RequestRecord] = []
    try:
        for s in ordered:
            # one short warm-up per system so first-call costs (allocator, kernels) are not charged to it
            _ = runners[s](prompts[0], encoded[0][:32])
            for p, ids in tqdm(list(zip(prompts, encoded, strict=True)), desc=f"{s:>16}", disable=not progress,
                               unit="req"):
                r = runners[s](p, ids)
                r.output_text = r.output_text or target.decode(r.output_ids)
                records.append(r)
    finally:
        if cluster is not None:
            cluster.close()
    return {
        "config": {
            "target": target.name,
            "drafter": drafter.name,
            "cross_drafter": cross_drafter.name if cross_drafter is not None else None,
            "tree_budget": config.tree_budget,
            "systems": ordered,
            "max_tokens": config.max_tokens,
            "dtype": config.dtype,
            "threads": config.threads,
            "decoding": "greedy",
            "speculation": asdict(config.speculation),
            "num_prompts": len(prompts),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        },
        "cost_model": asdict(cost),
        "cost_models": {k: asdict(v) for k, v in costs.items()},
        "results": aggregate(records),
        "routing": routing_summary(records),
        "requests": [
            {**asdict(r), "tpot_s": r.tpot_s, "output_ids": r.output_ids} for r in records
        ],
    }


def aggregate(records: Sequence[RequestRecord]) -> list[dict]:
    """Per system and domain (and `"all"`): totals, p50 latencies, acceptance, identity, speedup."""
    reference = {r.prompt_id: r for r in records if r.system == "target-only"}

    def identical(r: RequestRecord) -> bool:
        ref = reference.get(r.prompt_id)
        if ref is None:
            return False
        return r.output_ids == ref.output_ids if r.output_ids else r.output_text == ref.output_text

    systems = list(dict.fromkeys(r.system for r in records))
    domains = ["all", *sorted({r.domain for r in records})]
    rows: list[dict] = []
    for domain in domains:
        base_tps = None
        for system in systems:
            rs = [r for r in records if r.system == system and domain in ("all", r.domain)]
            if not rs:
                continue
            tokens = sum(r.num_tokens for r in rs)
            wall = sum(r.wall_s for r in rs)
            tps = tokens / wall if wall > 0 else 0.0
            if system == "target-only":
                base_tps = tps
            drafts = sum(r.num_drafts for r in rs)
            drafted = sum(r.draft_tokens for r in rs)
            accepted = sum(r.accepted_tokens for r in rs)
            tpots = [r.tpot_s for r in rs if r.tpot_s is not None]
            ttfts = [r.ttft_s for r in rs if r.ttft_s is not None]
            rows.append(
                {
                    "system": system,
                    "domain": domain,
                    "num_requests": len(rs),
                    "output_tokens": tokens,
                    "wall_s": round(wall, 3),
                    "output_tokens_per_s": round(tps, 3),
                    "tpot_ms_p50": round(1e3 * statistics.median(tpots), 2) if tpots else None,
                    "ttft_ms_p50": round(1e3 * statistics.median(ttfts), 2) if ttfts else None,
                    "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
                    "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                    "identical_to_target": all(identical(r) for r in rs),
                    "speedup_vs_target_only": round(tps / base_tps, 3) if base_tps else None,
                    "tree_steps": sum(r.tree_steps for r in rs),
                    "mean_draft_tokens": round(drafted / drafts, 2) if drafts else None,
                }
            )
    _add_best_single_ratios(rows)
    return rows


def _add_best_single_ratios(rows: list[dict]) -> None:
    """Ratios to the best single drafter: the `single-*` system with the highest overall tokens/s
    (issue #5 compares CoSine against it), per domain."""
    singles = [r for r in rows if r["system"].startswith(SINGLE_PREFIX) and r["domain"] == "all"]
    if not singles:
        return
    best = max(singles, key=lambda r: r["output_tokens_per_s"])["system"]
    by_domain = {r["domain"]: r for r in rows if r["system"] == best}
    for r in rows:
        ref = by_domain.get(r["domain"])
        r["best_single"] = best
        r["speedup_vs_best_single"] = (round(r["output_tokens_per_s"] / ref["output_tokens_per_s"], 3)
                                       if ref and ref["output_tokens_per_s"] else None)
        r["acceptance_length_vs_best_single"] = (
            round(r["mean_acceptance_length"] / ref["mean_acceptance_length"], 3)
            if ref and r["mean_acceptance_length"] and ref["mean_acceptance_length"] else None
        )


def routing_summary(records: Sequence[RequestRecord]) -> dict:
    """Per collaborative system and domain: how often each pool was routed first, and the draft
    tokens each drafter got accepted (the routing decisions the issue asks to report)."""
    out: dict = {}
    for r in records:
        if not r.route and not r.tree_steps:
            continue
        d = out.setdefault(r.system, {}).setdefault(r.domain, {"routed_first": {}, "accepted_by": {}})
        if r.route:
            d["routed_first"][r.route[0]] = d["routed_first"].get(r.route[0], 0) + 1
        for name, n in r.accepted_by.items():
            d["accepted_by"][name] = d["accepted_by"].get(name, 0) + n
    return out


def _run_ours(
    system: str,
    target: ModelRunner,
    drafter,
    lookup: NgramDrafter | None,
    prompt: Prompt,
    ids: list[int],
    *,
    config: BenchConfig,
    cost: CostModel,
    measured: dict[str, float],
) -> RequestRecord:
    """`measured`: system -> its drafter's acceptance on earlier requests (updated here)."""
    start = initial_state(config.speculation, measured.get(system))
    t0 = time.perf_counter()
    rid = f"{system}-{prompt.id}-{len(ids)}"
    route: list[str] = []
    if hasattr(drafter, "assign"):  # collaborative: route by the prompt's domain label, and start
        route = drafter.assign(rid, prompt.domain)  # from the routed pool's acceptance on that domain
        if route:
            start = initial_state(config.speculation, drafter.expected_acceptance(route[0], prompt.domain))
    steps = []
    stats = GenerationStats()
    for out in generate_stream(
        target, ids, config.max_tokens, drafter=drafter, lookup=lookup, settings=config.speculation, cost=cost,
        initial=start, request_id=rid, stats=stats,
    ):
        steps.append(out)
        if hasattr(drafter, "observe"):
            for o in out.outcomes:
                drafter.observe(rid, o.drafter, o.num_draft_tokens, o.num_accepted, o.mean_confidence)
    res = GenerationResult(tuple(t for o in steps for t in o.token_ids), stats, stats.finish_reason or "length")
    wall = time.perf_counter() - t0
    s: GenerationStats = res.stats
    if s.speculation_state is not None:
        measured[system] = s.speculation_state.acceptance_rate
    return RequestRecord(
        system, prompt.id, prompt.domain, len(ids), list(res.token_ids), wall, s.ttft_s,
        s.num_drafts, s.draft_tokens, s.accepted_tokens, route=route, accepted_by=dict(s.accepted_by),
        tree_steps=s.tree_steps, draft_lens=list(s.draft_lens),
    )


class _FirstTokenTimer:
    """A `transformers` streamer that records when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:  # first call carries the prompt
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


@torch.inference_mode()
def _run_hf(
    system: str, target: ModelRunner, drafter: ModelRunner | None, prompt: Prompt, ids: list[int], config: BenchConfig
) -> RequestRecord:
    from transformers import GenerationConfig

    eos = sorted(target.eos_token_ids)
    gen_config = GenerationConfig(
        do_sample=False, max_new_tokens=config.max_tokens, eos_token_id=eos, pad_token_id=eos[0],
        repetition_penalty=1.0,
    )
    input_ids = torch.tensor([ids], dtype=torch.long)
    timer = _FirstTokenTimer()
    kwargs = {"assistant_model": drafter.model} if drafter is not None else {}
    t0 = time.perf_counter()
    out = target.model.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen_config,
        streamer=timer, **kwargs,
    )
    wall = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    ttft = timer.first_token_at - t0 if timer.first_token_at else None
    return RequestRecord(system, prompt.id, prompt.domain, len(ids), [int(t) for t in new], wall, ttft)


class _Cluster:
    """`cosine serve` (default manifest) in child processes, driven over HTTP."""

    def __init__(self, target: ModelRunner, config: BenchConfig) -> None:
        from openai import OpenAI

        from cosine.roles import free_port, load_manifest, parse_spec, start_cluster, wait_ready

        self.model = parse_spec(load_manifest(None)).verifier.model
        if self.model != target.name:
            raise ValueError(f"cosine-cluster serves {self.model}, but the bench target is {target.name}")
        self.target, self.config = target, config
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.proc = start_cluster(None, port)
        wait_ready(self.base, self.proc)
        self.client = OpenAI(base_url=f"{self.base}/v1", api_key="none", max_retries=0, timeout=900)
        self._counters = self._spec_counters()

    def _spec_counters(self) -> tuple[float, float, float]:
        from cosine.demo import spec_decode_counters

        c = spec_decode_counters(self.base)
        return (c.get("cosine:spec_decode_num_drafts_total", 0.0),
                c.get("cosine:spec_decode_num_draft_tokens_total", 0.0),
                c.get("cosine:spec_decode_num_accepted_tokens_total", 0.0))

    def run(self, prompt: Prompt, ids: list[int]) -> RequestRecord:
        from cosine.demo import ask

        if len(ids) <= 32 and ids != self.target.encode_prompt(prompt.messages()):  # the warm-up call
            prompt = Prompt(prompt.id, prompt.domain, "Say hello.")
        before = self._counters
        a = ask(self.client, self.model, prompt, self.config.max_tokens)
        self._counters = after = self._spec_counters()
        drafts, drafted, accepted = (int(x - y) for x, y in zip(after, before, strict=True))
        return RequestRecord(
            "cosine-cluster", prompt.id, prompt.domain, len(ids), [], a.wall_s, a.ttft_s, drafts, drafted, accepted,
            output_text=a.text, http_tokens=a.completion_tokens,
        )

    def close(self) -> None:
        from cosine.roles import stop_cluster

        stop_cluster(self.proc)


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))


def format_table(results: Sequence[dict]) -> str:
    """A readable fixed-width table of `results[]`."""
    cols = [
        ("system", "system", 14), ("domain", "domain", 7), ("output_tokens", "tokens", 6),
        ("wall_s", "wall_s", 8), ("output_tokens_per_s", "tok/s", 6), ("tpot_ms_p50", "TPOT ms", 8),
        ("ttft_ms_p50", "TTFT ms", 8), ("mean_acceptance_length", "acc.len", 7),
        ("acceptance_rate", "acc.rate", 8), ("identical_to_target", "identical", 9),
        ("speedup_vs_target_only", "x target", 8), ("speedup_vs_best_single", "x single", 8),
        ("acceptance_length_vs_best_single", "acc x single", 12),
    ]
    lines = ["  ".join(f"{title:>{w}}" for _, title, w in cols)]
    for row in results:
        cells = []
        for key, _, w in cols:
            v = row.get(key)
            text = "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))
            cells.append(f"{text:>{w}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def plot(report: dict, out: Path) -> None:
    """Bar charts of output tokens/s and mean acceptance length per domain and system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(systems))
    for ax, key, title in (
        (axes[0], "output_tokens_per_s", "output tokens/s (greedy, batch 1)"),
        (axes[1], "mean_acceptance_length", "mean acceptance length (tokens/verification)"),
    ):
        for i, s in enumerate(systems):
            vals = [next((r[key] or 0 for r in rows if r["system"] == s and r["domain"] == d), 0) for d in domains]
            ax.bar([j + i * width for j in range(len(domains))], vals, width, label=s)
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(domains))], domains)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    cfg = report["config"]
    fig.suptitle(f"target {cfg['target']}, drafter {cfg['drafter']}, {cfg['dtype']}, {cfg['max_tokens']} new tokens")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
