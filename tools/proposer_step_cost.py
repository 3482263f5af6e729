"""Measure what CoSine's proposer costs a verifier step on the CPU: `observe_step` + `propose` per
engine step, by batch size, with the sources `cosine serve` runs beside a head (the engine's drafter
as an `EngineSource`, prompt and suffix lookup as a `LookupSource` over the served `SuffixLookup`),
no pools; and with lookup alone (what vLLM's `suffix` proposer does each step, plus our choice
of k). `cosine simulate` charges it to every simulated CoSine step (a development script; its
output is kept as package data, so nothing of the tests runs it).

    python3 tools/proposer_step_cost.py --out runtime/src/cosine/simulation/data/proposer_step_cost.json

Each figure is the least of `--repeats` runs (the machine is shared), taken round by round over
every batch size, so a burst of load spoils one run of each figure rather than every run of one.
The requests are synthetic (`cosine.simulation.proposer_workload`, whose drafts
`tests/runtime/test_proposer_drafts.py` pins): 256-token prompts and outputs over a 2,000-token
vocabulary in which 12-token phrases repeat, so lookup finds drafts on part of the steps (as on chat); the head's
draft is the target's next tokens at a per-token rate of 0.7, k = 5. Measured on whatever CPU
runs it: a GPU host's CPU is usually faster than a shared 2-core development machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import time
from pathlib import Path

from cosine.lookup import SuffixLookup, SuffixSettings
from cosine.proposer import CoSineProposer, ProposerSettings, StepRecord
from cosine.simulation.proposer_workload import head_drafts, phrase_book, text, verify
from cosine.sources.engine import EngineSource
from cosine.sources.lookup import LookupSource


def measure(batch: int, steps: int, head: bool = True, seed: int = 0, k: int = 5, alpha: float = 0.7) -> float:
    """Mean wall seconds of one step's `observe_step` + `propose` at `batch` running requests, with
    the engine's drafter as a source (`head`) and lookup, or lookup alone."""
    rng = random.Random(seed)
    phrases = phrase_book(rng)
    engine = EngineSource("eagle3")
    lookup = LookupSource(SuffixLookup(SuffixSettings()))
    proposer = CoSineProposer(ProposerSettings(), sources=[engine, lookup] if head else [lookup])
    truth = {f"r{i}": text(rng, phrases, 256 + 2048) for i in range(batch)}
    emitted = dict.fromkeys(truth, 256)
    drafts: dict[str, list[int]] = {}
    times = []
    for step in range(steps):
        outcomes = verify(proposer, drafts, truth, emitted)
        contexts = {rid: truth[rid][:pos] for rid, pos in emitted.items()}
        engine.offer(head_drafts(rng, truth, emitted, k, alpha))
        t0 = time.perf_counter()
        proposer.observe_step(StepRecord(0.03, batch + sum(len(d) for d in drafts.values()), tuple(outcomes)))
        drafts = proposer.propose(contexts, dict.fromkeys(contexts, 256))
        if step >= 20:  # warm: every request routed and its prompt indexed
            times.append(time.perf_counter() - t0)
    return statistics.mean(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,4,16,64,128")
    ap.add_argument("--steps", type=int, default=220)
    ap.add_argument("--repeats", type=int, default=5, help="the least of this many runs is kept (a shared CPU)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    runs: dict[tuple[int, bool], list[float]] = {}
    for r in range(args.repeats):  # round by round, so a burst of load on the machine hits one run of each figure
        for b in batches:
            for head in (True, False):
                runs.setdefault((b, head), []).append(measure(b, args.steps, head=head, seed=r))
    rows = {str(b): min(runs[(b, True)]) for b in batches}
    lookup_rows = {str(b): min(runs[(b, False)]) for b in batches}
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = {"measured": datetime.date.today().isoformat(), "cpu": cpu,
           "command": f"python3 tools/proposer_step_cost.py --out {args.out}",
           "what": "wall seconds per engine step of CoSineProposer.observe_step + propose, by running requests "
                   "(EngineSource + LookupSource(SuffixLookup), no pools)",
           "step_s": rows, "lookup_only_step_s": lookup_rows}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
