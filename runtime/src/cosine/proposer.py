"""CoSine's drafting plane inside an engine: per request id, which draft tokens the verifier checks next.

The engine (vLLM, through `vllm_hooks.CoSineScheduler`) calls two methods per step, never blocked
by a drafter:
- `observe_step(step)`: what the last engine step cost (wall seconds, tokens in the pass) and, per
  request, how many draft tokens it carried and how many the target accepted; this updates the
  measured pass curve, the per-request acceptance estimates and the router's per-pool statistics,
  and asks every routed pool to draft ahead from the request's new context;
- `propose(contexts)`: the draft for each running request, from what is available *now*: every
  local draft source's candidate (`sources`: the engine's own drafter, whose drafts the engine
  hands over each step; prompt lookup over the request's own tokens and earlier outputs), and any
  remote pool draft that has arrived and is still consistent with the context; pool drafts still
  in flight are counted late (`drafts_late`) and not waited for.

Every source is a peer, named only by its name: the proposer never branches on which source it
is. A local candidate that was not verified is still scored against the tokens the target went on
to emit, so each source's acceptance estimate for the request follows the target even while
another source's drafts win (what Hybrid Verified Decoding, arXiv:2606.01019, predicts before
choosing a cache draft over the model drafter's).

Several candidates are fused by confidence into one chain (Gao et al. 2025, arXiv:2503.10325,
"confidence-based token fusion", per position; through vLLM only chains are verified: vLLM 0.32
has no tree attention). The chain's length k comes from goodput on *measured* step times
(`speculation_control.next_draft_len` over a `BatchedCost` of the `PassCurve` refined by every step
the engine ran; SmartSpec, arXiv:2406.14066), per request and per draft at hand: each draft token
is weighed by its path probability (the probability that it and every token before it are
accepted: the suffix tree's counts, a pool's top-1 probabilities, multiplied down the chain and
calibrated per source and domain against what the target accepted; EAGLE-2, arXiv:2406.16858,
§4) against what one more token adds to this batch's pass, down to k = 0 with periodic probes
(`spec.speculation.draftLength: acceptanceRate`: by the request's acceptance rate instead).
Draft tokens reach the target as point-mass proposals, which vLLM's rejection sampler verifies
losslessly (accept x with p(x), else sample from p without x).

What the proposer decides about pools is `pool_policy.PoolPolicy` (the simulator calls the same
object). A pool is asked for a request only where it pays (`speculation_control.pool_pays`): its expected
accepted tokens per verifier step (the request's acceptance estimate for the pool, times the
share of the pool's drafts that arrive in time and still continue the context) must beat what the
best local source gives the same request (its acceptance times how often it has a draft). Elsewhere
the pool is asked only on probe steps (every `PoolPolicy.probe_every` steps of a request), so its
estimates can recover: a late or rejected pool stops taking drafter capacity for nothing.
With `fusion` the router may send a request to several pools; each is asked where it pays, and
every candidate that arrived is fused by confidence per position.

A pool is asked while the verifier checks the step's draft, so its answer serves the next step and
must continue whatever the target accepted of that draft plus the target's own token. The ask
carries the draft being verified (`expected`): the pool drafts past it, and from up to
`PoolPolicy.branches` of its likeliest rejection points with its guess of the target's token there
(`draft_engine.branch_points`); the next step uses the candidate that continues the context
(after PEARL's post-verify drafting, Liu et al., arXiv:2408.11850). How many tokens and branches
follows the pool's measured seconds per draft token and the verifier's measured step time
(`speculation_control.pool_ask`): the ask is sized to come back within the step it overlaps.

A failed pool (`pool_down_after` failures in a row) is left out for `pool_retry_s`; that is one
warning per pool at most every `pool_warn_every_s`, and a late or failed draft is otherwise only
a metric (`cosine_drafter_errors_total`, `cosine_spec_decode_drafts_late_total`), never a log line.

A pool is anything with the `Drafter` interface (`transport.replica_pool.ReplicaPool` over its
replicas' gRPC channels in deployments, each request on one replica); its calls run on this
module's threads, so a crashed or hung pool costs drafts, never a request.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace

from cosine_spec.cluster_spec import SpeculationSpec

from cosine import routing
from cosine import speculation_control as sc
from cosine.draft_chooser import DraftChooser, path_of
from cosine.drafter import Drafter
from cosine.fusion import DraftPath
from cosine.lookup import SuffixLookup, SuffixSettings
from cosine.pool_clients import PoolClients, PoolDraft, continuation
from cosine.pool_policy import PoolPolicy
from cosine.proposer_stats import ProposerStats
from cosine.sources import DraftSource, Where
from cosine.sources.lookup import LookupSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestOutcome:
    """One request's part of an engine step: draft tokens it carried, how many were accepted and
    which source's draft it was (a source's name, or "" for none)."""

    request_id: str
    num_draft_tokens: int
    num_accepted: int
    source: str = ""


@dataclass(frozen=True)
class StepRecord:
    """One engine step. step_s: wall seconds of the model pass (schedule to output). num_tokens:
    tokens computed in the pass, all requests together (prefill chunks, decodes and drafts).
    has_prefill: the pass computed prompt tokens too; such passes do not teach the pass curve,
    which prices decode passes (one pending token plus draft tokens per request).
    engine_depth: forwards the engine's own drafter ran in the step (vLLM's
    `num_spec_tokens_to_schedule`; 0: no engine drafter). num_requests: requests decoding in it."""

    step_s: float
    num_tokens: int
    outcomes: tuple[RequestOutcome, ...] = ()
    has_prefill: bool = False
    engine_depth: int = 0
    num_requests: int = 0


@dataclass(frozen=True)
class ProposerSettings:
    """speculation: the CRD's `spec.speculation` as parsed once (`SpeculationSpec`: k's upper bound
    `max_draft_len`, vLLM's `num_speculative_tokens`; `adaptive`; `fusion`: a request may be routed
    to several pools, whose drafts are fused (else one pool per request); `min_confidence`: pools
    stop a draft at the first token whose top-1 probability is below this; `branches`).
    control: the k controller's own tuning (`speculation_control`). routing: the pool router.
    lookup: with no `sources` given to the proposer, run prompt and cross-request lookup
    (`sources.lookup.LookupSource` over `lookup.SuffixLookup`) with the suffix trees' `suffix`
    settings. pool: when and how pools are asked (`pool_policy.PoolPolicy`).
    pool_retry_s: seconds a failed pool is left out, after
    `pool_down_after` failed calls in a row; pool_warn_every_s: at most one warning per pool in this many seconds.
    reroute_every: steps between re-routing a request. initial_step_s: the pass time assumed
    before any step was measured. pool_yield_decay: per-call decay of the yield's counts
    (`cosine_drafter_yield_tokens`). max_model_len: the verifier's context limit (vLLM's
    `max_model_len`): a request of n tokens gets at most `max_model_len - n - 1` draft tokens (the
    step computes them and a bonus token), as vLLM's own proposers clamp (None: no limit).
    calibration_decay: per-step decay of each source's (accepted, predicted) token counts that
    calibrate its path probabilities; calibration_prior_tokens: pseudo-tokens at ratio 1 (the
    source's own probabilities trusted until measured). engine_depth_ratio: the engine drafter's
    forward over the target's, assumed until steps measure it (`DraftChooser`'s `depth_ratio`).

    Raises ValueError for pool_yield_decay or calibration_decay outside (0, 1] or a negative prior
    (`SpeculationSpec` and `SuffixSettings` check their own bounds)."""

    speculation: SpeculationSpec = SpeculationSpec()
    control: sc.SpeculationSettings = sc.SpeculationSettings()
    routing: routing.RoutingSettings = routing.RoutingSettings()
    lookup: bool = True
    suffix: SuffixSettings = SuffixSettings()
    pool: PoolPolicy = PoolPolicy()
    pool_retry_s: float = 5.0
    pool_down_after: int = 3
    pool_warn_every_s: float = 60.0
    reroute_every: int = 16
    initial_step_s: float = 0.1
    pool_yield_decay: float = 0.97
    max_model_len: int | None = None  # the verifier's context limit, tokens: drafts never reach past it
    calibration_decay: float = 0.98
    calibration_prior_tokens: float = 2.0
    engine_depth_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.pool_yield_decay <= 1 or not 0 < self.calibration_decay <= 1:
            raise ValueError(f"need 0 < pool_yield_decay, calibration_decay <= 1, got {self.pool_yield_decay}, "
                             f"{self.calibration_decay}")
        if self.calibration_prior_tokens < 0:
            raise ValueError(f"need calibration_prior_tokens >= 0, got {self.calibration_prior_tokens}")


@dataclass
class _Request:
    domain: str
    pools: list[str]
    down: list[str] = field(default_factory=list)  # pools the router would have picked, but down: demand
    states: dict[str, sc.SpeculationState] = field(default_factory=dict)
    steps: int = 0
    last_source: str = ""
    last_confidence: float = 0.5  # mean top-1 probability of the last draft's tokens (the router's confidence)
    last_path: tuple[float, ...] = ()  # the last draft's path probabilities, uncalibrated (what was predicted)
    calibration: dict[str, tuple[float, float]] = field(default_factory=dict)  # source -> this request's
    # decayed (accepted, predicted) tokens (`CoSineProposer.calibration`)
    inflight: dict[str, Future] = field(default_factory=dict)  # pool -> Future[PoolDraft]
    arrived: dict[str, PoolDraft] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)  # every pool ever asked for this request (all are released)
    judged: set[str] = field(default_factory=set)  # pools whose latest ask's draft was judged on time or not
    hits: dict[str, float] = field(default_factory=dict)  # local source -> EMA of steps it had a draft
    unverified: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # local source -> (context
    # length, its candidate) of the last step, where another source's draft (or none) was verified
    engine_k: int | None = None  # k last chosen for a draft of the engine's own drafter (None: none yet)


class CoSineProposer:
    """The drafting plane for one verifier, facing the engine (see the module docstring): request
    state and routing here; the pools' calls are `pool_clients.PoolClients`', the choice of draft
    tokens `draft_chooser.DraftChooser`'s.

    Args:
        settings: `ProposerSettings`.
        pools: remote (or local) drafter pools, distinct names; may be empty (prompt lookup only).
        expertise: declared domains per pool name (the router's prior).
        classify: request domain from its prompt tokens (e.g. decode + `routing.classify_prompt`).
        clock: monotonic seconds (injected: tests, and the simulator's simulated time).
        seed: the router's Thompson-sampling seed.
        sources: the local draft sources (`sources.DraftSource`: the engine's own drafter, prompt
            lookup), asked every step; default: prompt lookup on `SuffixLookup(settings.suffix)`
            if `settings.lookup`, else none. The simulator injects modelled ones.
        executor: where pool calls run (default: the pools' own threads; the simulator's runs them
            in simulated time, `simulation.cluster.SimExecutor`). A call's round trip is timed from
            the ask to its future's completion.

    Raises:
        ValueError: two sources (local or pools) with one name.
    """

    def __init__(
        self,
        settings: ProposerSettings,
        pools: Sequence[Drafter] = (),
        expertise: Mapping[str, Sequence[str]] | None = None,
        *,
        classify: Callable[[Sequence[int]], str] = lambda prompt: "chat",
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
        sources: Sequence[DraftSource] | None = None,
        executor: Executor | None = None,
    ) -> None:
        if sources is None:
            sources = [LookupSource(SuffixLookup(settings.suffix))] if settings.lookup else []
        names = [p.name for p in pools]
        everything = names + [src.name for src in sources]
        if len(set(everything)) != len(everything):
            raise ValueError(f"draft sources need distinct names, got {everything}")
        s = settings
        self.sources = list(sources)
        self._paid = {src.name for src in self.sources if src.where == Where.ENGINE}  # drafted whatever wins
        self._engine_depth = settings.speculation.max_draft_len  # `engine_draft_len`, set by each `propose`
        self._pool_names = frozenset(names)
        self.settings = s
        self.profiles = [routing.DrafterProfile(n, tuple((expertise or {}).get(n, ()))) for n in names]
        self.classify = classify
        self.clock = clock
        self.router = routing.RouterState()
        self.stats = ProposerStats()
        self.pools = PoolClients(pools, self.stats, clock, min_confidence=s.speculation.min_confidence,
                                 down_after=s.pool_down_after, retry_s=s.pool_retry_s,
                                 warn_every_s=s.pool_warn_every_s, yield_decay=s.pool_yield_decay, executor=executor)
        self.chooser = DraftChooser(s.speculation, s.control, s.initial_step_s, s.calibration_decay,
                                    s.calibration_prior_tokens, depth_ratio=s.engine_depth_ratio)
        self._rng = random.Random(seed)
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()  # the router: routed from the engine's thread, observed from it too

    # ------------------------------------------------------------ engine-facing

    def observe_step(self, step: StepRecord) -> None:
        """Fold one engine step in: the pass curve learns (tokens, seconds); each outcome updates
        its request's acceptance estimate for the source and the router's (pool, domain) arm."""
        if not step.has_prefill:
            self.chooser.observe_pass(step.num_tokens, step.step_s, step.engine_depth, step.num_requests)
        self.stats.observe_step(step.step_s, step.num_tokens, any(o.num_draft_tokens for o in step.outcomes))
        control, stats, pools = self.settings.control, self.stats, self.pools
        learned: list[routing.Outcome] = []  # the router's, folded in together (`_learn`)
        for o in step.outcomes:
            req = self._requests.get(o.request_id)
            if req is None or o.num_draft_tokens <= 0 or not o.source:
                continue
            st = req.states.get(o.source)
            if st is None:  # (`propose` stored one for each source it drafted from: an outcome it did not draft)
                self._learn(learned)  # its initial state reads the router as of the outcomes before
                st = self._initial_state(o.source, req.domain)
            req.states[o.source] = sc.observe(st, control, o.num_draft_tokens, o.num_accepted)
            if o.source == req.last_source and req.last_path:
                self.chooser.calibrate(o.source, req.domain, req.calibration, o.num_accepted,
                                       sum(req.last_path[: o.num_draft_tokens]))
            stats.observe_draft(o.source, o.num_draft_tokens, o.num_accepted)
            if o.source in self._pool_names:
                pools.accepted(o.source, o.num_accepted)
            # every source's per-domain acceptance is learned across requests (prompt lookup's too:
            # it is the prior of the next request of the domain); pools' arms also route
            learned.append(routing.Outcome(o.source, req.domain, o.num_draft_tokens, o.num_accepted,
                                           req.last_confidence))
        self._learn(learned)

    def _learn(self, learned: list[routing.Outcome]) -> None:
        """Fold outcomes into the router, in order, under one hold of its lock; `learned` is emptied."""
        if learned:
            with self._lock:
                self.router = routing.observe_all(self.router, learned, self.settings.routing)
            learned.clear()

    def propose(
        self, contexts: Mapping[str, Sequence[int]], prompt_lens: Mapping[str, int] | None = None,
        anchor_tokens: int = 0,
    ) -> dict[str, list[int]]:
        """Draft tokens per request for the next step (possibly empty), never waiting on a pool.

        Args:
            contexts: request id -> all its tokens so far (prompt + output), for the running
                requests that decode next step.
            prompt_lens: request id -> prompt length (for routing a new request by its prompt).
            anchor_tokens: 0 where the drafts are verified next step (V1). The MRV2 seam: they
                are verified a step later, after the step in flight, from candidates anchored at
                `contexts` up to this many tokens (`anchored`); a free source's draft then spares
                the engine drafter its deeper forwards only where it outlasts that step (`_outlasts`).
        Returns:
            request id -> draft token ids, at most `settings.speculation.max_draft_len`.
        """
        num_requests = len(contexts)
        base = num_requests  # each request's pending token
        chooser, max_model_len = self.chooser, self.settings.max_model_len
        k_max = self.settings.speculation.max_draft_len
        drafts: dict[str, list[int]] = {}
        drafted = 0  # draft tokens given to the requests before this one (a running sum: O(1) per request)
        engine_k = -1  # the most draft tokens of the engine's drafter a request may take next (-1: none known)
        engine_values: list[tuple[float, ...]] = []  # per request taking the drafter's draft: its tokens' values
        other_value = 0.0  # expected accepted tokens of the other sources' drafts
        engine_drafted = 0  # draft tokens taken from the engine's drafter where it was paid for
        for rid, ctx in contexts.items():
            req = self._requests.get(rid)
            if req is None:
                plen = (prompt_lens or {}).get(rid, len(ctx))
                req = self._new_request(rid, ctx[:plen])
            # the tokens the step in flight is expected to emit (its draft's path, the bonus token)
            in_flight = 1.0 + sum(req.last_path) if anchor_tokens > 0 else 0.0
            tokens, source, path, cost = self._fused(rid, req, ctx, base - 1 + drafted, num_requests)
            k = 0
            calibrated: tuple[float, ...] = ()
            if tokens:
                state = req.states.get(source) or self._initial_state(source, req.domain)
                calibrated = chooser.calibrated(source, req.domain, req.calibration, path)
                cost = cost or chooser.cost(base - 1 + drafted, num_requests)
                req.states[source], k = chooser.draft_len(state, calibrated, cost, paid=source in self._paid)
            if max_model_len is not None:
                k = min(k, max(0, max_model_len - len(ctx) - 1))
            draft = drafts[rid] = list(tokens[:k])
            drafted += len(draft)
            engine_value = None  # the values of the engine drafter's tokens it takes, where paid for
            if self._paid and (source in self._paid or k):
                engine_value = self._engine_value(rid, req, ctx, source, tokens, calibrated, k, anchor_tokens,
                                                  in_flight)
                if engine_value is not None:
                    engine_values.append(engine_value)
                    engine_drafted += k
            if engine_value is None and (source not in self._paid or k):
                other_value += sum(calibrated[:k])
            engine_k = max(engine_k, k_max if req.engine_k is None else req.engine_k)
            if k:
                req.unverified.pop(source, None)  # verified: its outcome is the engine's to report
                req.last_source = source
                req.last_confidence = sum(path[:k]) / k
            else:
                req.last_source = ""
            req.last_path = path[:k]
            req.steps += 1
            if self.profiles:  # (without pools nothing is asked, nor routed)
                self._request_pool_drafts(rid, req, ctx, draft)
        if self._paid:
            if engine_k < 0 or not self.settings.speculation.adaptive:  # (adaptive off: always k_max)
                self._engine_depth = k_max
            else:
                most = max(1, min(k_max, engine_k + 1))
                self._engine_depth = chooser.engine_depth(engine_values, num_requests + other_value,
                                                          base + drafted - engine_drafted, most)
        return drafts

    def _engine_value(self, rid: str, req: _Request, ctx: Sequence[int], source: str, tokens: Sequence[int],
                      calibrated: Sequence[float], k: int, anchor_tokens: int, in_flight: float
                      ) -> tuple[float, ...] | None:
        """What the engine drafter's tokens are worth to the request next step (each one's path
        probability), None where its draft is not paid for: where another source's draft won, or
        lookup drafted the same tokens, its first token will do (unless, through MRV2, that
        draft will not outlast the step in flight: `_outlasts`). Sets the request's `engine_k`."""
        k_max = self.settings.speculation.max_draft_len
        covered = source not in self._paid or any(
            name not in self._paid and cand[:k] == tokens[:k] for name, (_, cand) in req.unverified.items())
        if covered and anchor_tokens > 0 and source not in self._paid:
            rate = max(self._state(req, name).acceptance_rate for name in self._paid)
            full = tuple(rate ** i for i in range(1, k_max + 1))  # the drafter's full draft, by token
            if not self._outlasts(rid, ctx, anchor_tokens, in_flight, sum(full)):
                req.engine_k = k_max  # the device will verify the engine's draft after all: as deep as it pays
                return full
        req.engine_k = 0 if covered and k else k
        if covered:
            return None
        # next step it may take one token more (k grows a token a step): a draft shorter than that
        # (the drafter drafted no deeper) goes on at the request's rate
        value = list(calibrated[: k + 1])
        alpha = req.states[source].acceptance_rate if source in req.states else 0.0
        while len(value) < k + 1:
            value.append((value[-1] if value else 1.0) * alpha)
        return tuple(value)

    def _outlasts(self, rid: str, ctx: Sequence[int], anchor_tokens: int, in_flight: float,
                  engine_value: float) -> bool:
        """The MRV2 seam: whether the request's anchored candidate, past the `in_flight` tokens the
        step in flight is expected to emit, is still worth at least `engine_value`, the engine
        drafter's full draft (expected accepted tokens: its path probabilities there over the
        path at the shift, as `vllm_mrv2.choose` weighs it on the device, against sum_i rate^i
        over k). Where it is not, the device verifies the engine's draft, which must be drafted
        deep enough to."""
        tokens, path, _ = self.anchored(rid, ctx, anchor_tokens)
        shift, k_max = round(in_flight), self.settings.speculation.max_draft_len
        if len(tokens) <= shift:
            return False
        before = path[shift - 1] if shift > 0 else 1.0
        rest = sum(path[shift: shift + k_max]) / before if before > 0 else 0.0
        return rest >= engine_value

    def anchored(self, request_id: str, context: Sequence[int], max_tokens: int
                 ) -> tuple[tuple[int, ...], tuple[float, ...], str]:
        """The best candidate of the verifier process's sources for the request (every local source
        not in the engine, each routed pool's arrived draft that continues `context`), for the
        MRV2 seam to deliver *anchored* at `len(context)`: (its tokens, up to `max_tokens`, each
        token's calibrated path probability, its source), the one with the most expected accepted
        tokens (the sum of its path probabilities); empty for an unknown request or none. Call
        after `propose` for the same step (which routes the request and scores the last step)."""
        req = self._requests.get(request_id)
        if req is None or max_tokens <= 0:
            return (), (), ""
        found: list[tuple[str, tuple[int, ...], tuple[float, ...]]] = []
        for src in self.sources:
            if src.name in self._paid:
                continue
            cand = src.candidate(request_id, context, max_tokens, self._state(req, src.name).acceptance_rate)
            if cand is not None:
                found.append((src.name, cand.token_ids, cand.confidences))
        for name in req.pools:
            d = req.arrived.get(name)
            usable = continuation(d, context) if d is not None else None
            if usable:
                found.append((name, tuple(usable[0][:max_tokens]), tuple(usable[1][:max_tokens])))
        best: tuple[tuple[int, ...], tuple[float, ...], str] = ((), (), "")
        best_value = 0.0
        for name, tokens, confidences in found:
            path = self.chooser.calibrated(name, req.domain, req.calibration, path_of(confidences))
            if sum(path) > best_value:
                best, best_value = (tokens, path, name), sum(path)
        return best

    def acceptance_rate(self, request_id: str, source: str) -> float:
        """The request's per-token acceptance estimate for `source` (its domain's prior for an
        unknown request or a source it has not drafted from)."""
        req = self._requests.get(request_id)
        if req is None:
            return self._initial_state(source, "chat").acceptance_rate
        return self._state(req, source).acceptance_rate

    def engine_draft_len(self) -> int:
        """How many tokens the engine's own drafter should draft after the coming step (vLLM's
        `SchedulerOutput.num_spec_tokens_to_schedule`, its dynamic speculative decoding's seam),
        for the whole batch: at most one more than the most any request of the last `propose` took
        of its engine draft (a request's k for the source grows by at most one a step:
        `speculation_control`'s probes; none where another source's draft was verified instead,
        or a free source drafted the same chain: lookup copying a span), and within that the depth
        with the most expected tokens a second for the batch (`speculation_control.best_depth`):
        each forward past the first costs the whole step its measured seconds
        (`DraftChooser.depth_s`, about a third of a pass for the 0.5B drafter of a 1.5B target on
        CPU, a few percent for an EAGLE-3 head on GPU) and adds the path probabilities of the
        tokens the requests would take from it. `max_draft_len` while a request has not had an
        engine draft, and always with `speculation.adaptive: false`; at least 1 (vLLM runs the
        drafter's first forward at any depth)."""
        return self._engine_depth

    def prefetch(self, request_id: str, prompt: Sequence[int]) -> None:
        """A request the engine starts prefilling: route it and ask its pools for a first draft
        now, so they take in the prompt (their own prefill) while the target prefills it, instead
        of after it. Never blocks; a request already known is left alone."""
        if request_id in self._requests or not prompt or not self.pools:
            return
        req = self._new_request(request_id, prompt)
        now = self.clock()
        for name in req.pools:
            if self.pools.allows(name, now):
                req.used.add(name)
                req.inflight[name] = self.pools.ask(name, request_id, tuple(prompt),
                                                    self.settings.speculation.max_draft_len + 1, prefill=True)

    def source_of(self, request_id: str) -> str:
        """The source of the draft last proposed for the request ("" for none)."""
        req = self._requests.get(request_id)
        return req.last_source if req else ""

    def retain(self, live: Collection[str]) -> None:
        """Release every request not in `live` (the engine's unfinished request ids)."""
        for gone in [r for r in self._requests if r not in live]:
            self.release(gone)

    def release(self, request_id: str) -> None:
        """Forget a finished request: its output stays in the suffix trees; pools release it once
        its calls returned."""
        req = self._requests.pop(request_id, None)
        for src in self.sources:
            src.release(request_id)
        if req is not None:
            self.pools.release(request_id, set(req.used), [f for f in req.inflight.values() if not f.done()])

    def num_requests(self) -> int:
        """Requests whose state the proposer keeps (0 once every request finished)."""
        return len(self._requests)

    def replica_stats(self) -> dict[str, dict]:
        """Per pool with replicas (`ReplicaPool`), its per-replica counters (`replica_stats()`)."""
        return self.pools.replica_stats()

    def close(self) -> None:
        """Stop the pool-call threads without waiting; queued pool calls are cancelled."""
        self.pools.close()

    def calibration(self, source: str, domain: str, request_id: str | None = None) -> float:
        """What the target accepted of a source's drafts over what their path probabilities
        predicted, for requests of `domain` or for one running request (`DraftChooser.calibration`)."""
        req = self._requests.get(request_id) if request_id is not None else None
        return self.chooser.calibration(source, domain, req.calibration if req else None)

    # ------------------------------------------------------------ requests and routing

    def _initial_state(self, source: str, domain: str) -> sc.SpeculationState:
        """A request's starting acceptance estimate for a source: the source's measured per-domain
        acceptance on earlier requests (the router's discounted posterior mean; its declared
        expertise, or none for prompt lookup, as the prior)."""
        profile = next((p for p in self.profiles if p.name == source), routing.DrafterProfile(source, ()))
        with self._lock:
            alpha = routing.expected_acceptance(self.router, profile, domain, self.settings.routing)
        return sc.initial_state(self.settings.control, alpha)

    def _new_request(self, rid: str, prompt: Sequence[int]) -> _Request:
        domain = self.classify(prompt)
        pools, down = self._route(domain)
        req = _Request(domain=domain, pools=pools, down=down)
        self._requests[rid] = req
        for src in self.sources:
            src.start(rid, prompt)
        return req

    def _route(self, domain: str) -> tuple[list[str], list[str]]:
        """(the pools routed to a request of `domain`, best first; those the router would have
        picked but are down). The router ranks every pool; the first `max_drafters` up are routed.
        The down ones it preferred are the demand a pool at zero replicas cannot otherwise show."""
        if not self.profiles:
            return [], []
        rs = PoolPolicy.routing_settings(self.settings.routing, len(self.profiles), self.settings.speculation.fusion)
        now = self.clock()
        with self._lock:
            ranked = routing.route(domain, self.profiles, self.router, replace(rs, max_drafters=len(self.profiles)),
                                   self._rng.betavariate)
        up = [n for n in ranked if self.pools.allows(n, now)]
        return up[: rs.max_drafters], [n for n in ranked[: rs.max_drafters] if n not in up]

    # ------------------------------------------------------------ candidates and asks

    def _fused(self, rid: str, req: _Request, ctx: Sequence[int], other_tokens: int, num_requests: int
               ) -> tuple[tuple[int, ...], str, tuple[float, ...], sc.BatchedCost | None]:
        """Every candidate available now (each local source's, each routed pool's that arrived and
        continues `ctx`), fused (`DraftChooser.fuse`, each weighed on the step's pass, whose
        `num_requests` requests' other tokens are `other_tokens`): the chain, its first token's
        source, each token's path probability, and that pass's cost where candidates were weighed."""
        k_max = self.settings.speculation.max_draft_len
        if req.unverified:
            self._score_unverified(req, ctx)
        paths: list[DraftPath] = []
        alphas: dict[str, float] = {}  # each candidate's source's acceptance rate for the request
        hits, states = req.hits, req.states
        for src in self.sources if k_max > 0 else ():
            name = src.name
            alpha = (states.get(name) or self._initial_state(name, req.domain)).acceptance_rate
            cand = src.candidate(rid, ctx, k_max, alpha)
            if self.profiles:  # (hit rates weigh pools only: `_skip_reason`)
                hits[name] = PoolPolicy.hit_rate(hits.get(name, 0.5), cand is not None)
            if cand is not None:
                paths.append(DraftPath(name, cand.token_ids, cand.confidences))
                alphas[name] = alpha
                if not cand.on_device:  # (the MRV2 seam's placeholders: its tokens are not known here)
                    req.unverified[name] = (len(ctx), cand.token_ids)
        for name in req.pools:
            usable = self._arrived(req, name, ctx)
            if usable:
                paths.append(DraftPath(name, usable[0], usable[1]))
                alphas[name] = self._state(req, name).acceptance_rate
        if len(paths) < 2:
            return (*self.chooser.fuse(paths, {}), None)
        cost = self.chooser.cost(other_tokens, num_requests)
        return (*self.chooser.fuse(paths, alphas, cost), cost)

    def _state(self, req: _Request, source: str) -> sc.SpeculationState:
        return req.states.get(source) or self._initial_state(source, req.domain)

    def _score_unverified(self, req: _Request, ctx: Sequence[int]) -> None:
        """Score the local candidates of the last step that the target did not verify against the
        tokens it emitted since: n of them compared, the matching prefix accepted (censored at the
        tokens emitted, as a draft of that length would be)."""
        for name, (ctx_len, tokens) in req.unverified.items():
            emitted = ctx[ctx_len:]
            n = min(len(tokens), len(emitted))
            if n <= 0 or len(ctx) < ctx_len:
                continue
            accepted = 0
            while accepted < n and tokens[accepted] == emitted[accepted]:
                accepted += 1
            req.states[name] = sc.observe(self._state(req, name), self.settings.control, n, accepted)
        req.unverified.clear()

    def _arrived(
        self, req: _Request, name: str, ctx: Sequence[int]
    ) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
        """The part of the pool's latest draft that continues `ctx`, if it has arrived and the
        tokens the target emitted since it was asked for are the draft's own first tokens."""
        fut = req.inflight.get(name)
        if fut is not None and fut.done():
            req.inflight.pop(name)
            try:
                req.arrived[name] = fut.result()
            except Exception:  # noqa: BLE001 - a failed pool costs drafts, never the request
                req.arrived.pop(name, None)  # (a failure is not a late draft: it is counted as an error)
        d = req.arrived.get(name)
        if d is None:
            if fut is not None and not fut.done():
                self.stats.add(self.stats.drafts_late, name)
                self._on_time(req, name, None, final=False)
            return None
        best = continuation(d, ctx)
        self._on_time(req, name, best is not None, final=fut is None or fut.done())
        return best

    def _on_time(self, req: _Request, name: str, usable: bool | None, final: bool) -> None:
        """Fold one look at a pool's draft for a request into the pool's on-time share (EMA over
        looks, all requests: the share of steps a pool asked for has its draft back) and, once it
        has arrived, its on-context share (EMA over arrived drafts: the share that continues the
        context): `usable` None while the draft is in flight (late), else whether it continues.
        Late drafts want a faster or larger pool; off-context ones do not (the target went
        elsewhere than the pool guessed), so the two are kept apart. Looks are judged from an ask
        until the first look after its draft arrived (`final`); later looks, at a draft left behind while the pool is
        not asked, are not: they say nothing of the pool's speed, and counting them held a skipped
        pool's share down for as long as it was skipped."""
        if name in req.judged:
            return
        if final:
            req.judged.add(name)
        self.stats.set(self.stats.pool_on_time, name,
                       PoolPolicy.on_time(self.stats.pool_on_time.get(name, 1.0), usable is not None))
        if usable is not None:
            self.stats.set(self.stats.pool_on_context, name,
                           PoolPolicy.on_time(self.stats.pool_on_context.get(name, 1.0), usable))

    def _request_pool_drafts(self, rid: str, req: _Request, ctx: Sequence[int], expected: Sequence[int]) -> None:
        """Ask each routed pool that is idle for this request to draft ahead from `ctx`, past the
        `expected` draft tokens the verifier checks meanwhile and from their likeliest rejection
        points (the verifier's next context is `ctx` plus what it accepts of them plus one token)."""
        if req.steps % self.settings.reroute_every == 0 and req.steps:
            req.pools, req.down = self._route(req.domain)
        if not req.pools and not req.down:
            return
        now = self.clock()
        s = self.settings
        step_s = self.chooser.step_s()
        local = self._local_estimates(req)
        for name in (*req.pools, *req.down):
            alpha = self._state(req, name).acceptance_rate
            reason = self._skip_reason(name, alpha, local)
            down = name in req.down or not self.pools.allows(name, now)
            if reason is None and down:
                reason = "down"  # it would have been asked: demand the autoscaler sees (a pool at zero)
            probe = reason is not None and not down and s.pool.probe_step(req.steps)
            if reason != "yield":  # the request wants the pool (demand, its draft in flight included): what it adds
                self.stats.add(self.stats.pool_gain_tokens, name, s.pool.gain_tokens(
                    alpha, local, self._draft_k(req), self.stats.pool_on_context.get(name, 1.0)))
            if reason is not None and not probe:
                self.stats.add(self.stats.pool_skipped, (name, reason))
                continue
            fut = req.inflight.get(name)
            if fut is not None and not fut.done():
                continue
            if reason == "yield":  # asked only to probe (a late pool's probe is demand, as its skips are)
                self.stats.add(self.stats.pool_probes, name)
            k, branches = s.pool.ask(step_s, self.stats.pool_token_s.get(name), self.stats.pool_rtt_s.get(name, 0.0),
                                     s.speculation.max_draft_len, verifying=bool(expected))
            req.used.add(name)
            req.judged.discard(name)
            req.inflight[name] = self.pools.ask(name, rid, tuple(ctx), k, tuple(expected), branches)

    def _draft_k(self, req: _Request) -> int:
        """The draft length what a pool adds for `req` is counted at for the autoscaler
        (`pool_gain_tokens`): the request's last draft's (the depth the verifier takes now: short
        where the pass is compute-bound), `max_draft_len` before its first. An ask is still weighed
        at `max_draft_len` (`_skip_reason`): a pool's draft may be taken deeper than the request's
        last, and at the last draft's length `cosine-no-head` lost up to 2.6% in the paper study."""
        return len(req.last_path) or self.settings.speculation.max_draft_len

    def _local_estimates(self, req: _Request) -> list[tuple[float, float]]:
        """Per local source, the request's (acceptance estimate, hit rate)."""
        return [(self._state(req, src.name).acceptance_rate, req.hits.get(src.name, 0.5)) for src in self.sources]

    def _skip_reason(self, name: str, alpha: float, local: list[tuple[float, float]]) -> str | None:
        """Why not to ask the pool this step for a request whose acceptance estimate for it is
        `alpha` (`PoolPolicy.skip_reason` against the best local source, `local`, an ask priced at
        the pool's measured seconds a call; `None`: ask), its probe steps aside (the caller's)."""
        return self.settings.pool.skip_reason(alpha,
                                               self.stats.pool_on_time.get(name, 1.0), local,
                                               self.settings.speculation.max_draft_len,
                                               on_context=self.stats.pool_on_context.get(name, 1.0),
                                               pool=name, ask_s=self.stats.pool_rtt_s.get(name, 0.0))
