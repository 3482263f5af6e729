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


def paper_markdown(study: dict[str, Any]) -> str:
    """The paper study (`scenarios.paper_testbed`) as one table per pair and a line on who wins."""
    out = []
    for pair, rows in study["pairs"].items():
        base = rows["target-only"]
        out += [f"**{pair}**", "",
                "| system | k | tok/s per $/h, c=16 | vs target-only | latency p50, 1 req/s | TPOT p50 / p99, c=16 "
                "| accepted per step |",
                "|---|---|---|---|---|---|---|"]
        for system in PAPER_SYSTEMS:
            r = rows[system]
            out.append(f"| `{system}` | {r['draft_len']} | {r['tok_s_per_usd_h']:.1f} "
                       f"| {_pct(r['tok_s_per_usd_h'] / base['tok_s_per_usd_h'] - 1)} | {r['latency_p50_s']:.2f} s "
                       f"| {r['tpot_p50_s'] * 1e3:.1f} / {r['tpot_p99_s'] * 1e3:.1f} ms "
                       f"| {r['mean_accepted_per_step']:.2f} |")
        ratios = rows["ratios"]
        out += ["", f"Best baseline per dollar: `{ratios['cosine']['best_baseline']}`. Per dollar against it: "
                + ", ".join(f"`{s}` {_pct(r['throughput_per_usd_vs_best_baseline'])}" for s, r in ratios.items())
                + "; against `lookup`: "
                + ", ".join(f"`{s}` {_pct(r['throughput_per_usd_vs_lookup'])}" for s, r in ratios.items()) + ".", ""]
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
            out += ["", f"Winner per dollar: `{level['winner']}`. `cosine-spot` against `eagle3` "
                    f"{_pct(level['cosine_spot_vs_eagle3'])}, against `eagle3-best` "
                    f"{_pct(level['cosine_spot_vs_eagle3_best'])}, against on-demand pools "
                    f"{_pct(level['spot_vs_on_demand'])}.", ""]
    return "\n".join(out).rstrip() + "\n"


def paper_summary_markdown(study: dict[str, Any]) -> str:
    """The paper study in one line per pair: `cosine` as served, per dollar, against each system a
    user would run instead."""
    out = ["| pair, concurrency 16 | per dollar × target-only | × `lookup` | × `eagle3` | × `eagle3-best` "
           "| latency p50 × target-only |",
           "|---|---|---|---|---|---|"]
    for pair, rows in study["pairs"].items():
        co = rows["cosine"]

        def per_usd(system: str, co: dict[str, Any] = co, rows: dict[str, Any] = rows) -> str:
            return f"{co['tok_s_per_usd_h'] / rows[system]['tok_s_per_usd_h']:.2f}"

        out.append(f"| {pair} | {per_usd('target-only')} | {per_usd('lookup')} | {per_usd('eagle3')} "
                   f"| {per_usd('eagle3-best')} | {co['latency_p50_s'] / rows['target-only']['latency_p50_s']:.2f} |")
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
