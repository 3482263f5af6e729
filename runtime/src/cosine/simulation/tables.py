"""The studies' tables as Markdown, written into a document between markers, so the docs show the
study's output and nothing copied by hand (`cosine simulate --studies paper,spot --tables FILE`).

A block is everything between `<!-- study:NAME -->` and `<!-- /study:NAME -->` (NAME: `paper`,
`paper-summary`, `spot`, `affinity`); the markers stay, the lines between are replaced.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from cosine.simulation.scenarios import AFFINITY_ROUTERS, AFFINITY_SYSTEMS, PAPER_SYSTEMS, SPOT_SYSTEMS


def _pct(x: float) -> str:
    return f"{x * 100:+.0f}%".replace("-", "−")


def _x(x: float) -> str:
    return f"{x:.2f}"


def paper_markdown(study: dict[str, Any]) -> str:
    """The paper study (`scenarios.paper_testbed`) as one table per pair and workload: every
    system's goodput per dollar at each concurrency, and what each part of `cosine` adds."""
    cs = [str(c) for c in study["concurrency"]]
    out = []
    for pair, workloads in study["pairs"].items():
        for workload, levels in workloads.items():
            out += [f"**{pair}, {workload}**", "",
                    "| system | k | " + " | ".join(f"tok/s per $/h, c={c} | × `eagle3`" for c in cs)
                    + f" | TPOT p50, c={cs[0]} | accepted per step, c={cs[0]} |",
                    "|---|---|" + "---|---|" * len(cs) + "---|---|"]
            first = levels[cs[0]]
            for system in PAPER_SYSTEMS:
                cells = []
                for c in cs:
                    r, e = levels[c][system], levels[c]["eagle3"]
                    cells.append(f"{r['tok_s_per_usd_h']:.1f} | {_x(r['tok_s_per_usd_h'] / e['tok_s_per_usd_h'])}")
                r = first[system]
                out.append(f"| `{system}` | {r['draft_len']} | " + " | ".join(cells)
                           + f" | {r['tpot_p50_s'] * 1e3:.1f} ms | {r['mean_accepted_per_step']:.2f} |")
            out += ["", "What each part adds to `cosine` per dollar (`cosine` over the ablation without it): "
                    + "; ".join(f"c={c}: " + ", ".join(f"{part} {_pct(g)}" for part, g in levels[c]["gains"].items())
                                for c in cs) + ".", "",
                    f"With the autoscaler on (`cosine-autoscaled`, pools from one replica down to `minReplicas` "
                    f"0, {levels[cs[0]]['autoscaled']['duration_s']:.0f} s closed loop beside `cosine-head`), per "
                    "dollar against `cosine-head`: " + "; ".join(
                        f"c={c}: {_pct(levels[c]['autoscaled']['vs_cosine_head'] - 1)}, pool replicas "
                        + ", ".join(f"{p} " + " → ".join(str(n) for _, n in tl[:-1])
                                    for p, tl in levels[c]["autoscaled"]["pool_replicas"].items())
                        for c in cs) + ".", ""]
    return "\n".join(out).rstrip() + "\n"


def spot_markdown(study: dict[str, Any]) -> str:
    """The spot study (`scenarios.spot_study`) as one table per target and concurrency."""
    a = study["assumed"]
    out = [f"Assumed: spot at {a['spot_price_ratio']:.0%} of the on-demand price; each spot replica preempted "
           f"{a['preemptions_per_replica_hour']:g} times an hour with {a['notice_s']:g} s of notice, replaced "
           f"after {a['replacement_s']:g} s; {study['duration_s']:g} s closed loop per system.", ""]
    for target, levels in study["targets"].items():
        for c, level in levels.items():
            out += [f"**{target}, concurrency {c}**", "",
                    "| system | k | tok/s per $/h | $/h | TPOT p50 / p99 | preemptions | requests re-homed |",
                    "|---|---|---|---|---|---|---|"]
            for system in SPOT_SYSTEMS:
                r = level[system]
                out.append(f"| `{system}` | {r['draft_len']} | {r['tok_s_per_usd_h']:.1f} | {r['usd_per_hour']:.2f} "
                           f"| {r['tpot_p50_s'] * 1e3:.1f} / {r['tpot_p99_s'] * 1e3:.1f} ms | {r['preemptions']} "
                           f"| {r['rehomed_requests']} of {r['requests']} |")
            out += ["", f"Winner per dollar: `{level['winner']}`. `cosine-spot` against `cosine-head` "
                    f"{_pct(level['cosine_spot_vs_cosine_head'])}, against `eagle3` "
                    f"{_pct(level['cosine_spot_vs_eagle3'])}, against `eagle3-best` "
                    f"{_pct(level['cosine_spot_vs_eagle3_best'])}, against on-demand pools "
                    f"{_pct(level['spot_vs_on_demand'])}.", ""]
    return "\n".join(out).rstrip() + "\n"


def paper_summary_markdown(study: dict[str, Any]) -> str:
    """The paper study in one line per pair and workload: per dollar, `cosine-head` against vLLM's
    `eagle3` with the same head, `cosine` (with pools) against `cosine-head` and target-only, and
    `cosine-autoscaled` (its pools autoscaled, `AUTOSCALED_S` closed loop) against `cosine-head`,
    at each concurrency (c=16 / c=64)."""
    cs = [str(c) for c in study["concurrency"]]
    levels = " / ".join(f"c={c}" for c in cs)
    out = [f"| pair | workload | `cosine-head` × `eagle3` ({levels}) | `cosine` × `cosine-head` "
           "| `cosine-autoscaled` × `cosine-head` "
           "| `cosine` × target-only | `cosine` × `lookup` | `cosine` × `eagle3-best` |",
           "|---|---|---|---|---|---|---|---|"]
    for pair, workloads in study["pairs"].items():
        for workload, by_c in workloads.items():
            def ratio(key: str, system: str = "cosine", by_c: dict[str, Any] = by_c) -> str:
                return " / ".join(_x(by_c[c]["ratios"][system][key]) for c in cs)

            auto = " / ".join(_x(by_c[c]["autoscaled"]["vs_cosine_head"]) for c in cs)
            out.append(f"| {pair} | {workload} | {ratio('vs_eagle3', 'cosine-head')} | {ratio('vs_cosine_head')} "
                       f"| {auto} | {ratio('vs_target_only')} | {ratio('vs_lookup')} | {ratio('vs_eagle3_best')} |")
    return "\n".join(out) + "\n"


def affinity_markdown(study: dict[str, Any]) -> str:
    """The routing study (`scenarios.affinity_study`) as one table, a row per system and router."""
    c = study["conversation"]
    out = [f"{study['replicas']} verifier replicas of `{study['pair']}`, {study['sessions']} conversations of "
           f"{c['turns']} turns ({c['system_tokens']} system, {c['user_tokens']} user and {c['output_tokens']} reply "
           f"tokens a turn), {study['concurrency']} at a time; a prefix cache of {study['prefix_cache_tokens']:,} "
           f"tokens per replica; lookup's hit rate on a conversation the replica served before × "
           f"{study['seen_hit_factor']:.2f}.", "",
           "| system / router | acceptance length | prompt from the prefix cache | TTFT p50 | TPOT p50 / p99 "
           "| tok/s per $/h | per $ vs random |",
           "|---|---|---|---|---|---|---|"]
    for system in AFFINITY_SYSTEMS:
        for router in AFFINITY_ROUTERS:
            r = study["rows"][f"{system} / {router}"]
            vs = _pct(r["per_usd_vs_random"]) if "per_usd_vs_random" in r else "(reference)"
            out.append(f"| `{system}` / {router} | {r['acceptance_length']:.2f} "
                       f"| {r['prefix_cache_hit_fraction']:.0%} "
                       f"| {r['ttft_p50_s'] * 1e3:.0f} ms "
                       f"| {r['tpot_p50_s'] * 1e3:.1f} / {r['tpot_p99_s'] * 1e3:.1f} ms "
                       f"| {r['tok_s_per_usd_h']:.1f} | {vs} |")
    sk = study["skewed"]
    out += ["", f"Uneven conversations, `cosine` only: {sk['long_share']:.0%} long ({sk['long'][0]} turns of "
            f"{sk['long'][1]}-token replies), the rest short ({sk['short'][0]} turns of {sk['short'][1]}).", "",
            "| router | prompt from the prefix cache | TTFT p50 | TPOT p50 | latency p99 | tok/s per $/h "
            "| per $ vs random |",
            "|---|---|---|---|---|---|---|"]
    for router, r in study["skewed_rows"].items():
        vs = _pct(r["per_usd_vs_random"]) if "per_usd_vs_random" in r else "(reference)"
        out.append(f"| {router} | {r['prefix_cache_hit_fraction']:.0%} | {r['ttft_p50_s'] * 1e3:.0f} ms "
                   f"| {r['tpot_p50_s'] * 1e3:.1f} ms | {r['latency_p99_s']:.2f} s "
                   f"| {r['tok_s_per_usd_h']:.1f} | {vs} |")
    return "\n".join(out) + "\n"


RENDERERS = {"paper": ("paper_testbed", paper_markdown), "paper-summary": ("paper_testbed", paper_summary_markdown),
             "spot": ("spot", spot_markdown), "affinity": ("affinity", affinity_markdown)}


def replace_block(text: str, name: str, body: str) -> str:
    """`text` with the lines between `<!-- study:NAME -->` and `<!-- /study:NAME -->` replaced by
    `body`. Raises ValueError when the markers are missing."""
    pattern = re.compile(rf"(<!-- study:{name} -->\n).*?(<!-- /study:{name} -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no <!-- study:{name} --> ... <!-- /study:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + "\n" + body + "\n" + m.group(2), text, count=1)


def write_tables(path: Path, result: dict[str, Any]) -> list[str]:
    """Rewrite each block of `path` whose study is in `result` (`run.run_simulate`'s output);
    returns the names written. Raises ValueError when `path` holds no block of those studies."""
    text = Path(path).read_text()
    written = []
    for name, (key, render) in RENDERERS.items():
        if key in result and f"<!-- study:{name} -->" in text:
            text = replace_block(text, name, render(result[key]))
            written.append(name)
    if not written:
        raise ValueError(f"{path}: no <!-- study:NAME --> block for the studies run")
    Path(path).write_text(text)
    return written
