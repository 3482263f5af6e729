"""The simulated target model's side of a request: what it will emit (greedy, drawn as needed),
how a drafter's guess at it is drawn at the request's acceptance rate, and how much of a draft it
accepts. What the proposer cannot know and the simulator must model (`cluster`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import simpy

from cosine.simulation.setup import RequestSpec

TRUTH_IDS = 1 << 30  # the target's tokens are drawn from [0, TRUTH_IDS); a missed guess is -1, never the target's


@dataclass
class SimRequest:
    """One request as vLLM's scheduler holds it, and what the simulated target will emit: `truth`,
    its greedy output (drawn as needed), and per draft source the request's per-token acceptance
    rate (drawn once from the `AcceptanceModel`). `tokens` is what the proposer sees: the prompt
    (its first id names the request, for the proposer's `classify`) and the output so far."""

    rid: str
    spec: RequestSpec
    arrival_s: float
    prefill_left: int
    tokens: list[int]
    rng: random.Random
    truth: list[int] = field(default_factory=list)
    alphas: dict[str, float] = field(default_factory=dict)
    emitted: int = 0
    draft: list[int] = field(default_factory=list)  # the draft scheduled with its next step
    source: str = ""  # the draft's source
    replica: int = 0  # the verifier replica running it
    first_token_s: float | None = None
    done: simpy.Event | None = None

    def target_token(self, position: int) -> int:
        """The target's output token at output `position` (0 = the first generated)."""
        while len(self.truth) <= position:
            self.truth.append(self.rng.randrange(TRUTH_IDS))
        return self.truth[position]

    def guess(self, start: int, n: int, alpha: float, aligned: bool = True) -> list[int]:
        """A drafter's `n` tokens for output positions `start`, ...: each the target's with
        probability `alpha` while every one before it was (an `aligned` start: the drafter's context
        is the target's), after the first miss nothing more is (i.i.d. acceptance, Leviathan et al.
        2023, arXiv:2211.17192, §3.1)."""
        out = []
        for j in range(start, start + n):
            aligned = aligned and self.rng.random() < alpha
            out.append(self.target_token(j) if aligned else -1)
        return out

    def verify(self, draft: Sequence[int]) -> int:
        """Draft tokens the target accepts: the longest prefix that is its own output (greedy)."""
        n = 0
        while n < len(draft) and draft[n] == self.target_token(self.emitted + n):
            n += 1
        return n
