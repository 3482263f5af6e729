"""Calibration of the simulated cluster from one `cosine bench` JSON (one place, one function).

`calibrate(bench, system, concurrency)` reads one (system, concurrency) row of a bench run and its
per-request records and returns what the simulator needs to replay that system:

- the verifier's pass time vs tokens in the pass, `max(decode_pass_s, prefill_base_s +
  prefill_token_s * tokens)`: a pass reads all the weights once (memory-bound: the decode pass,
  whatever its few tokens), and from some tokens on it is compute-bound (linear). `decode_pass_s`
  is the records' decode seconds over the decode steps they took (sum of latency - TTFT over
  sum of output tokens - 1 - accepted draft tokens: an accepted token saves a step);
  `prefill_*` is the least-squares line of TTFT on prompt tokens (the prefill pass and the
  request's fixed overhead). Attention over the KV cache is left out (contexts < 300 tokens here);
- prompt lookup: how often it finds a draft on a decode step (drafts / decode steps the pools did
  not draft), how long its drafts are and their per-token acceptance;
- each pool: per-token acceptance, seconds per draft token and draft tokens per call (the
  drafter's own figures), round trip beyond drafting, and the share of returned calls whose draft
  the verifier used (`use_prob`: it arrived before a step and still continued the context).

Per-token acceptance alpha is fitted so that a chain of the mean draft length accepts, on average,
the measured accepted tokens per draft (sum_{i=1..k} alpha^i; Leviathan et al. 2023, §3.1).

The bench JSON records no prompt lengths; `load_bench` reads them from `<bench>.meta.json` next to
it (the prompts counted with the target's tokenizer), with the command that produced the run.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosine_spec.cluster_spec import SpeculationSpec

from cosine.placement import Evidence
from cosine.sources.lookup import LOOKUP
from cosine.speculation_control import expected_tokens


@dataclass(frozen=True)
class PoolCalibration:
    name: str
    alpha: float
    draft_token_s: float
    tokens_per_call: int
    rtt_s: float  # round trip beyond the drafting itself
    use_prob: float


@dataclass(frozen=True)
class Calibration:
    """One system as measured at one concurrency (see the module docstring)."""

    system: str
    concurrency: int
    run: int
    decode_pass_s: float
    prefill_base_s: float
    prefill_token_s: float
    lookup_hit_rate: float = 0.0
    lookup_draft_tokens: int = 0
    lookup_alpha: float = 0.0
    pools: tuple[PoolCalibration, ...] = ()

    def pass_s(self, num_tokens: int, kv_tokens: int = 0) -> float:
        """Seconds of one engine step computing `num_tokens` tokens (KV length ignored)."""
        return max(self.decode_pass_s, self.prefill_base_s + self.prefill_token_s * num_tokens)


# The bench this simulator is validated against, shipped in the package (``data/``: its
# ``.meta.json`` gives the command, the machine and the prompts' token counts; the prompts are in
# ``mixed2-heldout3.jsonl``), so ``cosine simulate`` calibrates inside the image too.
KEPT_BENCH = Path(__file__).parent / "data" / "bench_session8.json"


def load_bench(path: Path) -> dict[str, Any]:
    """The bench JSON at `path`, with `prompt_tokens` (prompt id -> tokens) and `command` from
    `<stem>.meta.json` beside it (empty without one: no prefill line is fitted)."""
    path = Path(path)
    data: dict[str, Any] = json.loads(path.read_text())
    meta_path = path.with_name(path.stem + ".meta.json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"prompt_tokens": {}, "command": ""}
    return {**data, "prompt_tokens": meta["prompt_tokens"], "command": meta["command"]}


def first_run(bench: dict[str, Any], system: str, concurrency: int) -> int:
    """The run index of the system's first row at that concurrency (the reference runs twice)."""
    return min(r["run"] for r in bench["rows"] if r["system"] == system and r["concurrency"] == concurrency)


def row(bench: dict[str, Any], system: str, concurrency: int, run: int | None = None) -> dict[str, Any]:
    run = first_run(bench, system, concurrency) if run is None else run
    return next(r for r in bench["rows"] if (r["system"], r["concurrency"], r["run"]) == (system, concurrency, run))


def records(bench: dict[str, Any], system: str, concurrency: int, run: int | None = None) -> list[dict[str, Any]]:
    """The row's per-request records, in the order the bench sent them."""
    run = first_run(bench, system, concurrency) if run is None else run
    return [r for r in bench["records"]
            if (r["system"], r["concurrency"], r["run"]) == (system, concurrency, run)]


def fit_alpha(accepted_per_draft: float, mean_draft_tokens: float) -> float:
    """Per-token acceptance alpha with sum_{i=1..k} alpha^i = accepted_per_draft at k = mean_draft_tokens."""
    if mean_draft_tokens <= 0 or accepted_per_draft <= 0:
        return 0.0
    if accepted_per_draft >= mean_draft_tokens:
        return 1.0
    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, mean_draft_tokens) - 1 < accepted_per_draft else (lo, mid)  # type: ignore[arg-type]
    return lo


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def calibrate(bench: dict[str, Any], system: str, concurrency: int = 1, run: int | None = None) -> Calibration:
    """The `Calibration` of `system` from its row and records at `concurrency` (its first run by
    default). At concurrency 1 every engine step serves one request, which is what the decode
    pass and TTFT figures assume; other levels are for comparison only."""
    r = row(bench, system, concurrency, run)
    recs = records(bench, system, concurrency, r["run"])
    pools_raw: dict[str, dict[str, float]] = r.get("pools") or {}
    accepted = sum(int(p.get("accepted_tokens") or 0) for p in pools_raw.values())
    decode_steps = sum(x["completion_tokens"] - 1 for x in recs) - accepted
    decode_pass_s = sum(x["latency_s"] - x["ttft_s"] for x in recs) / max(1, decode_steps)
    lengths = bench.get("prompt_tokens") or {}
    if all(x["prompt_id"] in lengths for x in recs) and len({lengths[x["prompt_id"]] for x in recs}) > 1:
        base, slope = _line([float(lengths[x["prompt_id"]]) for x in recs], [x["ttft_s"] for x in recs])
    else:  # prompt lengths not recorded: the decode figures only
        base, slope = 0.0, 0.0
    pools = []
    pool_drafts = 0
    for name, p in pools_raw.items():
        if name == LOOKUP or not p.get("drafts"):
            continue
        pool_drafts += int(p["drafts"])
        d = (r.get("drafters") or {}).get(name, {})
        calls = max(1.0, float(p.get("calls") or 0))
        per_call = max(1, round(float(d.get("draft_tokens", 0)) / calls))
        draft_s = float(d.get("draft_s_per_token", 0.0))
        pools.append(PoolCalibration(
            name, fit_alpha(p["accepted_tokens"] / p["drafts"], p["draft_tokens"] / p["drafts"]), draft_s, per_call,
            max(0.0, float(p.get("rtt_s") or 0.0) - per_call * draft_s), min(1.0, p["drafts"] / calls)))
    lk = pools_raw.get(LOOKUP)
    hit, tokens, alpha = 0.0, 0, 0.0
    if lk and lk.get("drafts"):
        hit = min(1.0, lk["drafts"] / max(1, decode_steps - pool_drafts))
        tokens = round(lk["draft_tokens"] / lk["drafts"])
        alpha = fit_alpha(lk["accepted_tokens"] / lk["drafts"], lk["draft_tokens"] / lk["drafts"])
    return Calibration(system, concurrency, r["run"], decode_pass_s, base, slope, hit, tokens, alpha, tuple(pools))


SYSTEM_MODES = {"vllm": "target-only", "cosine-lookup": "cosine", "cosine": "cosine"}


def sim_setup(cal: Calibration, domains: tuple[str, ...], max_batch_tokens: int = 512,
              speculation: SpeculationSpec | None = None, seed: int = 0) -> Any:
    """The `SimSetup` that replays the calibrated system: vLLM's scheduler with the bench's token
    budget (the manifest's `maxBatchTokens`, default 512) and `spec.speculation` (None: the CRD's), the
    calibrated pass time, prompt lookup and pools (one replica, one slot: llama.cpp on one core)."""
    from cosine.simulation.cluster import LookupModel, PoolModel, SimSetup, VerifierModel
    from cosine.simulation.cost_models import AcceptanceModel

    alphas = {LOOKUP: cal.lookup_alpha, **{p.name: p.alpha for p in cal.pools}}
    acceptance = AcceptanceModel({(src, d): a for src, a in alphas.items() for d in domains},
                                 dict.fromkeys(alphas, 8.0))
    pools = tuple(PoolModel(p.name, (), 1, 1, 1, p.draft_token_s, 0.0, 1, p.rtt_s) for p in cal.pools)
    lookup = LookupModel(cal.lookup_hit_rate, cal.lookup_draft_tokens) if cal.lookup_draft_tokens else None
    return SimSetup(SYSTEM_MODES[cal.system], VerifierModel(cal.pass_s, max_batch_tokens=max_batch_tokens), pools,
                    acceptance, speculation or SpeculationSpec(), lookup=lookup, seed=seed)


def placement_evidence(bench: dict[str, Any], base: Evidence, pooled: tuple[str, ...]) -> Evidence:
    """`base` (a `placement.Evidence` with this machine's cores and pools) completed with what a
    `cosine bench` run measured at concurrency 1: the verifier's decode step on every core (the
    reference `vllm`'s), on the cores it keeps beside the pools and each pool's acceptance, on-time
    share and seconds per draft token (the first of the bench's systems with pools, `pooled`, run in
    `split`: the first pool's figures), and prompt lookup's hit rate and acceptance
    (`cosine-lookup`, else that system's lookup). A run in `shared` placement, or one missing a
    row, leaves the missing figures unmeasured; `base.source` names the run."""
    from dataclasses import replace

    level = [r for r in bench.get("rows", []) if r.get("concurrency") == 1]
    default = bench.get("placement", "split")

    def placed(system: str) -> tuple[str, str]:
        name, _, where = system.partition("@")
        return name, where or default

    def first(pred: Any) -> str | None:
        return next((r["system"] for r in level if pred(*placed(r["system"]))), None)

    ev = base
    reference = first(lambda name, where: name == "vllm" and where != "shared")
    if reference is not None:
        ev = replace(ev, pass_s=calibrate(bench, reference).decode_pass_s)
    with_pools = first(lambda name, where: name in pooled and where == "split")
    if with_pools is not None:
        cal = calibrate(bench, with_pools)
        if cal.pools:
            pool = cal.pools[0]
            ev = replace(ev, kept_pass_s=cal.decode_pass_s, draft_token_s=pool.draft_token_s or None,
                         pool_alpha=pool.alpha, pool_use=pool.use_prob)
    lookup = first(lambda name, where: name == "cosine-lookup" and where != "shared") or with_pools
    if lookup is not None:
        cal = calibrate(bench, lookup)
        ev = replace(ev, lookup_hit=cal.lookup_hit_rate, lookup_alpha=cal.lookup_alpha,
                     lookup_tokens=cal.lookup_draft_tokens)
    return ev


def lookup_replay(pairs: Any, max_draft_tokens: int = 8, settings: Any = None) -> dict[str, dict[str, float]]:
    """Prompt lookup as served (`lookup.SuffixLookup`, vLLM's `suffix` defaults) replayed over
    reference replies: for each `(domain, prompt_ids, reply_ids)` in order, greedy decoding of
    `reply_ids` as if it were the target's output. Each decode step asks for a draft of up to
    `max_draft_tokens`; the draft's accepted tokens are its longest prefix that the reply
    continues with, and the step emits them plus the target's own token. Requests share the
    global tree as one verifier's do (a finished reply joins it).

    Returns, per domain: `requests`, `decode_steps`, `drafts`, `draft_tokens`, `accepted`,
    `hit_rate` (drafts per decode step), `mean_draft_tokens`, `accepted_per_draft`, `alpha`
    (`fit_alpha`) and `tokens_per_step` (output tokens per decode step: the acceptance length).
    The first token of each reply comes from prefill and is not a decode step."""
    from cosine.lookup import SuffixLookup, SuffixSettings

    lookup = SuffixLookup(settings or SuffixSettings())
    counts: dict[str, dict[str, float]] = {}
    for i, (domain, prompt, reply) in enumerate(pairs):
        c = counts.setdefault(domain, dict.fromkeys(("requests", "decode_steps", "drafts", "draft_tokens",
                                                     "accepted", "emitted"), 0.0))
        rid = f"ref-{i}"
        context = list(prompt) + list(reply[:1])
        lookup.start(rid, prompt)
        pos = 1
        while pos < len(reply):
            draft, _ = lookup.propose(rid, context, min(max_draft_tokens, len(reply) - pos))
            acc = 0
            while acc < len(draft) and draft[acc] == reply[pos + acc]:
                acc += 1
            emitted = min(acc + 1, len(reply) - pos)
            c["decode_steps"] += 1
            c["emitted"] += emitted
            if draft:
                c["drafts"] += 1
                c["draft_tokens"] += len(draft)
                c["accepted"] += acc
            context.extend(reply[pos:pos + emitted])
            pos += emitted
        lookup.propose(rid, context, 0)  # index the reply's last tokens before it finishes
        lookup.release(rid)
        c["requests"] += 1
    out = {}
    for domain, c in counts.items():
        drafts = c["drafts"]
        per_draft = c["accepted"] / drafts if drafts else 0.0
        mean_tokens = c["draft_tokens"] / drafts if drafts else 0.0
        out[domain] = {**{k: v for k, v in c.items() if k != "emitted"},
                       "hit_rate": drafts / c["decode_steps"] if c["decode_steps"] else 0.0,
                       "mean_draft_tokens": mean_tokens, "accepted_per_draft": per_draft,
                       "alpha": fit_alpha(per_draft, mean_tokens),
                       "tokens_per_step": c["emitted"] / c["decode_steps"] if c["decode_steps"] else 0.0}
    return out
