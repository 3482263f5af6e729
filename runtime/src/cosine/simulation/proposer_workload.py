"""The synthetic requests CoSine's proposer is timed and pinned on.

`tools/proposer_step_cost.py` measures the proposer's wall time per engine step on them (the figures
`cost_models.proposer_step_s` reads), and `tests/runtime/test_proposer_drafts.py` fingerprints every
draft the proposer makes on them. Both draw from one seeded `random.Random` in the same order, so
the figures and the fingerprints are over the same requests.

The requests: texts over a `VOCAB`-token vocabulary in which `PHRASES` phrases of `PHRASE_TOKENS`
tokens repeat (half of each text), so prompt lookup finds drafts on part of the steps, as on chat;
the engine's head drafts the target's next tokens at a per-token rate `alpha`; the target accepts a
draft's matching prefix plus its bonus token.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, MutableMapping, Sequence

from cosine.proposer import CoSineProposer, RequestOutcome

PHRASES, PHRASE_TOKENS, VOCAB = 200, 12, 2000
HEAD_MISS = VOCAB + 1  # the head's token where its draft goes wrong: in no text


def phrase_book(rng: random.Random) -> list[list[int]]:
    """`PHRASES` phrases of `PHRASE_TOKENS` token ids each."""
    return [[rng.randrange(VOCAB) for _ in range(PHRASE_TOKENS)] for _ in range(PHRASES)]


def text(rng: random.Random, phrases: Sequence[Sequence[int]], n: int) -> list[int]:
    """`n` token ids: 12-token chunks, each a phrase of `phrases` (p = 0.5) or random ids."""
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(phrases) if rng.random() < 0.5 else [rng.randrange(VOCAB) for _ in range(PHRASE_TOKENS)]
    return out[:n]


def verify(proposer: CoSineProposer, drafts: Mapping[str, Sequence[int]], truth: Mapping[str, Sequence[int]],
           emitted: MutableMapping[str, int]) -> list[RequestOutcome]:
    """The target's step on `drafts` (request id -> draft token ids): each request accepts its
    draft's prefix that matches `truth` and gains one bonus token (`emitted`, tokens so far per
    request, moves on); the outcomes, with the source `proposer` named for each draft."""
    outcomes = []
    for rid, d in drafts.items():
        pos = emitted[rid]
        accepted = next((i for i, t in enumerate(d) if t != truth[rid][pos + i]), len(d))
        emitted[rid] = pos + accepted + 1
        outcomes.append(RequestOutcome(rid, len(d), accepted, proposer.source_of(rid)))
    return outcomes


def head_drafts(rng: random.Random, truth: Mapping[str, Sequence[int]], emitted: Mapping[str, int],
                k: int, alpha: float) -> dict[str, list[int]]:
    """The engine's head's `k`-token draft per request: `truth`'s next tokens while a per-token
    draw at rate `alpha` holds, `HEAD_MISS` after the first miss."""
    out = {}
    for rid, pos in emitted.items():
        row, ok = [], True
        for j in range(k):
            ok = ok and rng.random() < alpha
            row.append(truth[rid][pos + j] if ok else HEAD_MISS)
        out[rid] = row
    return out
