"""Figures of `cosine simulate`: one PNG with the run's replica timeline and, when present, the
paper testbed's throughput per dollar, the RTT x speed-ratio map and the autoscaler timelines
(matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COLORS = {"target-only": "#999999", "vanilla": "#1f77b4", "cosine": "#d62728"}


def plot(result: dict[str, Any], path: Path) -> None:
    """Draw the panels `result` has data for into `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("run", "paper_testbed", "rtt_sweep", "autoscale") if k in result]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4.5), squeeze=False)
    for ax, key in zip(axes[0], panels, strict=False):
        if key == "run":
            for name, tl in result["run"]["timeline"].items():
                ax.step([t for t, _ in tl], [n for _, n in tl], where="post", label=name)
            ax.set(title=f"{result['run']['mode']}: drafter replicas", xlabel="time (s)", ylabel="replicas")
            ax.legend()
        elif key == "paper_testbed":
            study = result["paper_testbed"]
            c = str(study["concurrency"][0])
            cells = [(f"{pair}\n{workload}", levels[c]) for pair, workloads in study["pairs"].items()
                     for workload, levels in workloads.items()]
            systems = [s for s in cells[0][1] if s not in ("ratios", "gains")]
            width = 0.8 / len(systems)
            for i, system in enumerate(systems):  # per dollar against vLLM's own eagle3 in each cell
                ax.bar([j + i * width for j in range(len(cells))],
                       [rows[system]["tok_s_per_usd_h"] / rows["eagle3"]["tok_s_per_usd_h"] for _, rows in cells],
                       width, label=system)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))], [name for name, _ in cells], fontsize=7)
            ax.set(title=f"paper testbed: per dollar × eagle3, concurrency {c}", ylabel="× eagle3")
            ax.legend(fontsize=7)
        elif key == "rtt_sweep":
            cells = result["rtt_sweep"]["cells"]
            rate = max(c["rate"] for c in cells)
            for c in cells:
                if c["rate"] == rate:
                    ax.scatter(c["rtt_ms"], c["speed_ratio"], s=160, marker="s", color=_COLORS[c["best"]])
            for name, color in _COLORS.items():
                ax.scatter([], [], color=color, marker="s", label=f"{name} fastest (p50)")
            ax.set(xscale="log", title=f"lowest p50 latency at {rate} req/s (closed form 1+γ·t_d/t_v on y)",
                   xlabel="RTT (ms)", ylabel="t_d / t_v")
            ax.legend(fontsize=8)
        else:
            tl = result["autoscale"]["timeline"]
            for name, series in tl.items():
                ax.step([t for t, _ in series], [n for _, n in series], where="post", label=name)
            ax.set(title="autoscaler, load step (req/s " + "→".join(f"{r:g}" for r in result["autoscale"]["rates"])
                   + ")", xlabel="time (s)", ylabel="replicas")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
