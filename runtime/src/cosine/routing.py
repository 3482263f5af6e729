"""Routing requests to drafters by expertise (Gao et al. 2025, arXiv:2503.10325, "routes inference
requests to specialized drafters based on their expertise").

Pure policy: a snapshot of per-drafter, per-domain acceptance statistics and a
request's features in, the drafters to use out; no torch, grpc or clock.

Each drafter's score on a domain combines
- its measured agreement with the target on that domain: a discounted Beta posterior of the
  per-token acceptance rate (discounting old outcomes lets the router notice a drafter whose quality
  changed, as discounted Thompson sampling does, Raj & Kalyani 2017);
- its own confidence (the mean top probability of its recent drafts), as the paper combines both;
- a prior from the pool's declared `expertise`, worth `prior_weight` pseudo-outcomes, so expertise is
  a starting belief, not a rule.
The router explores with Thompson sampling (the random draw is passed in, keeping the policy pure):
drafters with few or stale observations get tried, and exploitation takes over as evidence grows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

DOMAINS = ("code", "math", "chat", "edit")


@dataclass(frozen=True)
class RoutingSettings:
    """prior_weight: pseudo-outcomes given to a declared expertise. discount: weight kept by old
    outcomes per new observation (1 = never forget). prior_acceptance_expert / prior_acceptance_other:
    the prior's per-token acceptance on a declared / other domain. confidence_weight: how much the drafter's own
    confidence adds to the sampled acceptance. max_drafters: drafters returned per request.
    optimism_sd: posterior standard deviations above the mean in `optimistic_acceptance`."""

    prior_weight: float = 4.0
    prior_acceptance_expert: float = 0.7
    prior_acceptance_other: float = 0.4
    discount: float = 0.98
    confidence_weight: float = 0.1
    max_drafters: int = 1
    optimism_sd: float = 2.0


@dataclass(frozen=True)
class ArmStats:
    """Discounted counts for one (drafter, domain): accepted and rejected draft tokens, and the sum
    of draft confidences over `drafts` drafts."""

    accepted: float = 0.0
    rejected: float = 0.0
    confidence_sum: float = 0.0
    drafts: float = 0.0


_NO_ARM = ArmStats()  # an arm never observed


@dataclass(frozen=True)
class DrafterProfile:
    """A drafter's name and the domains (`DOMAINS`) it declares expertise in."""

    name: str
    expertise: tuple[str, ...] = ()


@dataclass(frozen=True)
class RouterState:
    """Statistics per drafter name and domain."""

    arms: Mapping[tuple[str, str], ArmStats] = field(default_factory=dict)


def classify_prompt(text: str) -> str:
    """A cheap domain label from prompt text (prompt features for routing): `edit` for requests to
    rewrite given code, `code` for code, `math` for arithmetic word problems, else `chat`."""
    lower = text.lower()
    has_code = "```" in text or bool(re.search(r"^\s*(def|class|import|from|#include|function)\b", text, re.M))
    if has_code and re.search(r"\b(rewrite|rename|refactor|edit|change|modify)\b", lower):
        return "edit"
    if has_code or re.search(r"\b(python|function|implement|code|program|algorithm)\b", lower):
        return "code"
    if re.search(r"\d", text) and re.search(r"\b(how many|how much|total|each|per|cost|calculate|sum)\b", lower):
        return "math"
    return "chat"


def _posterior(arm: ArmStats, profile: DrafterProfile, domain: str, s: RoutingSettings) -> tuple[float, float]:
    prior = s.prior_acceptance_expert if domain in profile.expertise else s.prior_acceptance_other
    return 1.0 + arm.accepted + s.prior_weight * prior, 1.0 + arm.rejected + s.prior_weight * (1 - prior)


def expected_acceptance(state: RouterState, profile: DrafterProfile, domain: str, s: RoutingSettings) -> float:
    """Posterior mean of the drafter's per-token acceptance rate on `domain`."""
    a, b = _posterior(state.arms.get((profile.name, domain), ArmStats()), profile, domain, s)
    return a / (a + b)


def optimistic_acceptance(state: RouterState, profile: DrafterProfile, domain: str, s: RoutingSettings) -> float:
    """An upper confidence bound on the drafter's per-token acceptance on `domain`: the posterior
    mean plus `s.optimism_sd` posterior standard deviations, at most 1 (optimism in the face of
    uncertainty, as in UCB: Auer et al. 2002). With little evidence it is well above the mean, so a
    costly first try of a drafter (its prefill of a long prompt) is still made and yields evidence;
    as outcomes accumulate it tightens to the mean.
    """
    a, b = _posterior(state.arms.get((profile.name, domain), ArmStats()), profile, domain, s)
    n = a + b
    sd = math.sqrt(a * b / (n * n * (n + 1)))
    return min(1.0, a / n + s.optimism_sd * sd)


def route(
    domain: str,
    drafters: Sequence[DrafterProfile],
    state: RouterState,
    settings: RoutingSettings,
    beta_sample: Callable[[float, float], float],
    available: Callable[[str], bool] = lambda name: True,
) -> list[str]:
    """The drafters to use for a request of `domain`, best first (at most `settings.max_drafters`).

    Args:
        beta_sample: draws from Beta(a, b) (e.g. `random.Random(seed).betavariate`); passing the
            draw in keeps the policy deterministic under test.
        available: drafters currently up (failed ones are skipped).
    """
    scored = []
    for d in drafters:
        if not available(d.name):
            continue
        arm = state.arms.get((d.name, domain), ArmStats())
        a, b = _posterior(arm, d, domain, settings)
        confidence = arm.confidence_sum / arm.drafts if arm.drafts else 0.5
        scored.append((beta_sample(a, b) + settings.confidence_weight * confidence, d.name))
    scored.sort(reverse=True)
    return [name for _, name in scored[: settings.max_drafters]]


class Outcome(NamedTuple):
    """One verification outcome for `observe_all`: `observe`'s arguments, the settings aside."""

    drafter: str
    domain: str
    num_draft_tokens: int
    num_accepted: int
    mean_confidence: float


def observe_all(state: RouterState, outcomes: Sequence[Outcome], settings: RoutingSettings) -> RouterState:
    """`observe` each outcome in turn (one engine step's): the same counts, to the float, with one
    new state and one `ArmStats` per arm the outcomes touch."""
    g = settings.discount
    counts: dict[tuple[str, str], list[float]] = {}  # arm -> [accepted, rejected, confidence_sum, drafts]
    for drafter, domain, num_draft_tokens, num_accepted, mean_confidence in outcomes:
        if num_draft_tokens <= 0:
            continue
        c = counts.get((drafter, domain))
        if c is None:
            arm = state.arms.get((drafter, domain), _NO_ARM)
            c = counts[(drafter, domain)] = [arm.accepted, arm.rejected, arm.confidence_sum, arm.drafts]
        c[0] = g * c[0] + num_accepted
        c[1] = g * c[1] + (1.0 if num_accepted < num_draft_tokens else 0.0)  # it stops at the first rejection
        c[2] = g * c[2] + mean_confidence
        c[3] = g * c[3] + 1
    return RouterState({**state.arms, **{key: ArmStats(*c) for key, c in counts.items()}})


def _observed(arm: ArmStats, num_draft_tokens: int, num_accepted: int, mean_confidence: float,
              discount: float) -> ArmStats:
    """The arm after one outcome, the past discounted by `discount` (as `observe_all` folds them)."""
    g = discount
    rejected = 1.0 if num_accepted < num_draft_tokens else 0.0  # acceptance stops at the first rejection
    return ArmStats(accepted=g * arm.accepted + num_accepted, rejected=g * arm.rejected + rejected,
                    confidence_sum=g * arm.confidence_sum + mean_confidence, drafts=g * arm.drafts + 1)


def observe(
    state: RouterState,
    drafter: str,
    domain: str,
    num_draft_tokens: int,
    num_accepted: int,
    mean_confidence: float,
    settings: RoutingSettings,
) -> RouterState:
    """Fold one verification outcome into the (drafter, domain) arm, discounting the past."""
    if num_draft_tokens <= 0:
        return state
    key = (drafter, domain)
    new = _observed(state.arms.get(key, _NO_ARM), num_draft_tokens, num_accepted, mean_confidence, settings.discount)
    return RouterState({**state.arms, key: new})
