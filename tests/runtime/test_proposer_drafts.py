"""The proposer's drafts on a seeded synthetic workload, pinned by fingerprint.

What is checked: on the workload `tools/proposer_step_cost.py` times
(`cosine.simulation.proposer_workload`: 256-token prompts over a
2,000-token vocabulary with repeating 12-token phrases; the engine's head drafts the target's next
tokens at a per-token rate of 0.7, k = 5; the target accepts a draft's matching prefix), every
draft `CoSineProposer.propose` returns, step by step and request by request, and the source it
names, hash to the fingerprints recorded below. Configurations: head + lookup at 1, 4, 16 and 64
requests (the sources `cosine serve` runs beside a head), lookup alone, the acceptance-rate rule,
a context limit, and head + lookup + two drafter pools fused (an in-line executor and a step clock,
so the pools' drafts arrive deterministically). Requests finish and new ones start part way, so
the router's per-domain priors and new requests' initial states are exercised too.

Why fingerprints: these pin the drafts to those of the proposer before its per-step cost was cut
(recorded at 360ad3f; re-recorded at 73d0f0a, after the chooser verifies the candidate with the most
expected accepted tokens where candidates part and the head drafts only as deep as verified, and
the cheaper proposer reproduces those too; re-recorded again when candidates came to be weighed by
their goodput on the step's pass instead, `DraftChooser.fuse`), so a change meant to be structural or for speed only
is proven not to change a single draft. A change of policy (what is drafted, or k) moves them on purpose:
re-record with `python3 tests/runtime/test_proposer_drafts.py` and say in the commit why they moved.
"""

from __future__ import annotations

import hashlib
import random
from concurrent.futures import Executor, Future

import pytest
from cosine_spec.cluster_spec import SpeculationSpec

from cosine.drafter import Draft
from cosine.lookup import SuffixLookup, SuffixSettings
from cosine.proposer import CoSineProposer, ProposerSettings, StepRecord
from cosine.simulation.proposer_workload import VOCAB, head_drafts, phrase_book, text, verify
from cosine.sources.engine import EngineSource
from cosine.sources.lookup import LookupSource


class InlineExecutor(Executor):
    """Runs each call at once, on the caller's thread: a pool's draft is back when asked."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - the future carries it, as a thread pool's would
            fut.set_exception(e)
        return fut


class TruthPool:
    """A drafter pool that drafts the target's continuation at per-token rate `alpha`
    (deterministic: its own seeded generator; each draft 'took' `draft_s`)."""

    def __init__(self, name: str, truth: dict[str, list[int]], alpha: float, seed: int,
                 confidence: float = 0.8, draft_s: float = 0.002) -> None:
        self.name, self.truth, self.alpha, self.confidence, self.draft_s = name, truth, alpha, confidence, draft_s
        self.rng = random.Random(seed)

    def propose(self, request_id, context_ids, max_tokens, *, min_confidence=0.0, expected=(), max_branches=0):
        pos, out = len(context_ids), []
        for j in range(max_tokens):
            ok = self.rng.random() < self.alpha
            out.append(self.truth[request_id][pos + j] if ok else VOCAB + 2)
            if not ok:
                break
        return Draft(tuple(out), (self.confidence,) * len(out), self.name, self.draft_s)

    def release(self, request_id: str) -> None:
        pass


def drive(batch: int, steps: int, *, head: bool = True, lookup: bool = True, pools: int = 0, seed: int = 0,
          speculation: SpeculationSpec | None = None, max_model_len: int | None = None,
          k: int = 5, alpha: float = 0.7, life: int = 120) -> str:
    """SHA-256 over every (step, request, draft, source) the proposer proposes on the workload
    `tools/proposer_step_cost.py` times (`cosine.simulation.proposer_workload`); a request
    finishes after about `life` steps (staggered) and a new one takes its place, its domain one of two."""
    rng = random.Random(seed)
    phrases = phrase_book(rng)
    now = [0.0]
    truth: dict[str, list[int]] = {}
    engine = EngineSource("eagle3")
    sources = ([engine] if head else []) + ([LookupSource(SuffixLookup(SuffixSettings()))] if lookup else [])
    drafters = [TruthPool(f"pool{i}", truth, 0.6 + 0.1 * i, seed + i) for i in range(pools)]
    settings = ProposerSettings(speculation=speculation or SpeculationSpec(max_draft_len=k),
                                max_model_len=max_model_len)
    proposer = CoSineProposer(settings, drafters, {"pool1": ("code",)} if pools > 1 else None,
                              classify=lambda prompt: "code" if prompt[0] % 2 else "chat",
                              clock=lambda: now[0], seed=seed, sources=sources, executor=InlineExecutor())
    emitted: dict[str, int] = {}
    ends: dict[str, int] = {}
    started = [0]

    def start() -> None:
        rid = f"r{started[0]}"
        started[0] += 1
        truth[rid] = text(rng, phrases, 256 + 2048)
        emitted[rid] = 256
        ends[rid] = life + rng.randrange(life)

    for _ in range(batch):
        start()
    digest = hashlib.sha256()
    drafts: dict[str, list[int]] = {}
    for step in range(steps):
        outcomes = verify(proposer, drafts, truth, emitted)
        for rid in [r for r in emitted if step >= ends[r]]:
            del emitted[rid]
            proposer.release(rid)
            start()
        row = head_drafts(rng, truth, emitted, k, alpha)
        contexts = {rid: truth[rid][:pos] for rid, pos in emitted.items()}
        engine.offer(row)
        proposer.observe_step(StepRecord(0.01 + 0.0004 * (len(emitted) + sum(len(d) for d in drafts.values())),
                                         len(emitted) + sum(len(d) for d in drafts.values()), tuple(outcomes)))
        now[0] += 0.03
        drafts = proposer.propose(contexts, dict.fromkeys(contexts, 256))
        for rid, d in drafts.items():
            digest.update(f"{step} {rid} {proposer.source_of(rid)} {d}\n".encode())
    proposer.close()
    return digest.hexdigest()[:16]


CASES = {
    "head+lookup 1": dict(batch=1, steps=300),
    "head+lookup 4": dict(batch=4, steps=300),
    "head+lookup 16": dict(batch=16, steps=300),
    "head+lookup 64": dict(batch=64, steps=200),
    "lookup 16": dict(batch=16, steps=300, head=False),
    "head 16": dict(batch=16, steps=300, lookup=False),
    "acceptance rate 16": dict(batch=16, steps=300, speculation=SpeculationSpec(max_draft_len=5,
                                                                                draft_length="acceptanceRate")),
    "context limit 8": dict(batch=8, steps=300, max_model_len=400),
    "pools fused 8": dict(batch=8, steps=300, pools=2),
    "one pool 8": dict(batch=8, steps=300, pools=1, speculation=SpeculationSpec(max_draft_len=5, fusion=False)),
}

FINGERPRINTS = {
    'head+lookup 1': 'a10a711ef7744375',
    'head+lookup 4': 'a164ee1789305991',
    'head+lookup 16': 'e49b3556e1951ea5',
    'head+lookup 64': 'a67afd5c08479769',
    'lookup 16': 'db4162d6e6023be0',
    'head 16': 'd73fe761a42b4b97',
    'acceptance rate 16': '8a3a0984e8cb222c',
    'context limit 8': 'a24e0633ff148f29',
    'pools fused 8': '3b9af72abd902722',
    'one pool 8': 'a4b2ed24ea1078fe',
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_drafts_match_the_recorded_fingerprints(case):
    assert drive(**CASES[case]) == FINGERPRINTS[case]


if __name__ == "__main__":  # re-record (see the module docstring)
    for name in CASES:
        print(f"    {name!r}: {drive(**CASES[name])!r},")
