"""What a `cosine bench` run measures and reports: the systems it compares, one record per
request, the figures of each run (throughput, TPOT, TTFT, latency, acceptance, drafts late, the
drafters' busy fraction), the summary over repeats with its ratios to `vllm` and to vLLM's best
speculation, the table, the JSON (with its placement evidence) and the plot.

Pure functions over records and scrapes, but for `write_report` and `plot` (files). The runs
themselves (servers, load, processes) are `vllm_bench`'s.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosine_spec import metric_names as m

from cosine.model_store import last_bench_path
from cosine.placement import EVIDENCE_KEY, Evidence, evidence_document

ABLATIONS = {"cosine-nofusion": {"fusion": False}, "cosine-nobranch": {"branches": 0},
             "cosine-acceptance": {"draftLength": "acceptanceRate"},
             "cosine-draft-nolookup": {"promptLookup": False},
             "cosine-draft-k8": {"maxDraftLen": 8}}  # spec.speculation overrides
# CoSine with the engine's own drafter (spec.verifier.speculator: the bench's drafter model in
# vLLM's draft_model, k bounded by vllm-draft's k unless the ablation sets it: cosine-draft-k8
# bounds it by `cosine serve`'s default 8, the drafter's depth following the k chosen), as
# `vllm-draft` runs it alone
SPECULATOR_SYSTEMS = {"cosine-draft": "draftModel", "cosine-draft-nolookup": "draftModel",
                      "cosine-draft-k8": "draftModel"}
SYSTEMS = ("vllm", "vllm-ngram", "vllm-suffix", "vllm-draft", "cosine-lookup", "cosine", "cosine-draft", *ABLATIONS)
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in ABLATIONS)
CLUSTERS = ("cosine", "cosine-draft", *ABLATIONS)  # the systems that run the embedded cluster (`cosine serve`)
REFERENCE = "vllm"
PEERS = ("vllm-ngram", "vllm-suffix", "vllm-draft")  # vLLM's own speculation methods
Scrape = dict[tuple[str, str], float]  # (sample name, pool label or "") -> value, summed over other labels
_POOL_GAUGES = {"rtt_s": m.POOL_RTT_SECONDS, "token_s": m.POOL_TOKEN_SECONDS, "yield_tokens": m.POOL_YIELD_TOKENS,
                "on_time_ratio": m.POOL_ON_TIME_RATIO}
_GAUGES = frozenset({*_POOL_GAUGES.values(), m.REQUESTS_RUNNING, m.REQUESTS_WAITING, m.DRAFTER_CONTEXTS})
_POOL_COUNTERS = {
    "drafts": m.total(m.DRAFTS),
    "draft_tokens": m.total(m.DRAFT_TOKENS),
    "accepted_tokens": m.total(m.ACCEPTED_TOKENS),
    "drafts_late": m.total(m.DRAFTS_LATE),
    "calls": m.total(m.POOL_CALLS),
    "errors": m.total(m.POOL_ERRORS),
    "asks_skipped": m.total(m.POOL_ASKS_SKIPPED),
}


@dataclass(frozen=True)
class Record:
    """One request: prompt id and domain, output text and tokens, wall times in seconds (`start_s`:
    when it was sent, from the start of its run's load)."""

    system: str
    run: int
    concurrency: int
    prompt_id: str
    domain: str
    text: str
    completion_tokens: int
    ttft_s: float
    latency_s: float
    start_s: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first; None for fewer than two tokens."""
        n = self.completion_tokens
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else None


def _pct(values: Sequence[float], q: float) -> float | None:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))] if v else None


def _pool_figures(delta: Scrape, after: Scrape) -> dict[str, dict[str, float | None]]:
    """Per draft source ("lookup" or a pool), from the verifier's `cosine_` series over the window."""
    names = set(_POOL_COUNTERS.values())
    pools = sorted({p for (n, p) in delta if n in names and p})
    out: dict[str, dict[str, float | None]] = {}
    for pool in pools:
        fig: dict[str, float | None] = {k: delta.get((n, pool), 0.0) for k, n in _POOL_COUNTERS.items()}
        drafted, accepted = fig["draft_tokens"] or 0.0, fig["accepted_tokens"] or 0.0
        fig["acceptance_rate"] = accepted / drafted if drafted else None
        fig.update({k: after.get((n, pool)) for k, n in _POOL_GAUGES.items()})
        out[pool] = fig
    return out


def _drafter_figures(drafters: Sequence[tuple[str, Scrape, Scrape]], wall_s: float
                     ) -> dict[str, dict[str, float | None]]:
    """Per pool, from its drafter processes' own /metrics ((pool, before, after) per process): the
    busy fraction (drafting seconds per second of the window, per replica), drafting seconds per
    draft token and draft tokens."""
    acc: dict[str, list[float]] = {}
    for pool, before, after in drafters:
        busy_key, tokens_key = (m.total(m.DRAFTER_BUSY_SECONDS), pool), (m.total(m.DRAFTER_DRAFT_TOKENS), pool)
        if busy_key not in after:
            continue  # endpoint not reachable
        busy = after[busy_key] - before.get(busy_key, 0.0)
        tokens = after.get(tokens_key, 0.0) - before.get(tokens_key, 0.0)
        a = acc.setdefault(pool, [0.0, 0.0, 0.0])
        a[0], a[1], a[2] = a[0] + busy, a[1] + tokens, a[2] + 1
    return {pool: {"busy_fraction": busy / (wall_s * n) if wall_s > 0 else None,
                   "draft_s_per_token": busy / tokens if tokens else None, "draft_tokens": tokens, "replicas": n}
            for pool, (busy, tokens, n) in sorted(acc.items())}


def _decode_rate(records: Sequence[Record]) -> float | None:
    """A request's decoding speed after its first token, in tokens per second:
    sum(completion_tokens - 1) / sum(latency_s - ttft_s). It leaves the prefill out (TTFT), which
    speculation does not touch and which a split placement computes on fewer cores."""
    tokens = sum(r.completion_tokens - 1 for r in records if r.completion_tokens > 1)
    seconds = sum(r.latency_s - r.ttft_s for r in records if r.completion_tokens > 1)
    return tokens / seconds if seconds > 0 else None


def summarize(records: Sequence[Record], wall_s: float, before: Scrape, after: Scrape,
              drafters: Sequence[tuple[str, Scrape, Scrape]] = ()) -> dict[str, Any]:
    """One (system, run, level) row: throughput, latency percentiles and speculation figures over
    the window between the `before` and `after` scrapes."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if k[0] not in _GAUGES}

    def total(name: str) -> float:
        return sum(v for (n, _), v in delta.items() if n == name)

    tokens = sum(r.completion_tokens for r in records)
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    drafts = total(m.total(m.VLLM_DRAFTS))
    drafted = total(m.total(m.VLLM_DRAFT_TOKENS))
    accepted = total(m.total(m.VLLM_ACCEPTED_TOKENS))
    steps = total(m.total(m.VERIFIER_STEPS))
    domains = sorted({r.domain for r in records})
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "tpot_ms_p50": (_pct(tpots, 0.5) or 0) * 1e3 if tpots else None,
        "ttft_s_p50": _pct([r.ttft_s for r in records], 0.5),
        "decode_tokens_per_s": _decode_rate(records),
        "latency_s_p50": _pct([r.latency_s for r in records], 0.5),
        "latency_s_p99": _pct([r.latency_s for r in records], 0.99),
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_tokens": drafted,
        "drafts_late": total(m.total(m.DRAFTS_LATE)),
        "steps_with_draft_fraction": total(m.total(m.VERIFIER_STEPS_WITH_DRAFT)) / steps if steps else None,
        "verifier_step_s": total(m.total(m.VERIFIER_BUSY_SECONDS)) / steps if steps else None,
        "pools": _pool_figures(delta, after),
        "drafters": _drafter_figures(drafters, wall_s),
        "per_domain_tokens_per_s": {
            d: sum(r.completion_tokens for r in records if r.domain == d)
            / max(1e-9, sum(r.latency_s for r in records if r.domain == d)) for d in domains},
        "per_domain_decode_tokens_per_s": {d: _decode_rate([r for r in records if r.domain == d]) for d in domains},
    }


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _prompt_speeds(records: Sequence[Record], system: str, c: int) -> dict[str, tuple[str, float]]:
    """Per prompt id: its domain and its mean per-request speed (output tokens over latency) over
    `system`'s runs at level `c`."""
    speeds: dict[str, list[float]] = {}
    domain: dict[str, str] = {}
    for r in records:
        if r.system == system and r.concurrency == c and r.latency_s > 0:
            speeds.setdefault(r.prompt_id, []).append(r.completion_tokens / r.latency_s)
            domain[r.prompt_id] = r.domain
    return {p: (domain[p], statistics.mean(v)) for p, v in speeds.items()}


def summarize_repeats(rows: Sequence[Mapping[str, Any]], records: Sequence[Record] = ()) -> list[dict[str, Any]]:
    """Per (system, level): its runs, medians of output tokens/s, TPOT, acceptance length and the
    share of steps with a draft, and its ratio to `vllm` and to the best of vLLM's speculation
    methods as the median of the per-repeat ratios, with their spread [min, max] (the i-th run of
    a system against the i-th of the other; a single run has no spread to give). Per domain
    (`ratio_vs_vllm_per_domain`): the median [min, max] of the same per-repeat ratios of the
    domain's tokens over its requests' latency. Given the `records`, per domain the slowest prompt
    against `vllm` (`slowest_prompt_vs_vllm`: the prompt id and its mean per-request speed over
    the system's runs over that under `vllm`'s): "never slower on any prompt" read prompt by
    prompt, the same prompt under both."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        level = [r for r in rows if r["concurrency"] == c]
        by_system: dict[str, list[Mapping[str, Any]]] = {}
        for r in sorted(level, key=lambda r: r["run"]):
            by_system.setdefault(r["system"], []).append(r)
        peers = {s: rs for s, rs in by_system.items() if s.partition("@")[0] in PEERS}
        ref = _prompt_speeds(records, REFERENCE, c)
        for system, mine in by_system.items():
            tps = [r["output_tokens_per_s"] for r in mine]
            entry: dict[str, Any] = {
                "system": system, "concurrency": c, "runs": len(mine), "output_tokens_per_s": _median(tps),
                "tpot_ms_p50": _median([r.get("tpot_ms_p50") for r in mine]),
                "mean_acceptance_length": _median([r.get("mean_acceptance_length") for r in mine]),
                "steps_with_draft_fraction": _median([r.get("steps_with_draft_fraction") for r in mine]),
            }
            against = {"vs_vllm": by_system.get(REFERENCE, [])}
            if peers:
                best = max(peers, key=lambda s: _median([r["output_tokens_per_s"] for r in peers[s]]) or 0.0)
                entry["best_vllm_speculation"] = best
                against["vs_best_vllm_speculation"] = peers[best]
            for key, other in against.items():
                ratios = [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(mine, other, strict=False)
                          if b["output_tokens_per_s"]]
                entry[f"ratio_{key}"] = _median(ratios)
                entry[f"ratio_{key}_spread"] = [min(ratios), max(ratios)] if len(ratios) > 1 else None
            per_domain: dict[str, list[float]] = {}
            for a, b in zip(mine, against["vs_vllm"], strict=False):
                for d, v in a.get("per_domain_tokens_per_s", {}).items():
                    if b.get("per_domain_tokens_per_s", {}).get(d):
                        per_domain.setdefault(d, []).append(v / b["per_domain_tokens_per_s"][d])
            entry["ratio_vs_vllm_per_domain"] = {d: [statistics.median(v), min(v), max(v)]
                                                 for d, v in sorted(per_domain.items())}
            slowest: dict[str, tuple[str, float]] = {}
            for prompt, (d, v) in _prompt_speeds(records, system, c).items():
                ratio = v / ref[prompt][1] if prompt in ref else None
                if ratio is not None and (d not in slowest or ratio < slowest[d][1]):
                    slowest[d] = (prompt, ratio)
            if slowest:
                entry["slowest_prompt_vs_vllm"] = {d: list(v) for d, v in sorted(slowest.items())}
            out.append(entry)
    return out


def add_ratios(rows: list[dict[str, Any]], records: Sequence[Record]) -> None:
    """Ratios to the median of the reference's runs at the same level; outputs identical to its first run."""
    ref_text = {(r.concurrency, r.prompt_id): r.text for r in records if r.system == REFERENCE and r.run == 0}
    for row in rows:
        c = row["concurrency"]
        refs = [r for r in rows if r["system"] == REFERENCE and r["concurrency"] == c]
        ref_tps = statistics.median(r["output_tokens_per_s"] for r in refs)
        row["speedup_vs_vllm"] = row["output_tokens_per_s"] / ref_tps if ref_tps else None
        ref_decode = [r["decode_tokens_per_s"] for r in refs if r.get("decode_tokens_per_s")]
        row["decode_speedup_vs_vllm"] = (row["decode_tokens_per_s"] / statistics.median(ref_decode)
                                         if ref_decode and row.get("decode_tokens_per_s") else None)
        per_domain = {}
        for d, v in row["per_domain_tokens_per_s"].items():
            ref_d = statistics.median(r["per_domain_tokens_per_s"].get(d, 0.0) for r in refs)
            per_domain[d] = v / ref_d if ref_d else None
        row["per_domain_speedup_vs_vllm"] = per_domain
        decode = row.get("per_domain_decode_tokens_per_s", {})  # after the first token: TTFT left out
        ref_decode_d = {d: _median([r.get("per_domain_decode_tokens_per_s", {}).get(d) for r in refs]) for d in decode}
        row["per_domain_decode_speedup_vs_vllm"] = {
            d: v / ref_decode_d[d] if v and ref_decode_d[d] else None for d, v in decode.items()}
        mine = [r for r in records if r.system == row["system"] and r.run == row["run"] and r.concurrency == c]
        row["identical_to_vllm"] = sum(ref_text.get((c, r.prompt_id)) == r.text for r in mine)
    for c in {r["concurrency"] for r in rows}:
        peer_rows = [r for r in rows if r["concurrency"] == c and r["system"].partition("@")[0] in PEERS]
        peers = [r["output_tokens_per_s"] for r in peer_rows]
        peer_decode = [r["decode_tokens_per_s"] for r in peer_rows if r.get("decode_tokens_per_s")]
        for row in rows:
            if row["concurrency"] == c and peers:
                row["speedup_vs_best_vllm_speculation"] = row["output_tokens_per_s"] / max(peers)
            if row["concurrency"] == c and peer_decode and row.get("decode_tokens_per_s"):
                row["decode_speedup_vs_best_vllm_speculation"] = row["decode_tokens_per_s"] / max(peer_decode)


def format_table(report: dict[str, Any]) -> str:
    """The report's rows as a fixed-width text table, one line per (system, run, concurrency)."""
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = [f"{'system':>15} {'run':>3} {'c':>2} {'tok/s':>6} {'x vllm':>6} {'x best spec':>11} "
             f"{'decode x vllm':>13} {'decode x spec':>13} {'TPOT ms':>7} "
             f"{'TTFT s':>6} {'p50 s':>6} {'p99 s':>6} {'acc.len':>7} {'late':>5} {'w/draft':>7} "
             f"{'step ms':>7} {'busy':>5} identical"]
    for r in report["rows"]:
        busy = [d["busy_fraction"] for d in r.get("drafters", {}).values() if d["busy_fraction"] is not None]
        step = r.get("verifier_step_s")
        lines.append(
            f"{r['system']:>15} {r['run']:>3} {r['concurrency']:>2} {f(r['output_tokens_per_s']):>6} "
            f"{f(r['speedup_vs_vllm']):>6} {f(r.get('speedup_vs_best_vllm_speculation')):>11} "
            f"{f(r.get('decode_speedup_vs_vllm')):>13} {f(r.get('decode_speedup_vs_best_vllm_speculation')):>13} "
            f"{f(r['tpot_ms_p50']):>7} {f(r['ttft_s_p50']):>6} {f(r['latency_s_p50']):>6} "
            f"{f(r['latency_s_p99']):>6} {f(r['mean_acceptance_length']):>7} {f(r['drafts_late']):>5} "
            f"{f(r['steps_with_draft_fraction']):>7} {f(step * 1e3 if step else None):>7} "
            f"{f(statistics.mean(busy) if busy else None):>5} {r['identical_to_vllm']}/{r['requests']}")
    if report.get("summary") and report.get("repeat", 1) > 1:
        def spread(v: Any) -> str:
            return f"[{v[0]:.3g}-{v[1]:.3g}]" if v else ""

        lines += ["", f"medians over {report['repeat']} runs each (spread: min-max of the per-repeat ratios)"
                      + (f"; open loop at {report['request_rate']:g} requests/s: tok/s follows the arrival rate, "
                         "so read TPOT and the per-domain ratios (latency)" if report.get("request_rate") else ""),
                  f"{'system':>15} {'c':>2} {'runs':>4} {'tok/s':>6} {'x vllm':>16} {'x best spec':>16} "
                  f"{'TPOT ms':>7} {'acc.len':>7} {'w/draft':>7}"]
        for e in report["summary"]:
            vs_v = f"{f(e['ratio_vs_vllm'])} {spread(e['ratio_vs_vllm_spread'])}"
            best = "ratio_vs_best_vllm_speculation"
            vs_s = f"{f(e.get(best))} {spread(e.get(best + '_spread'))}"
            lines.append(f"{e['system']:>15} {e['concurrency']:>2} {e['runs']:>4} {f(e['output_tokens_per_s']):>6} "
                         f"{vs_v:>16} {vs_s:>16} {f(e['tpot_ms_p50']):>7} {f(e['mean_acceptance_length']):>7} "
                         f"{f(e['steps_with_draft_fraction']):>7}")
        lines += ["", "per domain x vllm: median [min-max] of the per-repeat ratios; the slowest prompt "
                      "(its mean speed over the runs x vllm's on it)"]
        for e in report["summary"]:
            if e["system"] == REFERENCE or not e.get("ratio_vs_vllm_per_domain"):
                continue
            slowest = e.get("slowest_prompt_vs_vllm", {})
            cells = [f"{d} {f(m)} [{f(lo)}-{f(hi)}]" + (f" (slowest {f(slowest[d][1])})" if d in slowest else "")
                     for d, (m, lo, hi) in e["ratio_vs_vllm_per_domain"].items()]
            lines.append(f"{e['system']:>15} {e['concurrency']:>2}  " + ", ".join(cells))
    if report.get("draft_cost"):
        lines += ["", f"{'draft engine':>12} {'model':>28} {'threads':>7} {'batch':>5} {'prefill tok/s':>13} "
                      f"{'step ms':>7} {'ms/draft token':>14}"]
        for c in report["draft_cost"]:
            figures = (f"failed: {c['error'].splitlines()[0]}" if "error" in c else
                       f"{c['threads']:>7} {c['batch']:>5} {f(c['prefill_tokens_per_s']):>13} "
                       f"{f(c['draft_step_s'] * 1e3):>7} {f(c['draft_s_per_token'] * 1e3):>14}")
            lines.append(f"{c['engine']:>12} {c['model']:>28} {figures}")
    return "\n".join(lines)


def placement_evidence_of(report: dict[str, Any]) -> dict[str, Any]:
    """What `report` measured for `cosine serve --placement auto`, as `placement.evidence_document`:
    the figures of this bench's own systems (`calibration.placement_evidence`), empty where unmeasured."""
    from cosine.simulation.calibration import placement_evidence

    base = Evidence(cores=1, pool_cores=0, source=str(report.get("workload", "")) or "cosine bench")
    try:
        measured = placement_evidence(report, base, pooled=CLUSTERS)
    except (KeyError, ValueError, ZeroDivisionError, StopIteration):  # a report without the rows it needs
        measured = base
    return evidence_document(measured)


def write_report(report: dict[str, Any], out: Path, *, evidence: bool = True) -> None:
    """Write the report as indented JSON to `out` and, with `evidence`, to `last_bench_path()`
    (what `auto` placement reads: a finished run's, not a checkpoint's), creating their directories.
    A finished report carries its placement evidence (`placement.EVIDENCE_KEY`)."""
    if evidence:
        report = {**report, EVIDENCE_KEY: placement_evidence_of(report)}
    text = json.dumps(report, indent=1)
    for path in (out, last_bench_path()) if evidence else (out,):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


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
    a.set_xlabel("concurrency" if not report.get("request_rate") else "most requests in flight")
    a.set_ylabel("output tokens/s")
    b.set_xlabel("concurrency")
    b.set_ylabel("x vLLM target-only")
    b.axhline(1.0, color="grey", lw=0.8)
    a.legend()
    load = f", open loop at {report['request_rate']:g} req/s" if report.get("request_rate") else ""
    fig.suptitle(f"{report['model']} on {report['workload']}, max_tokens {report['max_tokens']}, "
                 f"placement {report.get('placement', 'shared')}{load}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
