"""Adaptive speculation length: choose k (0 = no speculation) to maximise goodput.

Pure policy: numbers in, a decision out; no torch, no clock. The caller measures costs
and acceptance and passes them in.

Model (Leviathan et al. 2023, arXiv:2211.17192, §3.1; SmartSpec, arXiv:2406.14066, goodput): with
per-token acceptance probability alpha, a draft of k tokens yields on average
    E[tokens | alpha, k] = (1 - alpha**(k + 1)) / (1 - alpha)
tokens per verification (accepted + the recovered/bonus token), at a cost of
    k * draft_token_s + verify_s(k + 1),   verify_s(n): the target's time to verify n tokens.
Goodput is their ratio; k = 0 (plain decoding) is one token per `verify_s(1)`. So speculation is
switched off where it does not pay, and probed again every `probe_interval_steps` steps so a
request whose text turns predictable (code, repetition) gets it back.

Under batching (`BatchedCost`), verify_s is what the request's tokens add to the shared pass, on a
measured `PassCurve`, plus its share of the pass it would take anyway. Where a pass is compute-bound
(a CPU, or a GPU at large batch), each draft token then costs nearly a full token's time and k
falls to what acceptance pays for; where it is memory-bound, extra tokens stay almost free. This
is the batch-size effect SmartSpec (arXiv:2406.14066) and vLLM issue 17984 report: a fixed k that
pays alone is slower than plain decoding at batch 32.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol

from cosine_spec.cluster_spec import MAX_DRAFT_LEN, SpeculationSpec


@dataclass(frozen=True)
class SpeculationSettings:
    """The k controller's own tuning (what the CRD's `spec.speculation`, a `SpeculationSpec`, does
    not set): acceptance_prior: alpha assumed before any outcome is seen. ema_weight: weight of the
    newest outcome in the acceptance estimate. probe_interval_steps: after this many k = 0 steps,
    draft `probe_draft_tokens` tokens to re-measure acceptance. min_path_prob: a draft judged on
    its path probabilities (`best_path_len`) stops before the first token below this, however
    cheap the pass looks (vLLM's `suffix_decoding_min_token_prob`, 0.1, on calibrated values):
    a pass curve measured only at one size prices extra tokens at nothing.
    Invalid values raise ValueError.
    """

    acceptance_prior: float = 0.7
    ema_weight: float = 0.3
    probe_interval_steps: int = 8
    probe_draft_tokens: int = 2
    min_path_prob: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 < self.ema_weight <= 1.0:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight}")



class Cost(Protocol):
    """What the k policy needs of a cost model: seconds per draft token and per verification of
    `num_tokens` tokens (the pending token + the draft), e.g. `BatchedCost`."""

    @property
    def draft_token_s(self) -> float:
        """Drafter seconds per draft token."""
        ...

    def verify_s(self, num_tokens: int) -> float:
        """Seconds the target takes to verify `num_tokens` tokens."""
        ...


_BLOCK_TOKENS = 32  # token counts a `PassCurve` values together when one of them is first asked for


@dataclass(frozen=True)
class PassCurve:
    """Target pass time vs the tokens in the pass (all requests together), in seconds.

    points: (tokens, seconds) with tokens strictly increasing from 1; piecewise linear between
    them, extrapolated past the last point with the last segment's slope (flat with one point).
    Seeded by the first engine step measured and refined by `observe` from
    every pass the engine runs, so it follows the machine's real shape: on a CPU a second token is
    almost free and from a few tokens on the pass is compute-bound (linear); on a GPU it stays flat
    up to hundreds of tokens. Raises ValueError for points that are not as described.
    """

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        xs = [x for x, _ in self.points]
        if not xs or xs[0] != 1 or any(b <= a for a, b in pairwise(xs)):
            raise ValueError(f"pass curve tokens must start at 1 and increase strictly, got {xs}")
        if any(y <= 0 for _, y in self.points):
            raise ValueError(f"pass curve seconds must be positive, got {self.points}")
        # seconds by token count, filled as asked: the proposer prices every request's draft on
        # one curve per step (tens of thousands of calls a second at 64 requests)
        object.__setattr__(self, "_memo", {})
        object.__setattr__(self, "_xs", xs)  # the points' token counts, for finding a segment by bisection

    def seconds(self, num_tokens: float) -> float:
        """Pass time for `num_tokens` tokens (at least one)."""
        memo: dict[float, float] = self._memo  # type: ignore[attr-defined]
        got = memo.get(num_tokens)
        if got is None:
            if type(num_tokens) is int and num_tokens > 1 and len(self.points) > 1:
                self._value_block(num_tokens)  # the proposer asks for every count of a range each step
                got = memo[num_tokens]
            else:
                got = memo[num_tokens] = self._interpolate(num_tokens)
        return got

    def _value_block(self, n: int) -> None:
        """Memoise the pass time of `n` and of the integer token counts around it, up to
        `_BLOCK_TOKENS` of them within its segment (or past the last point), in one pass: each by
        `_interpolate`'s formula on the same segment, so to the same float, at a fraction of the
        cost of valuing each alone. n > 1, with two points or more."""
        pts = self.points
        i = bisect_left(self._xs, n)  # type: ignore[attr-defined]  # the first point at or past n (i >= 1)
        if i < len(pts):
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
            lo = x0 + 1 + (n - x0 - 1) // _BLOCK_TOKENS * _BLOCK_TOKENS
            hi = min(lo + _BLOCK_TOKENS - 1, x1)
            values = [y0 + (y1 - y0) * (m - x0) / (x1 - x0) for m in map(float, range(lo, hi + 1))]
        else:
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
            lo = x1 + 1 + (n - x1 - 1) // _BLOCK_TOKENS * _BLOCK_TOKENS
            hi = lo + _BLOCK_TOKENS - 1
            values = [y1 + (y1 - y0) * (m - x1) / (x1 - x0) for m in map(float, range(lo, hi + 1))]
        self._memo.update(zip(range(lo, hi + 1), values, strict=True))  # type: ignore[attr-defined]

    def _interpolate(self, num_tokens: float) -> float:
        pts, n = self.points, max(1.0, float(num_tokens))
        if len(pts) == 1:
            return pts[0][1]
        i = bisect_left(self._xs, n)  # type: ignore[attr-defined]  # the first point at or past n
        if i < len(pts):  # between points i - 1 and i (n = 1: the first segment)
            (x0, y0), (x1, y1) = pts[max(i, 1) - 1], pts[max(i, 1)]
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + (y1 - y0) * (n - x1) / (x1 - x0)

    def extended(self, max_tokens: int) -> PassCurve:
        """The curve with points added at doubling token counts up to at least `max_tokens`
        (e.g. the pass token budget), valued by extrapolation, so `observe` can correct them:
        a short start-up measurement says little about the large passes a busy batch makes."""
        pts = list(self.points)
        while pts[-1][0] < max_tokens:
            n = pts[-1][0] * 2
            pts.append((n, self.seconds(n)))
        return PassCurve(tuple(pts))

    def observe(self, num_tokens: int, seconds: float, weight: float = 0.1) -> PassCurve:
        """Fold one measured pass into the curve: the two points around `num_tokens` move toward
        the measurement, each by `weight` times its interpolation share (past the last point, the
        last point moves); seconds stay non-decreasing in tokens, by lowering the smaller passes'
        points to a measured one's and raising the larger ones' (a batch that never runs 1 or 2
        tokens must not keep them at a first guess that flattens the curve where it runs).
        Passes of no positive time or no tokens are ignored."""
        pts = list(self.points)
        if seconds <= 0 or num_tokens < 1:
            return self
        error = seconds - self.seconds(num_tokens)
        if len(pts) == 1 or num_tokens > pts[-1][0]:
            pts[-1] = (pts[-1][0], max(1e-6, pts[-1][1] + weight * error))
        for i, ((x0, _), (x1, _)) in enumerate(pairwise(pts)):
            if num_tokens <= x1:
                t = (num_tokens - x0) / (x1 - x0)
                pts[i] = (x0, max(1e-6, pts[i][1] + weight * (1 - t) * error))
                pts[i + 1] = (x1, max(1e-6, pts[i + 1][1] + weight * t * error))
                break
        if error > 0:  # a measured rise carries up to larger passes
            for i in range(1, len(pts)):
                pts[i] = (pts[i][0], max(pts[i][1], pts[i - 1][1]))
        else:  # a measured drop down to smaller ones, which a busy batch may never run
            for i in range(len(pts) - 1, 0, -1):
                pts[i - 1] = (pts[i - 1][0], min(pts[i - 1][1], pts[i][1]))
        return PassCurve(tuple(pts))


@dataclass(frozen=True)
class BatchedCost:
    """One request's cost when its verification shares a pass with other requests' (SmartSpec,
    arXiv:2406.14066, §3-4: under batching a draft token costs what it adds to the shared pass).

    The request pays its share of the pass the batch would take without speculation,
    curve(num_requests) / num_requests, plus what its own tokens add on top of the others':
        verify_s(n) = curve(num_requests) / num_requests + curve(other_tokens + n) - curve(other_tokens + 1).
    Alone (other_tokens = 0, num_requests = 1) this is curve(n). The base share does not grow with
    the others' drafts, so one request's speculation does not make another's look cheaper.
    draft_token_s: drafter seconds per token (0 for prompt lookup). other_tokens: tokens the other
    requests put in the same pass. num_requests: requests in the pass, this one included.
    Raises ValueError for a negative cost or other_tokens, or num_requests < 1.
    """

    draft_token_s: float
    curve: PassCurve
    other_tokens: int = 0
    num_requests: int = 1

    def __post_init__(self) -> None:
        if self.draft_token_s < 0 or self.other_tokens < 0 or self.num_requests < 1:
            raise ValueError(f"invalid batched cost {self!r}")
        # the formula's two terms that do not depend on n (verify_s is asked for every k)
        object.__setattr__(self, "_share", self.curve.seconds(self.num_requests) / self.num_requests)
        object.__setattr__(self, "_others", self.curve.seconds(self.other_tokens + 1))

    def verify_s(self, num_tokens: int) -> float:
        """The request's seconds for verifying `num_tokens` tokens in the shared pass (formula above)."""
        added = self.curve.seconds(self.other_tokens + num_tokens) - self._others  # type: ignore[attr-defined]
        return float(self._share + added)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class SpeculationState:
    """Per-request acceptance estimate: EMAs of accepted draft tokens and of acceptance trials."""

    accepted_ema: float
    trials_ema: float
    steps_since_probe: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Estimated per-token acceptance probability alpha, in [0, 1] (0 before any trial)."""
        return self.accepted_ema / self.trials_ema if self.trials_ema > 0 else 0.0


def initial_state(settings: SpeculationSettings, acceptance_rate: float | None = None) -> SpeculationState:
    """Fresh estimate: `acceptance_rate` measured for this drafter on earlier requests (its agreement
    with the target), else the settings' prior. Weighted as one trial, so the request's own
    outcomes take over quickly."""
    alpha = settings.acceptance_prior if acceptance_rate is None else min(max(acceptance_rate, 0.0), 1.0)
    return SpeculationState(accepted_ema=alpha, trials_ema=1.0)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted by one verification of k draft tokens (accepted + 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def pool_pays(pool_alpha: float, pool_on_time: float, local: Sequence[tuple[float, float]], k: int,
              min_gain_tokens: float = 0.0) -> bool:
    """Whether a drafter pool is worth asking for a request's next draft: its expected accepted
    tokens per verifier step beat what the best local source gives the same request (the engine's
    own drafter, prompt lookup: `local`, one (per-token acceptance, hit rate) per source), and
    `min_gain_tokens`.

    A pool's draft counts only when it arrives in time and still continues the context
    (`pool_on_time`, a fraction in [0, 1]); a local source's only on the steps it has a draft
    (its hit rate: 1 for an engine drafter, the share of steps lookup finds a match). Expected
    accepted tokens of a k-token chain at per-token acceptance alpha: sum_{i=1..k} alpha^i
    (Leviathan et al. 2023, arXiv:2211.17192, section 3.1).
    """
    if k <= 0:
        return False
    pool = pool_on_time * (expected_tokens(pool_alpha, k) - 1.0)
    return pool > max(pool - pool_gain_tokens(pool_alpha, pool_on_time, local, k), min_gain_tokens)


def pool_gain_tokens(pool_alpha: float, pool_on_time: float, local: Sequence[tuple[float, float]], k: int) -> float:
    """Expected accepted tokens per verifier step a pool's draft adds over the best local source's
    for the same request (`pool_pays`' two sides, the pool's less the best local's; negative where
    a local source gives more). 0 for k <= 0."""
    if k <= 0:
        return 0.0
    pool = pool_on_time * (expected_tokens(pool_alpha, k) - 1.0)
    return pool - max((hit * (expected_tokens(alpha, k) - 1.0) for alpha, hit in local), default=0.0)


def pool_ask(step_s: float, token_s: float | None, rtt_s: float, k_max: int, max_branches: int, *,
             lookahead: int = 2, max_tokens: int = MAX_DRAFT_LEN, budget: float = 0.8) -> tuple[int, int]:
    """The shape of a pool's next draft, (draft tokens per candidate, branches), sized to arrive in time.

    A pool is asked as a verifier step starts, and its draft serves the next step only if it is
    back before that step ends (the verifier never waits for it). Candidates are the main draft
    and `branches` drafts from rejection points of the draft being verified (PEARL-style
    post-verify drafting, Liu et al., arXiv:2408.11850); on a CPU a batched decode costs about as
    much per token as separate ones, so the candidates share one token budget:
    n = floor(budget * step_s / token_s) draft tokens. The most branches b <= `max_branches` whose
    candidates still get ceil(k_max / 2) tokens each are asked for, each candidate
    min(k_max + lookahead, n // (1 + b)) tokens (`lookahead`: tokens past k, as the target emits
    at least one token meanwhile). When not even `lookahead` tokens fit (a pool slower than the
    verifier), the draft has no branches and reaches past what the target emits during the
    pool's round trip instead: k_max + max(lookahead, ceil(rtt_s / step_s)) tokens, so it can
    serve a later step; the same before the pool's speed is measured (`token_s` None), with
    `max_branches`. At most `max_tokens` per candidate, always at least 1.

    Args:
        step_s: the verifier's seconds per decode step. token_s: the pool's measured seconds per
            draft token (a call's round trip over the tokens it drafted, all candidates), or None.
        rtt_s: the pool's measured round trip, seconds. k_max: the verifier's largest k.
        max_branches: branches allowed (0 when nothing is being verified).
    """
    step_s = max(step_s, 1e-6)
    slow = k_max + max(lookahead, math.ceil(rtt_s / step_s))
    if token_s is None:
        return max(1, min(slow, max_tokens)), max_branches
    n = int(budget * step_s / max(token_s, 1e-9))
    if n < max(1, lookahead):
        return max(1, min(slow, max_tokens)), 0
    per = max(1, -(-k_max // 2))
    b = max(0, min(max_branches, n // per - 1))
    return max(1, min(k_max + lookahead, n // (1 + b), max_tokens)), b


def goodput_per_s(alpha: float, k: int, cost: Cost) -> float:
    """Expected emitted tokens per second for draft length k."""
    return expected_tokens(alpha, k) / (k * cost.draft_token_s + cost.verify_s(k + 1))


def best_draft_len(alpha: float, cost: Cost, max_k: int) -> int:
    """argmax over k in [0, max_k] of goodput; ties go to the shorter draft."""
    best_k, best = 0, goodput_per_s(alpha, 0, cost)
    for k in range(1, max_k + 1):
        g = goodput_per_s(alpha, k, cost)
        if g > best * 1.0001:
            best_k, best = k, g
    return best_k


def best_path_len(path_probs: Sequence[float], cost: Cost, max_k: int, min_path_prob: float = 0.0) -> int:
    """argmax over k in [0, min(max_k, len(path_probs))] of the goodput of the draft's first k tokens,
        (1 + sum_{i<k} path_probs[i]) / (k * draft_token_s + verify_s(k + 1));
    ties go to the shorter draft, and no token below `min_path_prob` is kept.

    path_probs[i]: the probability that draft token i and every token before it are accepted (the
    path probability, non-increasing, in [0, 1]). Token i adds one emitted token exactly when the
    target accepts it and all before it, so a k-token draft emits 1 + sum_{i<k} path_probs[i]
    tokens on average (the bonus token included): each token is kept where what it adds beats
    what it costs in the pass. With path_probs[i] = alpha^(i+1) this is `best_draft_len`; a draft
    source's own per-position probabilities instead (the suffix tree's counts, a draft model's
    top-1 probabilities) score each draft on its own: the draft model's confidence as the
    acceptance estimate and the path product as a token's value is EAGLE-2's dynamic draft tree
    (Li et al. 2024, arXiv:2406.16858, §4), priced by goodput (SmartSpec, arXiv:2406.14066).
    """
    return _best_path(path_probs, cost, max_k, min_path_prob)[0]


def draft_prices(cost: Cost, max_k: int) -> list[float]:
    """Seconds the step takes a request for a draft of k tokens, k = 0..max_k (its drafting and
    `verify_s(k + 1)`): what `chain_goodput` divides by."""
    return [k * cost.draft_token_s + cost.verify_s(k + 1) for k in range(max_k + 1)]


def chain_goodput(scores: Sequence[float], prices: Sequence[float]) -> float:
    """The goodput (expected emitted tokens per second) of a draft whose tokens are accepted each
    with probability `scores[i]` given the ones before, at its best length (`best_path_len`'s
    rule, with the path probabilities their running product), priced by `prices`
    (`draft_prices`; at most len(prices) - 1 tokens): what verifying it is worth this step,
    comparable between drafts priced alike."""
    best = 1.0 / prices[0]
    value = path = 1.0
    for k in range(1, min(len(scores), len(prices) - 1) + 1):
        path *= scores[k - 1]
        value += path
        g = value / prices[k]
        if g > best:
            best = g
    return best


def _best_path(path_probs: Sequence[float], cost: Cost, max_k: int, min_path_prob: float) -> tuple[int, float]:
    """(`best_path_len`'s k, its goodput in tokens per second)."""
    verify_s, draft_token_s = cost.verify_s, cost.draft_token_s
    best_k, best = 0, 1.0 / verify_s(1)  # goodput_per_s(alpha, 0, cost): one token a pass
    value = 1.0
    for k in range(1, min(max_k, len(path_probs)) + 1):
        p = path_probs[k - 1]
        if p < min_path_prob:
            break
        value += min(1.0, max(0.0, p))
        g = value / (k * draft_token_s + verify_s(k + 1))
        if g > best * 1.0001:
            best_k, best = k, g
    return best_k, best


def fit_depth_s(samples: Sequence[tuple[int, int, float]], prior_s: float, prior_weight: float = 2.0) -> float:
    """Seconds one more forward of the engine's own drafter adds to a step, fitted to measured steps.

    A step's wall time is the target's pass plus the drafter's forwards after it,
        step_s ~ b0 + b1 * num_tokens + depth_s * (depth - 1)
    (the first forward runs at any depth, so it is part of every step), fitted by least squares
    over `samples` (num_tokens, depth, step_s) with `depth_s` pulled toward `prior_s` as by
    `prior_weight` samples at the window's mean depth: where the depth never varied the data
    cannot tell a deeper forward from a longer pass, and the prior stands. At least 0.
    """
    if not samples:
        return max(0.0, prior_s)
    rows = [((1.0, float(n), float(d - 1)), s) for n, d, s in samples]
    extra = sum(x[2] ** 2 for x, _ in rows) / len(rows)
    lam = prior_weight * max(extra, 1.0)
    # the normal equations of the least squares, the prior as one more row (0, 0, sqrt(lam)) = sqrt(lam) * prior_s,
    # and a vanishing ridge on the pass's terms (a window at one token count cannot tell them apart)
    ata = [[sum(x[i] * x[j] for x, _ in rows) for j in range(3)] for i in range(3)]
    aty = [sum(x[i] * y for x, y in rows) for i in range(3)]
    ata[2][2] += lam
    aty[2] += lam * prior_s
    for i in range(2):
        ata[i][i] += 1e-9 * (ata[i][i] + 1.0)
    return max(0.0, _solve3(ata, aty)[2])


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b, for a symmetric positive definite 3 x 3 `a` (Gaussian elimination)."""
    m = [row[:] + [v] for row, v in zip(a, b, strict=True)]
    for i in range(3):
        pivot = max(range(i, 3), key=lambda r: abs(m[r][i]))
        m[i], m[pivot] = m[pivot], m[i]
        for r in range(i + 1, 3):
            f = m[r][i] / m[i][i]
            for c in range(i, 4):
                m[r][c] -= f * m[i][c]
    x = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        x[i] = (m[i][3] - sum(m[i][c] * x[c] for c in range(i + 1, 3))) / m[i][i]
    return x


def best_depth(values: Sequence[Sequence[float]], base_tokens: float, pass_s: Callable[[int], float],
               other_tokens: int, depth_s: float, max_depth: int, margin: float = 0.03) -> int:
    """How many forwards deep the engine's own drafter should draft for the next step, for the
    whole batch: expected tokens a second at depth d,
        g(d) = (base_tokens + sum_r sum_{i < min(d, len(values[r]))} values[r][i])
               / (pass_s(other_tokens + sum_r min(d, len(values[r]))) + (d - 1) * depth_s),
    and the deepest d in [1, max_depth] within `margin` of the best g, no deeper than the longest
    of `values` (SmartSpec's goodput,
    arXiv:2406.14066, applied to the drafter's depth, which vLLM sets for the batch:
    `SchedulerOutput.num_spec_tokens_to_schedule`). Each depth is priced whole: its forwards and
    the pass verifying what they drafted. Where the batch's tokens and the depth rose together in
    every step measured (one request: k and the depth move as one), the steps cannot tell the
    pass's slope from a forward's price; what they fix is the sum along that line, and this is it.
    The margin leans to the drafter's depth
    because the values are estimates that undervalue deep tokens (a path probability is a product
    of per-token rates; the target accepts in runs): a cut must save more than they can be off.
    In the simulator at GPU scale, cutting at the best g alone cost `cosine-head` up to 3%.

    values[r]: request r's expected accepted tokens from each draft token it would take of the
    drafter's draft (its path probabilities); base_tokens: the tokens the batch emits without
    them (one a request, plus other sources' drafts); pass_s: seconds of the step without the
    drafter's deeper forwards by the tokens in its pass; other_tokens: the pass's tokens besides
    the drafter's draft tokens; depth_s: seconds each forward past the first adds. Raises
    ValueError for max_depth < 1 or a pass of no positive time.
    """
    if max_depth < 1:
        raise ValueError(f"need max_depth >= 1, got {max_depth}")
    max_depth = max(1, min(max_depth, max((len(v) for v in values), default=1)))  # no deeper than a draft goes
    by_depth = [0.0] * max_depth  # by_depth[i]: what the batch gains from draft token i + 1
    taking = [0] * max_depth  # taking[i]: requests whose draft has a token i + 1
    for v in values:
        for i, p in enumerate(v[:max_depth]):
            by_depth[i] += min(1.0, max(0.0, p))
            taking[i] += 1
    goodput, tokens, verified = [], base_tokens, other_tokens
    for d in range(1, max_depth + 1):
        tokens += by_depth[d - 1]
        verified += taking[d - 1]
        step_s = pass_s(max(1, verified))
        if step_s <= 0:
            raise ValueError(f"need a pass of positive time, got {step_s} s at {verified} tokens")
        goodput.append(tokens / (step_s + (d - 1) * depth_s))
    best = max(goodput)
    return max(d for d, g in enumerate(goodput, 1) if g * (1 + margin) >= best)


def calibration(accepted: float, predicted: float, prior_tokens: float, prior: float = 1.0) -> float:
    """What a source's drafts were accepted over what their path probabilities predicted (tokens,
    decayed counts), shrunk toward `prior` with `prior_tokens` pseudo-tokens at that ratio: the
    factor its path probabilities are scaled by. `prior` when nothing is counted and no prior weight."""
    return (accepted + prior_tokens * prior) / (predicted + prior_tokens) if predicted + prior_tokens > 0 else prior


def next_draft_len(
    state: SpeculationState, spec: SpeculationSpec, settings: SpeculationSettings, cost: Cost | None,
    path_probs: Sequence[float] | None = None,
) -> tuple[SpeculationState, int]:
    """Draft length for the next step, and the state to carry: k within `spec.max_draft_len`.

    With `path_probs` (the draft at hand's per-token path probabilities, see `best_path_len`) k is
    chosen on the draft itself, else on the request's acceptance estimate (`best_draft_len`).
    Without a cost model (not measured yet) or with `spec.adaptive` off: `spec.max_draft_len`. Load
    needs no separate feedback: under batching the cost prices each draft token at what it adds
    to the shared pass (`BatchedCost`), so k shrinks as the batch grows.
    """
    max_k = spec.max_draft_len
    if not spec.adaptive or cost is None:
        return state, max_k
    if path_probs is None:
        k = best_draft_len(state.acceptance_rate, cost, max_k)
    else:
        k = best_path_len(path_probs, cost, max_k, settings.min_path_prob)
    if k > 0:
        return (state if state.steps_since_probe == 0 else _probed(state, 0)), k
    if state.steps_since_probe + 1 >= settings.probe_interval_steps:
        return _probed(state, 0), min(settings.probe_draft_tokens, max_k)
    return _probed(state, state.steps_since_probe + 1), 0


def _probed(state: SpeculationState, steps_since_probe: int) -> SpeculationState:
    """`state` with its steps since the last probe set (what `dataclasses.replace` does, without its
    per-call field introspection: this runs for every request every step)."""
    return SpeculationState(state.accepted_ema, state.trials_ema, steps_since_probe)


def observe(
    state: SpeculationState, settings: SpeculationSettings, num_draft_tokens: int, num_accepted: int
) -> SpeculationState:
    """Fold one verification outcome into the acceptance estimate.

    Acceptance is a run of Bernoulli(alpha) trials that stops at the first rejection: n accepted of k
    drafted is n successes and, if n < k, one failure. A step that drafted nothing carries no signal.
    """
    if num_draft_tokens <= 0:
        return state
    trials = num_accepted + (1 if num_accepted < num_draft_tokens else 0)
    w = settings.ema_weight
    return SpeculationState((1 - w) * state.accepted_ema + w * num_accepted, (1 - w) * state.trials_ema + w * trials,
                            state.steps_since_probe)
