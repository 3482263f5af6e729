"""The most any drafter could give in one cell of `cosine simulate --studies paper`: an engine
drafter whose every draft token is accepted and whose forwards cost nothing, run as vLLM runs
`eagle3` (async scheduling on, k tokens for every request every step), per dollar against the
study's `eagle3` on the same requests. What is left is the verifier's own work: each prompt token
and each output token passes through the target once, and at concurrency 64 those passes are
compute-bound (a development script; nothing of the tests runs it, ~1 minute a cell).

    python3 tools/sim_ceiling.py --pair llama-70b --workload code --concurrency 64
"""

from __future__ import annotations

import argparse
import dataclasses
import random

from cosine.routing import DOMAINS
from cosine.simulation import scenarios
from cosine.simulation.cluster import EAGLE3, EngineDrafterModel, RequestSpec, Workload, simulate
from cosine.simulation.cost_models import AcceptanceModel, load_profiles

ALWAYS = 0.9999  # the per-token acceptance of a drafter that is always right (Beta needs it below 1)


def cell_requests(workload: str, c: int, seed: int = 0, levels: tuple[int, ...] = (16, 64)) -> tuple[RequestSpec, ...]:
    """The requests `scenarios.paper_testbed` draws for one workload at concurrency `c` (its draws
    run level by level from one generator per workload)."""
    rng = random.Random(f"{seed}/{workload}")
    out: tuple[RequestSpec, ...] = ()
    for level in levels:
        drawn = tuple(RequestSpec(0.0, 256, 128, rng.choice(scenarios.WORKLOADS[workload]))
                      for _ in range(6 * level))
        out = drawn if level == c else out
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="llama-70b", choices=tuple(scenarios.PAIRS))
    ap.add_argument("--workload", default="code", choices=tuple(scenarios.WORKLOADS))
    ap.add_argument("--concurrency", type=int, default=64, choices=(16, 64))
    args = ap.parse_args(argv)
    reqs, c = cell_requests(args.workload, args.concurrency), args.concurrency
    setups = scenarios.paper_setups(args.pair, load_profiles(), Workload(reqs[: 4 * c], c),
                                    domains=scenarios.WORKLOADS[args.workload])
    eagle3 = float(simulate(setups["eagle3"], Workload(reqs, c)).summary()["throughput_tok_s"])
    target_only = setups["target-only"]
    for k in (1, 2, 3, 4, 6, 8):
        oracle = dataclasses.replace(
            target_only, mode="vanilla", engine_drafter=EngineDrafterModel(EAGLE3, k, lambda batch: 0.0),
            acceptance=AcceptanceModel({(EAGLE3, d): ALWAYS for d in DOMAINS}, {EAGLE3: 1e6}, ALWAYS),
            speculation=dataclasses.replace(target_only.speculation, max_draft_len=k))
        tok_s = float(simulate(oracle, Workload(reqs, c)).summary()["throughput_tok_s"])
        print(f"{args.pair} {args.workload} c={c}: always right and free, k={k}: {tok_s:.0f} tok/s, "
              f"{tok_s / eagle3:.3f}x eagle3 per dollar (same verifier, same price)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
