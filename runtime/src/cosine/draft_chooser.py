"""Which draft tokens a request sends to the verifier this step, from the candidates at hand.

`DraftChooser` holds what the choice learns across requests and steps:
- the **pass curve**: seconds of one engine pass by the tokens in it, refined by every decode step
  the engine ran (`speculation_control.PassCurve`; SmartSpec, arXiv:2406.14066);
- the **depth cost** of the engine's own drafter: seconds one more forward of it adds to a step,
  fitted to the steps' times against the depth it drafted (`speculation_control.fit_depth_s`;
  its prior the forward's weights over the target's, of the pass without that first forward).
  The curve learns each step less those fitted forwards, and the depth is chosen on its forwards
  and the pass verifying them together (`engine_depth`): where a step's tokens and its depth only
  ever rose together (one request), the steps fix their sum and not the split, and that decision
  needs only the sum (docs/benchmarks.md, "Priced on a GPU's roofline");
- **calibration**: per source and domain (and per request, with the domain's as its prior), what
  the target accepted of a source's drafts over what their path probabilities predicted
  (EAGLE-2, arXiv:2406.16858, §4, uses the draft model's confidence as the acceptance estimate;
  here it is scaled by how well it has predicted).

It chooses in two steps: `fuse` merges several candidates by confidence per position into one chain
(Gao et al. 2025, arXiv:2503.10325, "confidence-based token fusion"; a chain, since vLLM 0.32
verifies no trees) with each token's path probability, or takes one candidate alone where it is
worth more, each weighed by its goodput at its own best length on this step's pass; `draft_len`
picks k for the chosen chain from goodput on the measured pass curve
(`speculation_control.next_draft_len`), down to 0 with probes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace

from cosine_spec.cluster_spec import SpeculationSpec

from cosine import speculation_control as sc
from cosine.fusion import DraftPath, fused_chain, token_score

Counts = dict[str, tuple[float, float]]  # source -> decayed (accepted, predicted) tokens


class DraftChooser:
    """The fused chain and its k for one request's step (see the module docstring).

    Args:
        speculation: `spec.speculation` (k's bound `max_draft_len`, `draftLength`'s rule).
        control: the k controller's tuning. initial_step_s: the pass time assumed before any
            step was measured (seconds). calibration_decay / calibration_prior_tokens: per-step
            decay of the (accepted, predicted) counts and the pseudo-tokens at ratio 1.
        depth_ratio: the engine drafter's forward over the target's one-token-per-request pass,
            assumed until the steps measure it (e.g. their weights' bytes: decoding reads every
            weight once a forward); 0 without an engine drafter.
    """

    DEPTH_WINDOW = 256  # decode steps the depth cost is fitted to
    DEPTH_REFIT = 8  # steps between fits

    def __init__(self, speculation: SpeculationSpec, control: sc.SpeculationSettings, initial_step_s: float,
                 calibration_decay: float, calibration_prior_tokens: float, depth_ratio: float = 0.0) -> None:
        self.speculation, self.control = speculation, control
        # a draft already paid for (the engine's own drafter ran whatever wins): no path floor
        self._paid_control = replace(control, min_path_prob=0.0)
        self.initial_step_s = initial_step_s
        self.curve: sc.PassCurve | None = None
        self._curve_observations = 0
        self._decay, self._prior = calibration_decay, calibration_prior_tokens
        self._calibration: dict[tuple[str, str], tuple[float, float]] = {}  # (source, domain) -> decayed counts
        self.depth_ratio = max(0.0, depth_ratio)
        self._depth_samples: deque[tuple[int, int, float]] = deque(maxlen=self.DEPTH_WINDOW)
        self._depth_batch = 1.0  # decoding requests per step (EMA): the prior's pass
        self._depth_s: float | None = None  # fitted; None: not yet
        self._depth_seen = 0

    # ------------------------------------------------------------ the pass curve

    def observe_pass(self, num_tokens: int, step_s: float, depth: int = 0, num_requests: int = 0) -> None:
        """A decode step of `num_tokens` tokens took `step_s` seconds, the engine's own drafter
        drafting `depth` forwards deep in it (0: no engine drafter) for `num_requests` requests."""
        if num_tokens < 1 or step_s <= 0:
            return
        if depth > 0:
            if num_requests > 0:
                self._depth_batch += 0.1 * (num_requests - self._depth_batch)
            self._depth_samples.append((num_tokens, depth, step_s))
            self._depth_seen += 1
            if self._depth_s is None or self._depth_seen % self.DEPTH_REFIT == 0:
                self._depth_s = sc.fit_depth_s(self._depth_samples, self._depth_prior_s(step_s, depth))
            # the curve prices verified tokens: the drafter's forwards past the first are priced by
            # `depth_s` (`engine_depth`), so they come out of what the curve learns (a step is at
            # least `depth` times a forward, its pass with the first forward at least one of them)
            step_s = max(step_s / depth, step_s - self._depth_s * (depth - 1))
        if self.curve is None:  # flat until measured: drafts look cheap and get tried, then priced
            budget = max(2, 8 * (self.speculation.max_draft_len + 1))
            self.curve = sc.PassCurve(((1, step_s),)).extended(budget)
        self._curve_observations += 1
        # learn fast at first (the flat start is a guess), then follow the machine's drift
        weight = 0.5 if self._curve_observations <= 20 else 0.2
        self.curve = self.curve.observe(num_tokens, step_s, weight=weight)

    def _depth_prior_s(self, step_s: float | None = None, depth: int = 1) -> float:
        """`depth_ratio` times the target's pass at the batch's one token a request: the curve's
        less the drafter's first forward in it (every measured step has one); before the curve
        is measured, the pass of `step_s`, a step `depth` forwards deep, else the initial guess."""
        r = self.depth_ratio
        if self.curve is not None:
            return r * self.curve.seconds(max(1, round(self._depth_batch))) / (1.0 + r)
        return r * (step_s / (1.0 + r * depth) if step_s is not None else self.initial_step_s)

    def depth_s(self) -> float:
        """Seconds one more forward of the engine's own drafter adds to a step (fitted; before any
        step with it, `depth_ratio` times the pass)."""
        return self._depth_s if self._depth_s is not None else self._depth_prior_s()

    def step_s(self) -> float:
        """Seconds of a one-token pass (measured, else the initial guess)."""
        return self.curve.seconds(1) if self.curve else self.initial_step_s

    # ------------------------------------------------------------ calibration

    def calibration(self, source: str, domain: str, request: Counts | None = None) -> float:
        """The factor a source's path probabilities are scaled by: for `domain`, from every step of
        every such request (decayed); with a request's own counts, those, the domain's as their prior."""
        domain_c = sc.calibration(*self._calibration.get((source, domain), (0.0, 0.0)), self._prior)
        if request is None or source not in request:
            return domain_c
        return sc.calibration(*request[source], self._prior, domain_c)

    def calibrate(self, source: str, domain: str, request: Counts, accepted: int, predicted: float) -> None:
        """The target accepted `accepted` tokens of a draft whose path probabilities summed to `predicted`."""
        acc, pred = self._calibration.get((source, domain), (0.0, 0.0))
        self._calibration[(source, domain)] = (acc * self._decay + accepted, pred * self._decay + predicted)
        acc, pred = request.get(source, (0.0, 0.0))
        request[source] = (acc * self._decay + accepted, pred * self._decay + predicted)

    def calibrated(self, source: str, domain: str, request: Counts, path: Sequence[float]) -> tuple[float, ...]:
        """`path` scaled by the source's calibration, at most 1."""
        c = self.calibration(source, domain, request)
        return tuple([min(1.0, c * p) for p in path])

    # ------------------------------------------------------------ the choice

    def fuse(self, paths: Sequence[DraftPath], weights: Mapping[str, float], cost: sc.Cost | None = None
             ) -> tuple[tuple[int, ...], str, tuple[float, ...]]:
        """The chain of `paths` (candidates, each token's probability given the ones before it),
        at most `max_draft_len` long, the source of its first token and each token's path
        probability: one candidate as it is; several fused by confidence, `weights` (each
        source's acceptance rate for the request) breaking ties (`fusion.fused_chain`), unless one
        candidate alone is worth more than the fused chain: then that candidate.

        A draft's worth is its goodput at its best length under `cost` (what its tokens add to
        this step's pass, `BatchedCost`; `speculation_control.chain_goodput` of the tokens'
        `fusion.token_score`s): where every verified token costs compute (a large batch), a longer
        draft expected to be accepted for a little more does not win over a shorter one that pays
        more a token (SmartSpec, arXiv:2406.14066, §4, goodput as the criterion). On a flat pass,
        and without `cost`, this is the most expected accepted tokens (`expected_tokens`)."""
        k_max = self.speculation.max_draft_len
        if not paths:
            return (), "", ()
        if len(paths) == 1:
            return paths[0].token_ids[:k_max], paths[0].drafter, path_of(paths[0].confidences[:k_max])
        chain, winners = fused_chain(paths, k_max, weights)

        prices = None if cost is None else sc.draft_prices(cost, k_max)

        def worth(scores: Sequence[float]) -> float:
            return expected_tokens(scores) if prices is None else sc.chain_goodput(scores, prices)

        # the fused chain follows the likeliest next token at each position; where candidates part,
        # a short confident one can cut a longer one off that is worth more: verify whichever of
        # the fused chain and each candidate alone is worth the most (ties to the fused chain)
        best, best_value = None, worth(
            [token_score(w.confidences[i], weights.get(w.drafter, 1.0)) for i, w in enumerate(winners)])
        for p in paths:
            value = worth([token_score(c, weights.get(p.drafter, 1.0)) for c in p.confidences[:k_max]])
            if value > best_value:
                best, best_value = p, value
        if best is not None:
            return best.token_ids[:k_max], best.drafter, path_of(best.confidences[:k_max])
        confs = [w.confidences[i] for i, w in enumerate(winners)]
        return chain, winners[0].drafter if winners else "", path_of(confs)

    def engine_depth(self, values: Sequence[Sequence[float]], base_tokens: float, other_tokens: int,
                     max_depth: int) -> int:
        """The engine drafter's depth for the next step (`speculation_control.best_depth`): the
        requests' `values` (path probabilities of the drafter's tokens each would take) against the
        fitted `depth_s` and the pass curve, on a step of `other_tokens` tokens besides those
        draft tokens, emitting `base_tokens` without them."""
        curve = self.curve or sc.PassCurve(((1, self.initial_step_s),))
        return sc.best_depth(values, base_tokens, curve.seconds, other_tokens, self.depth_s(), max_depth)

    def cost(self, other_tokens: int, num_requests: int) -> sc.BatchedCost:
        """A request's verified tokens' price in this step's pass (`speculation_control.BatchedCost`
        on the measured curve, no drafter seconds): its `num_requests` requests' other tokens are
        `other_tokens`."""
        curve = self.curve or sc.PassCurve(((1, self.initial_step_s),))
        return sc.BatchedCost(draft_token_s=0.0, curve=curve, other_tokens=max(0, other_tokens),
                              num_requests=max(1, num_requests))

    def draft_len(self, state: sc.SpeculationState, path: Sequence[float], cost: sc.Cost,
                  paid: bool = False) -> tuple[sc.SpeculationState, int]:
        """(the request's new state for the source, k) for a draft of calibrated path
        probabilities `path`: each token against what it adds to this batch's pass (`cost`, from
        `cost()`; `speculation_control.next_draft_len`, probes included).
        `paid`: the draft was made whatever is verified (the engine's own drafter drafts every
        step, as vLLM's eagle3 verifies every token it drafted), so only the pass prices its tokens
        and the control's `min_path_prob` floor does not cut it; how deep it drafts is decided
        for the batch (`engine_depth`)."""
        by_path = self.speculation.draft_length == "pathProbability"
        control = self._paid_control if paid else self.control
        state, k = sc.next_draft_len(state, self.speculation, control, cost, path if by_path else None)
        return state, min(k, len(path))


def expected_tokens(scores: Sequence[float]) -> float:
    """Expected accepted tokens of a chain whose tokens are accepted each with probability
    `scores[i]` given the ones before: the sum of its path probabilities (Leviathan et al. 2023,
    arXiv:2211.17192, §3.5, with per-token rates)."""
    total, path = 0.0, 1.0
    for q in scores:
        path *= q
        total += path
    return total


def conditional(path: Sequence[float]) -> tuple[float, ...]:
    """Per-token probabilities from path probabilities (each over the one before; 0 after a 0)."""
    out, prev = [], 1.0
    for p in path:
        out.append(min(1.0, p / prev) if prev > 0 else 0.0)
        prev = p
    return tuple(out)


def path_of(conditional: Sequence[float]) -> tuple[float, ...]:
    """Path probabilities from per-token ones: their running product."""
    out, acc = [], 1.0
    for q in conditional:
        acc *= q
        out.append(acc)
    return tuple(out)
