"""A discrete-event simulation of one CoSineCluster (SimPy processes; no event loop of our own).

What serves, modelled step by step:
- each verifier replica is vLLM's scheduler: every engine step has a token budget
  (`max_batch_tokens`, vLLM's `max_num_batched_tokens`); running requests go first, each with its
  pending token plus its draft tokens (a draft clipped to what is left of the budget), a request
  still prefilling with the next chunk of its prompt (chunked prefill), then waiting requests are
  admitted first come, first served, up to `max_requests`, their prompts chunked into what is left.
  The step takes `pass_s(tokens in the step)`;
- the drafting plane is CoSine's own `proposer.CoSineProposer`, one per verifier replica, called as
  `vllm_hooks` calls it: `prefetch` when a request is admitted, `observe_step` with each step's
  time, tokens and per-request outcomes, `propose` for the next step. Its clock is the simulated
  one and its pool calls run on a `SimExecutor` in simulated time, so routing, fusion, the draft
  length by path probability against the learnt pass curve, calibration, when and how much a pool
  is asked (`pool_policy.PoolPolicy`) and late drafts are the serving path's, not a copy;
- what the proposer cannot tell from a model is simulated: the target's output (`_Sequence.truth`,
  greedy: a draft is accepted up to its first token that is not the target's); prompt lookup
  (`_SimLookup`: a draft on a share of steps, `LookupModel`); pools (`_SimPool`: replicas, each
  `slots` requests at once behind a network (RTT, bandwidth), requests assigned for their lifetime
  by `pool_policy.assign_replica` as `ReplicaPool` does, drafts past the draft being verified and
  from its rejection points). Each draft token is the target's at the request's acceptance rate for
  its source (`AcceptanceModel`), until the first miss;
- the operator's `autoscaling.desired_replicas` scales pools every `interval_s` on the series it
  scrapes (the proposers' counters, the pools' busy time).

Modes: `target-only` (vLLM, no speculation); `cosine` (the proposer: prompt lookup if the setup
has a `LookupModel`, and the pools); `vanilla` (a drafter co-located on the verifier drafts
`max_draft_len` tokens for every request before each step: vLLM's draft-model speculation, whose
k is fixed); `eagle3` (the same with a draft head inside the verifier, vLLM's `eagle3` method:
its acceptance is the `eagle3` key of the `AcceptanceModel`, its forward per draft token
`VerifierModel.colocated_draft_s`).
"""

from __future__ import annotations

import random
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import simpy
from cosine_spec import autoscaling
from cosine_spec.cluster_spec import RouterWeights, SpeculationSpec
from cosine_spec.scaling_loop import ScalingLoop

from cosine import routing, speculation_control
from cosine.drafter import Draft, DraftBranch
from cosine.pool_policy import PoolPolicy, assign_replica
from cosine.proposer import CoSineProposer, ProposerSettings, RequestOutcome, StepRecord
from cosine.simulation.cost_models import AcceptanceModel
from cosine.sources.lookup import LOOKUP, LookupSource

MODES = ("target-only", "vanilla", "eagle3", "cosine")
EAGLE3 = "eagle3"  # the draft source name of an in-verifier draft head
DRAFT_BYTES_PER_TOKEN = 8  # a draft token on the wire: its id and its confidence (no distribution)


@dataclass(frozen=True)
class PoolModel:
    """A drafter pool: `slots` requests drafted at once per replica, `draft_token_s` per token per
    request at that load, `catch_up_token_s` per unseen context token; the link to the verifier.
    How many tokens a call drafts is the proposer's `PoolPolicy.ask`; whether a draft back in time
    still continues the context follows from what the target accepted meanwhile (`_SimPool`)."""

    name: str
    expertise: tuple[str, ...]
    replicas: int
    min_replicas: int
    max_replicas: int
    draft_token_s: float
    catch_up_token_s: float = 0.0
    slots: int = 1
    rtt_s: float = 0.0
    bandwidth_bytes_per_s: float = 1.25e9
    price_per_hour_usd: float = 0.0


@dataclass(frozen=True)
class LookupModel:
    """Prompt lookup: on a decode step it finds a draft with probability `hit_rate`, of up to
    `draft_tokens` tokens (acceptance: the `lookup` key of the `AcceptanceModel`); `per_domain`
    overrides both for a domain: domain -> (hit_rate, draft_tokens). `seen_hit_factor`: the hit
    rate's factor on a later turn of a conversation whose earlier turns this verifier replica
    served (its global suffix tree holds their outputs; `Workload.sessions`)."""

    hit_rate: float
    draft_tokens: int
    per_domain: dict[str, tuple[float, int]] = field(default_factory=dict)
    seen_hit_factor: float = 1.0

    def on(self, domain: str, seen: bool = False) -> tuple[float, int]:
        """(hit rate, draft tokens) on a domain; `seen`: the replica served the conversation before."""
        hit, tokens = self.per_domain.get(domain, (self.hit_rate, self.draft_tokens))
        return (min(1.0, hit * self.seen_hit_factor), tokens) if seen else (hit, tokens)


@dataclass(frozen=True)
class VerifierModel:
    """pass_s(tokens, kv_tokens) -> seconds of one engine step; max_batch_tokens: vLLM's
    `max_num_batched_tokens`; max_requests: its `max_num_seqs`. `colocated_draft_s(batch)`: one
    draft token for each of `batch` requests by a co-located drafter (vanilla mode)."""

    pass_s: Callable[[int, int], float]
    replicas: int = 1
    max_batch_tokens: int = 2048
    max_requests: int = 256
    price_per_hour_usd: float = 0.0
    colocated_draft_s: Callable[[int], float] = lambda batch: 0.0
    # tokens of context each replica's prefix cache keeps after requests finish (vLLM's automatic
    # prefix caching in its free KV blocks, least recently used evicted); 0: not modelled
    prefix_cache_tokens: int = 0


@dataclass(frozen=True)
class RequestSpec:
    """One request. `session`: the conversation it is a turn of (-1: none); `history_tokens`:
    the leading prompt tokens that are that conversation's earlier turns (a replica holding them
    in its prefix cache prefills only the rest)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    domain: str
    session: int = -1
    history_tokens: int = 0


@dataclass(frozen=True)
class Workload:
    """`requests` in arrival order; with `concurrency` set, a closed loop (arrival times ignored):
    `concurrency` clients, each sending the next request when its last one completes; with
    `sessions` too, each client takes a whole conversation and sends its turns in order."""

    requests: tuple[RequestSpec, ...]
    concurrency: int | None = None
    sessions: bool = False


@dataclass(frozen=True)
class Preemption:
    """Spot capacity under every pool: each ready replica is preempted at `per_replica_hour`
    (Poisson), with `notice_s` of notice, and replaced after `replacement_s` (a new node and pod).
    At the notice the replica drains as `drafter_service.drain` does: it takes no new calls, its
    requests are re-homed at their next call (their whole context resent), the calls it holds
    finish. Its price stops at the notice (the seconds it drains are not charged)."""

    per_replica_hour: float
    notice_s: float = 30.0
    replacement_s: float = 120.0


@dataclass(frozen=True)
class SimSetup:
    """speculation (the CRD's `spec.speculation`), control, pool_policy: the proposer's settings of
    the same names (`proposer.ProposerSettings`)."""

    mode: str
    verifier: VerifierModel
    pools: tuple[PoolModel, ...]
    acceptance: AcceptanceModel
    speculation: SpeculationSpec
    routing_settings: routing.RoutingSettings = routing.RoutingSettings()
    scaling: autoscaling.ScalingPolicy | None = None
    interval_s: float = 30.0
    pod_start_s: float = 30.0
    lookup: LookupModel | None = None
    pool_policy: PoolPolicy = PoolPolicy()
    control: speculation_control.SpeculationSettings = speculation_control.SpeculationSettings()
    seed: int = 0
    preemption: Preemption | None = None
    router: str = "shared"  # ROUTERS: how requests reach verifier replicas
    router_weights: RouterWeights = RouterWeights()  # the `affinity` router's scorer weights


# How requests reach the verifier replicas:
# - shared: one queue every replica takes from when it has room (an ideal balancer, no affinity);
# - random: each request to a replica drawn at random (a Service's kube-proxy, a client that
#   reconnects per request);
# - session: every turn of a conversation to the replica of its first turn (drawn at random);
# - affinity: the endpoint picker's weighted scorers (`RouterWeights`, `endpoint_score`), the
#   highest score taken.
ROUTERS = ("shared", "random", "session", "affinity")


def endpoint_score(weights: RouterWeights, prefix_hit: float, same_session: bool, suffix_hit_rate: float,
                   queue_score: float, kv_free: float) -> float:
    """A replica's score as the Gateway API Inference Extension's endpoint picker sums its scorers
    (each in [0, 1], weighted: `spec.router.weights`): prefix-cache (the share of the prompt the
    replica's cache holds), session-affinity (1 on the session's last replica), CoSine's
    `cosine_suffix_tree_hit_rate` through the metric scorer (linear on [0, 1]), queue (the
    emptiest waiting queue 1, the fullest 0) and KV-cache utilisation (free share)."""
    return (weights.prefix_cache * prefix_hit + weights.session_affinity * same_session
            + weights.suffix_affinity * suffix_hit_rate + weights.queue * queue_score
            + weights.kv_cache_utilization * kv_free)


TRUTH_IDS = 1 << 30  # the target's tokens are drawn from [0, TRUTH_IDS); a missed guess is -1, never the target's


@dataclass
class _Sequence:
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


class SimExecutor(Executor):
    """`CoSineProposer`'s pool-call executor in simulated time. A submitted call runs at once (at
    the ask: the simulated pool computes its draft from the context it was sent) and registers its
    simulated work (`defer`); its future resolves when that work has elapsed, so the proposer finds
    the draft arrived (or still in flight) and learns the round trip as it does over gRPC."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self._work: list[simpy.events.ProcessGenerator] = []

    def defer(self, work: simpy.events.ProcessGenerator) -> None:
        """Simulated time the running call takes (a SimPy generator), before its future resolves."""
        self._work.append(work)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        self._work = []
        try:
            result, error = fn(*args, **kwargs), None
        except Exception as e:  # noqa: BLE001 - delivered through the future, as a thread pool does
            result, error = None, e
        self.env.process(self._finish(fut, self._work, result, error))
        self._work = []
        return fut

    def _finish(self, fut: Future, work: list, result: Any, error: Exception | None) -> simpy.events.ProcessGenerator:
        for w in work:
            yield from w
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


class _SimLookup:
    """Prompt lookup as `lookup.SuffixLookup`'s interface: on a share `hit_rate` of calls it finds a
    draft of up to `draft_tokens`, each token the target's at the request's lookup acceptance rate;
    its path probabilities are the domain's mean rate compounded (the tree's counts would be the
    request's own: the proposer's per-request calibration learns the difference, as it does live)."""

    def __init__(self, model: LookupModel, cluster: _Cluster) -> None:
        self.model, self.cluster = model, cluster

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        pass

    def propose(self, request_id: str, context: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        seq = self.cluster.seqs[request_id]
        hit_rate, draft_tokens = self.model.on(seq.spec.domain, self.cluster.seen_by(seq))
        if max_tokens <= 0:
            return [], []
        hit = seq.rng.random() < hit_rate
        self.cluster.observe_lookup(seq.replica, hit)
        if not hit:
            return [], []
        n = min(max_tokens, draft_tokens)
        mean = self.cluster.s.acceptance.mean(LOOKUP, seq.spec.domain)
        tokens = seq.guess(len(context) - seq.spec.prompt_tokens, n, self.cluster.alpha(seq, LOOKUP))
        return tokens, [mean ** (i + 1) for i in range(n)]

    def release(self, request_id: str) -> None:
        pass


class _SimPool:
    """A drafter pool as the proposer calls it (`drafter.Drafter`, like `ReplicaPool`): each
    request assigned to one replica for its lifetime (`pool_policy.assign_replica`; a request whose
    replica was removed is re-homed and sends its whole context again), a call queued for one of the
    replica's `slots`, then drafting. Its draft continues the context past `expected` (the draft the
    verifier checks meanwhile) and branches at `expected`'s rejection points where the pool's own
    guess differs (PEARL's post-verify drafting); confidences are the pool's mean acceptance on
    the domain. No replica: `RuntimeError`, as `ReplicaPool` raises."""

    def __init__(self, model: PoolModel, cluster: _Cluster) -> None:
        self.model, self.name, self.cluster = model, model.name, cluster
        env = cluster.env
        self.slots = [simpy.Container(env, capacity=model.slots, init=model.slots) for _ in range(model.replicas)]
        self.active = list(range(model.replicas))  # the replicas taking requests
        self.held: dict[str, int] = {}  # replica -> requests assigned to it
        self.home: dict[str, int] = {}  # request -> its replica
        self.seen: dict[str, int] = {}  # request -> context tokens its replica holds
        self.calls: list[int] = []  # draft calls per replica

    def propose(self, request_id: str, context_ids: Sequence[int], max_tokens: int, *, min_confidence: float = 0.0,
                expected: Sequence[int] = (), max_branches: int = 0) -> Draft:
        replica = self._replica_of(request_id)
        seq = self.cluster.seqs[request_id]
        alpha = self.cluster.alpha(seq, self.name)
        conf = self.cluster.s.acceptance.mean(self.name, seq.spec.domain)
        start = len(context_ids) - seq.spec.prompt_tokens  # output position the draft starts at
        ok = 0  # expected tokens that are the target's
        while ok < len(expected) and expected[ok] == seq.target_token(start + ok):
            ok += 1
        k = max_tokens if conf >= min_confidence else 0
        main = tuple(seq.guess(start + len(expected), k, alpha, aligned=ok == len(expected)))
        branches = []
        for j in range(min(ok + 1, len(expected))):  # where the pool's guess differs from `expected`
            if len(branches) >= max_branches or not k:
                break
            right = seq.rng.random() < alpha
            if j < ok and right or j == ok and not right:
                continue  # it agrees with the verified token (or misses the target's as `expected` does)
            tokens = (seq.target_token(start + j) if right else -1, *seq.guess(start + j + 1, k - 1, alpha, right))
            branches.append(DraftBranch(j, tokens, (conf,) * k))
        drafted = len(main) + sum(len(b.token_ids) for b in branches)
        self.cluster.executor.defer(self._work(request_id, replica, len(context_ids), drafted))
        return Draft(main, (conf,) * len(main), self.name, 0.0, len(expected), tuple(branches))

    def release(self, request_id: str) -> None:
        home = self.home.pop(request_id, None)
        self.seen.pop(request_id, None)
        if home is not None:
            self.held[str(home)] -= 1

    def _replica_of(self, rid: str) -> int:
        home = self.home.get(rid)
        if home is not None and home in self.active:
            return home
        if not self.active:
            raise RuntimeError(f"pool {self.name!r} has no replica to draft on")
        if home is not None:
            self.held[str(home)] -= 1
            self.seen[rid] = 0
            self.cluster.out.rehomes += 1
            self.cluster.out.rehomed_requests.add(rid)
        new = int(assign_replica(self.held, [str(i) for i in self.active]))  # type: ignore[arg-type]
        self.held[str(new)] = self.held.get(str(new), 0) + 1
        self.home[rid] = new
        return new

    def _work(self, rid: str, replica: int, ctx_len: int, drafted: int) -> simpy.events.ProcessGenerator:
        p, env = self.model, self.cluster.env
        unseen = ctx_len - self.seen.get(rid, 0)
        yield env.timeout(p.rtt_s / 2 + 4 * unseen / p.bandwidth_bytes_per_s)  # the context delta: token ids
        slots = self.slots[replica]
        yield slots.get(1)
        work_s = unseen * p.catch_up_token_s + drafted * p.draft_token_s
        yield env.timeout(work_s)
        yield slots.put(1)
        w = self.cluster.window  # the interval's, when the work ends
        w["pool_busy_s"][p.name] += work_s
        w["rounds"][p.name] += 1
        w["drafted"][p.name] += drafted
        self.calls.extend([0] * (replica + 1 - len(self.calls)))
        self.calls[replica] += 1
        if rid in self.home:
            self.seen[rid] = ctx_len
        yield env.timeout(p.rtt_s / 2 + drafted * DRAFT_BYTES_PER_TOKEN / p.bandwidth_bytes_per_s)


@dataclass
class SimResult:
    """Per-request latencies and cluster counters; `summary()` for the JSON."""

    latencies_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)  # per request: (latency - TTFT) / (output tokens - 1)
    tokens: int = 0
    makespan_s: float = 0.0
    verifier_busy_s: float = 0.0
    passes: int = 0
    steps_with_draft: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    spec_steps: int = 0
    drafts_late: int = 0
    rehomes: int = 0  # requests moved to another replica of a pool (theirs was removed)
    preemptions: int = 0  # pool replicas preempted (`Preemption`)
    rehomed_requests: set[str] = field(default_factory=set)  # requests that were re-homed at least once
    replica_calls: dict[str, list[int]] = field(default_factory=dict)  # pool -> draft calls per replica
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [drafts, draft tokens, accepted]
    replicas_timeline: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    scale_events: list[tuple[float, str, int, int]] = field(default_factory=list)
    conditions: list[tuple[float, str, str, str]] = field(default_factory=list)  # (t, pool, condition, reason)
    gpu_cost_usd: float = 0.0
    verifier_replicas: int = 1
    prompt_tokens: int = 0  # prompt tokens of the finished requests
    prefix_cached_tokens: int = 0  # ... of them found in the replica's prefix cache (not prefilled)

    def summary(self) -> dict[str, float | int]:
        lat, tpot = sorted(self.latencies_s), sorted(self.tpot_s)
        return {
            "requests": len(lat),
            "tokens": self.tokens,
            "throughput_tok_s": self.tokens / self.makespan_s if self.makespan_s else 0.0,
            "latency_p50_s": statistics.median(lat) if lat else 0.0,
            "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0,
            "ttft_p50_s": statistics.median(self.ttft_s) if self.ttft_s else 0.0,
            "tpot_p50_s": statistics.median(tpot) if tpot else 0.0,
            "tpot_p99_s": tpot[min(len(tpot) - 1, int(0.99 * len(tpot)))] if tpot else 0.0,
            "mean_accepted_per_step": self.accepted / self.spec_steps if self.spec_steps else 0.0,
            "draft_tokens": self.draft_tokens,
            "acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else 0.0,
            "steps_with_draft_fraction": self.steps_with_draft / self.passes if self.passes else 0.0,
            "verifier_step_s": self.verifier_busy_s / self.passes if self.passes else 0.0,
            "drafts_late": self.drafts_late,
            "rehomes": self.rehomes,
            "preemptions": self.preemptions,
            "rehomed_requests": len(self.rehomed_requests),
            "verifier_utilization": self.verifier_busy_s / (self.makespan_s * self.verifier_replicas)
            if self.makespan_s else 0.0,
            "scale_events": len(self.scale_events),
            "usd_per_million_tokens": self.gpu_cost_usd / self.tokens * 1e6 if self.tokens else 0.0,
            "prefix_cache_hit_fraction": self.prefix_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        }


class _Cluster:
    """The simulated processes; built and run by `simulate`."""

    def __init__(self, setup: SimSetup, workload: Workload, duration_s: float | None) -> None:
        if setup.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {setup.mode!r}")
        self.s, self.w, self.duration_s = setup, workload, duration_s
        self.env = simpy.Environment()
        self.rng = random.Random(setup.seed)
        self.out = SimResult(verifier_replicas=setup.verifier.replicas)
        if setup.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {setup.router!r}")
        replicas = setup.verifier.replicas
        self.waiting: list[_Sequence] = []  # vLLM's waiting queue, shared by the replicas (router `shared`)
        # else one waiting queue per replica, filled by the router
        self.queues: list[list[_Sequence]] = [[] for _ in range(replicas)] if setup.router != "shared" else []
        self.running: list[list[_Sequence]] = [[] for _ in range(replicas)]
        self.prefix_cache: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(replicas)]  # session -> tokens
        self.seen: list[set[int]] = [set() for _ in range(replicas)]  # sessions whose outputs a replica's tree holds
        self.last_replica: dict[int, int] = {}  # session -> the replica of its last turn
        self.suffix_hit_rate = [0.0] * replicas  # each replica's cosine_suffix_tree_hit_rate (EMA)
        self.route_rng = random.Random(f"{setup.seed}/router")
        self.seqs: dict[str, _Sequence] = {}  # request id -> the request, while it runs
        self.in_flight = 0
        self.idle_verifiers: list[simpy.Event] = []  # one wake-up event per idle verifier replica
        self.all_done = self.env.event()
        self.pools = {p.name: p for p in setup.pools}
        self.replicas = {p.name: p.replicas for p in setup.pools}
        self.pods_ready = dict(self.replicas)  # replicas whose pods have started
        self.executor = SimExecutor(self.env)
        self.sim_pools = {p.name: _SimPool(p, self) for p in setup.pools}
        self.proposers: list[CoSineProposer] = []  # one per verifier replica, as each serving replica has its own
        if setup.mode == "cosine":
            settings = ProposerSettings(speculation=setup.speculation, control=setup.control,
                                        routing=setup.routing_settings, lookup=setup.lookup is not None,
                                        pool=setup.pool_policy)
            expertise = {p.name: p.expertise for p in setup.pools}
            self.proposers = [
                CoSineProposer(settings, list(self.sim_pools.values()), expertise,
                               classify=lambda prompt: self.w.requests[prompt[0]].domain, clock=lambda: self.env.now,
                               seed=setup.seed + i, executor=self.executor,
                               sources=[LookupSource(_SimLookup(setup.lookup, self))] if setup.lookup else [])
                for i in range(setup.verifier.replicas)]
        self._counted = self._proposer_counts()  # the proposers' counters at the window's start
        self.window = self._new_window(list(self.pools))
        for p in setup.pools:
            self.out.replicas_timeline[p.name] = [(0.0, p.replicas)]

    # ------------------------------------------------------------------ requests
    def _start(self, i: int, spec: RequestSpec) -> _Sequence:
        seq = _Sequence(f"r{i}", spec, self.env.now, spec.prompt_tokens, [i] + [0] * (spec.prompt_tokens - 1),
                        random.Random(f"{self.s.seed}/{i}"), done=self.env.event())
        self.seqs[seq.rid] = seq
        self.in_flight += 1
        if self.queues:
            seq.replica = self._route(seq)
            self.queues[seq.replica].append(seq)
        else:
            self.waiting.append(seq)
        for wake in self.idle_verifiers:
            wake.succeed()
        self.idle_verifiers = []
        return seq

    def _route(self, seq: _Sequence) -> int:
        """The replica a request is sent to (`SimSetup.router`)."""
        n, session = len(self.queues), seq.spec.session
        if self.s.router == "random":
            return self.route_rng.randrange(n)
        if self.s.router == "session":
            if session not in self.last_replica:
                self.last_replica[session] = self.route_rng.randrange(n)
            return self.last_replica[session]
        waiting = [len(q) for q in self.queues]
        lo, hi = min(waiting), max(waiting)
        capacity = max(1, self.s.verifier.prefix_cache_tokens)
        scores = []
        for r in range(n):
            held = self.prefix_cache[r].get(session, 0) if session >= 0 else 0
            kv = sum(x.spec.prompt_tokens + x.emitted for x in self.running[r]) / capacity
            scores.append(endpoint_score(
                self.s.router_weights, min(held, seq.spec.history_tokens) / seq.spec.prompt_tokens,
                self.last_replica.get(session) == r, self.suffix_hit_rate[r],
                (hi - waiting[r]) / (hi - lo) if hi > lo else 1.0, max(0.0, 1.0 - kv)))
        best = max(scores)
        return self.route_rng.choice([r for r, x in enumerate(scores) if x == best])

    def seen_by(self, seq: _Sequence) -> bool:
        """Whether the request's replica served an earlier turn of its conversation."""
        return seq.spec.session >= 0 and seq.spec.session in self.seen[seq.replica]

    def observe_lookup(self, replica: int, hit: bool) -> None:
        """One lookup on a replica: its suffix hit-rate gauge (`lookup.SuffixLookup.hit_rate`'s EMA)."""
        alpha = 0.02
        self.suffix_hit_rate[replica] += alpha * (hit - self.suffix_hit_rate[replica])

    def _session_client(self, sessions: deque[list[tuple[int, RequestSpec]]]) -> simpy.events.ProcessGenerator:
        while sessions:
            for i, spec in sessions.popleft():
                seq = self._start(i, spec)
                assert seq.done is not None
                yield seq.done

    def _arrivals(self) -> simpy.events.ProcessGenerator:
        for i, spec in enumerate(self.w.requests):
            yield self.env.timeout(max(0.0, spec.arrival_s - self.env.now))
            self._start(i, spec)

    def _client(self, queue: deque[tuple[int, RequestSpec]]) -> simpy.events.ProcessGenerator:
        while queue:
            i, spec = queue.popleft()
            seq = self._start(i, spec)
            assert seq.done is not None
            yield seq.done

    def alpha(self, seq: _Sequence, source: str) -> float:
        """The request's per-token acceptance rate for a draft source (drawn once)."""
        if source not in seq.alphas:
            seq.alphas[source] = self.s.acceptance.sample(source, seq.spec.domain, seq.rng)
        return seq.alphas[source]

    # ------------------------------------------------------------------ verifier (vLLM's scheduler)
    def _schedule(self, running: list[_Sequence], replica: int) -> list[tuple[_Sequence, int]]:
        """One engine step: running requests first (pending token + draft, or the next prefill
        chunk), then waiting ones admitted while the token budget and `max_requests` allow."""
        v = self.s.verifier
        budget, step = v.max_batch_tokens, []
        for seq in running:
            n = min(seq.prefill_left if seq.prefill_left > 0 else 1 + len(seq.draft), budget)
            if n < 1:
                break
            if seq.prefill_left == 0:
                del seq.draft[n - 1:]  # a draft clipped to the budget left
            step.append((seq, n))
            budget -= n
        queue = self.queues[replica] if self.queues else self.waiting
        while queue and budget > 0 and len(running) < v.max_requests:
            seq = queue.pop(0)
            seq.replica = replica
            running.append(seq)
            self._use_prefix_cache(seq, replica)
            if self.proposers:  # as `vllm_hooks` does for a request it starts prefilling
                self.proposers[replica].prefetch(seq.rid, seq.tokens[: seq.spec.prompt_tokens])
            n = min(seq.prefill_left, budget)
            step.append((seq, n))
            budget -= n
        return step

    def _use_prefix_cache(self, seq: _Sequence, replica: int) -> None:
        """A request admitted on `replica` prefills only what the replica's prefix cache lacks of its
        conversation's history (vLLM's automatic prefix caching; at least its last token is computed)."""
        spec = seq.spec
        held = self.prefix_cache[replica].get(spec.session, 0) if spec.session >= 0 else 0
        cached = min(held, spec.history_tokens, spec.prompt_tokens - 1)
        if cached > 0:
            self.prefix_cache[replica].move_to_end(spec.session)
            seq.prefill_left -= cached
        self.out.prompt_tokens += spec.prompt_tokens
        self.out.prefix_cached_tokens += max(0, cached)

    def _verifier(self, replica: int) -> simpy.events.ProcessGenerator:
        s, v = self.s, self.s.verifier
        running = self.running[replica]
        proposer = self.proposers[replica] if self.proposers else None
        queue = self.queues[replica] if self.queues else self.waiting
        while True:
            if not running and not queue:
                wake = self.env.event()
                self.idle_verifiers.append(wake)
                yield wake
                continue
            step = self._schedule(running, replica)
            tokens = sum(n for _, n in step)
            kv = sum(seq.spec.prompt_tokens - seq.prefill_left + seq.emitted for seq, _ in step)
            pass_s = v.pass_s(tokens, kv)
            decodes = [seq for seq, _ in step if seq.prefill_left == 0]
            if s.mode in ("vanilla", EAGLE3) and decodes:  # the co-located drafter drafts before the step
                pass_s += max(len(seq.draft) for seq in decodes) * v.colocated_draft_s(len(decodes))
            yield self.env.timeout(pass_s)
            self.out.verifier_busy_s += pass_s
            self.window["busy_s"] += pass_s
            self.window["steps"] += 1
            self.out.passes += 1
            if any(seq.draft for seq in decodes):
                self.out.steps_with_draft += 1
            outcomes = [self._after_step(seq, n, running) for seq, n in step]
            if proposer is not None:
                proposer.observe_step(StepRecord(pass_s, tokens, tuple(o for o in outcomes if o is not None),
                                                 has_prefill=len(decodes) < len(step)))
            self._draft(running, proposer)

    def _after_step(self, seq: _Sequence, n: int, running: list[_Sequence]) -> RequestOutcome | None:
        """The target's side of a step for one request: a prefill chunk, or its draft verified
        (accepted prefix plus the target's own token)."""
        outcome = None
        if seq.prefill_left > 0:
            seq.prefill_left -= n
            if seq.prefill_left > 0:
                return None
            emitted = 1
            seq.first_token_s = self.env.now
        else:
            k = len(seq.draft)
            acc = seq.verify(seq.draft)
            emitted = 1 + acc
            if k:
                outcome = RequestOutcome(seq.rid, k, acc, seq.source)
                self.out.draft_tokens += k
                self.out.accepted += acc
                self.out.spec_steps += 1
                counts = self.out.by_source.setdefault(seq.source, [0, 0, 0])
                counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + k, counts[2] + acc
        emitted = min(emitted, seq.spec.output_tokens - seq.emitted)
        seq.tokens.extend(seq.target_token(seq.emitted + j) for j in range(emitted))
        seq.emitted += emitted
        self.out.tokens += emitted
        self.window["verified"] += emitted
        seq.draft, seq.source = [], ""
        if seq.emitted >= seq.spec.output_tokens:
            running.remove(seq)
            self._finish(seq)
        return outcome

    def _draft(self, running: list[_Sequence], proposer: CoSineProposer | None) -> None:
        """The next step's drafts: CoSine's proposer itself (cosine), or the co-located drafter's
        `max_draft_len` tokens for every request (vanilla: vLLM's draft-model speculation; eagle3:
        its draft head)."""
        decodes = [seq for seq in running if seq.prefill_left == 0]
        if proposer is not None and decodes:
            drafts = proposer.propose({seq.rid: seq.tokens for seq in decodes},
                                      {seq.rid: seq.spec.prompt_tokens for seq in decodes})
            for seq in decodes:
                seq.draft, seq.source = drafts[seq.rid], proposer.source_of(seq.rid)
        elif self.s.mode == EAGLE3 or self.s.mode == "vanilla" and self.pools:
            name = EAGLE3 if self.s.mode == EAGLE3 else next(iter(self.pools))
            for seq in decodes:
                seq.draft = seq.guess(seq.emitted, self.s.speculation.max_draft_len, self.alpha(seq, name))
                seq.source = name

    def _finish(self, seq: _Sequence) -> None:
        self.in_flight -= 1
        self.out.latencies_s.append(self.env.now - seq.arrival_s)
        self.out.ttft_s.append((seq.first_token_s or self.env.now) - seq.arrival_s)
        if seq.spec.output_tokens > 1 and seq.first_token_s is not None:
            self.out.tpot_s.append((self.env.now - seq.first_token_s) / (seq.spec.output_tokens - 1))
        self.out.makespan_s = self.env.now
        if self.proposers:
            self.proposers[seq.replica].release(seq.rid)
        session = seq.spec.session
        if session >= 0:  # the conversation's context stays in this replica's caches
            self.last_replica[session] = seq.replica
            self.seen[seq.replica].add(session)
            capacity = self.s.verifier.prefix_cache_tokens
            if capacity > 0:
                cache = self.prefix_cache[seq.replica]
                cache[session] = seq.spec.prompt_tokens + seq.emitted
                cache.move_to_end(session)
                while sum(cache.values()) > capacity and len(cache) > 1:
                    cache.popitem(last=False)  # least recently used
        del self.seqs[seq.rid]
        assert seq.done is not None
        seq.done.succeed()
        if len(self.out.latencies_s) == len(self.w.requests):
            self.all_done.succeed()

    # ------------------------------------------------------------------ autoscaler
    def _autoscaler(self) -> simpy.events.ProcessGenerator:
        """The one scaling loop (`cosine_spec.scaling_loop`) every `interval_s` of simulated
        time, observing the simulated counters as the operator reads the same series."""
        s = self.s
        assert s.scaling is not None

        def resize(d: autoscaling.ScaleDecision) -> None:
            self._scale(d.pool, d.current, d.desired)

        def report(_: autoscaling.Observations, decisions: Sequence[autoscaling.ScaleDecision]) -> None:
            self.out.conditions.extend((self.env.now, d.pool, d.condition, d.reason) for d in decisions if d.condition)

        loop = ScalingLoop(s.scaling, self._observe_interval, resize, report)
        while True:
            yield self.env.timeout(s.interval_s)
            loop.tick_now(self.env.now)
            self.window = self._new_window(list(self.pools))

    def _observe_interval(self) -> autoscaling.Observations:
        """The last interval's observations: the verifier's and the pools' counters of the window,
        and the proposers' series over it (what the operator reads through `metrics_scrape`)."""
        w, iv = self.window, self.s.interval_s
        now = self._proposer_counts()  # the proposers' series over the interval, as scraped
        c = {key: now[key] - self._counted.get(key, 0) for key in now}
        self._counted = now
        verifier = autoscaling.VerifierObservation(
            step_s=w["busy_s"] / w["steps"] if w["steps"] else None,
            tokens_verified_per_s=w["verified"] / iv,
            requests_running=float(self.in_flight - self._waiting_count()),
            requests_waiting=float(self._waiting_count()),
        )
        pools = tuple(
            autoscaling.PoolObservation(  # what the operator reads from the same series (metrics_scrape)
                name=n, replicas=self.replicas[n], ready_replicas=self.pods_ready[n],
                asks_per_s=c[("asks", n)] / iv, late_per_s=c[("late", n)] / iv,
                skipped_per_s={k: c[("skipped", n, k)] / iv for k in autoscaling.SKIP_REASONS},
                accepted_tokens_per_s=c[("accepted", n)] / iv,
                acceptance_rate=c[("accepted", n)] / w["drafted"][n] if w["drafted"][n] else None,
                draft_tokens_per_s=w["drafted"][n] / iv,
                # a call holds one of a replica's slots for its work: its calls in service at
                # once (mean occupied slots per replica) are what a batched round holds
                round_s=w["pool_busy_s"][n] / w["rounds"][n] if w["rounds"][n] else None,
                batch=(max(1.0, w["pool_busy_s"][n] / (iv * max(1, self.pods_ready[n]))) if w["rounds"][n]
                       else None),
                rtt_s=next((p.stats.pool_rtt_s[n] for p in self.proposers if n in p.stats.pool_rtt_s), None),
                yield_tokens=c[("accepted", n)] / c[("asks", n)] if c[("asks", n)] else None,
                # busy slot-seconds over the slots the pool had: its pods' busy fraction
                utilization=(min(1.0, w["pool_busy_s"][n] / (iv * self.pods_ready[n] * self.pools[n].slots))
                             if self.pods_ready[n] else None),
                drafter_samples=self.pods_ready[n] > 0,
            ) for n in self.pools)
        return autoscaling.Observations(verifier, pools)

    def _waiting_count(self) -> int:
        return len(self.waiting) + sum(len(q) for q in self.queues)

    @staticmethod
    def _new_window(pools: list[str]) -> dict:
        """The verifier's and the pools' own counters for one interval (the proposers' are
        `_proposer_counts`)."""
        return {"busy_s": 0.0, "steps": 0, "verified": 0, "drafted": dict.fromkeys(pools, 0),
                "pool_busy_s": dict.fromkeys(pools, 0.0), "rounds": dict.fromkeys(pools, 0)}

    def _proposer_counts(self) -> dict[tuple[str, ...], int]:
        """The proposers' counters the operator scrapes (`cosine.metrics`), summed over verifier
        replicas, per pool: asks (calls returned or failed), late drafts, asks skipped per reason,
        accepted draft tokens."""
        out: dict[tuple[str, ...], int] = {}
        for n in self.pools:
            st = [p.stats for p in self.proposers]
            out[("asks", n)] = sum(x.pool_calls.get(n, 0) + x.pool_errors.get(n, 0) for x in st)
            out[("late", n)] = sum(x.drafts_late.get(n, 0) for x in st)
            out[("accepted", n)] = sum(x.accepted_tokens.get(n, 0) for x in st)
            for k in autoscaling.SKIP_REASONS:
                out[("skipped", n, k)] = sum(x.pool_skipped.get((n, k), 0) for x in st)
        return out

    def _scale(self, name: str, current: int, desired: int) -> None:
        self.replicas[name] = desired
        self.out.scale_events.append((self.env.now, name, current, desired))
        self.out.replicas_timeline[name].append((self.env.now, desired))
        if desired > current:
            self.env.process(self._add_replicas(name, desired - current))
        else:  # the newest replicas leave; their requests are re-homed at their next call
            for _ in range(current - desired):
                if self.sim_pools[name].active:
                    self.sim_pools[name].active.pop()
                    self.pods_ready[name] -= 1

    def _preemptions(self, name: str, pre: Preemption) -> simpy.events.ProcessGenerator:
        """Spot preemptions of one pool's replicas (`Preemption`): a Poisson process at the
        per-replica rate times the replicas ready, each one drained at its notice and replaced."""
        rng = random.Random(f"{self.s.seed}/preempt/{name}")
        pool = self.sim_pools[name]
        while True:
            yield self.env.timeout(rng.expovariate(pre.per_replica_hour / 3600 * max(1, self.pods_ready[name])))
            if not pool.active:
                continue
            pool.active.remove(rng.choice(pool.active))  # drained: its requests re-home at their next call
            self.pods_ready[name] -= 1
            self.out.preemptions += 1
            self.out.replicas_timeline[name].append((self.env.now, self.pods_ready[name]))  # charged: ready pods
            # the Deployment keeps its replicas: its controller asks for the replacement at once
            self.env.process(self._add_replicas(name, 1, pre.replacement_s, timeline=True))

    def _add_replicas(self, name: str, count: int, delay_s: float | None = None,
                      timeline: bool = False) -> simpy.events.ProcessGenerator:
        yield self.env.timeout(self.s.pod_start_s if delay_s is None else delay_s)  # a new pod pulls, loads, is ready
        p, pool = self.pools[name], self.sim_pools[name]
        for _ in range(count):  # once ready, the proposer's next re-resolve finds it
            pool.slots.append(simpy.Container(self.env, capacity=p.slots, init=p.slots))
            pool.active.append(len(pool.slots) - 1)
            self.pods_ready[name] += 1
        if timeline:  # a replacement is charged from when it is ready
            self.out.replicas_timeline[name].append((self.env.now, self.pods_ready[name]))

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        if self.w.concurrency and self.w.sessions:
            by_session: dict[int, list[tuple[int, RequestSpec]]] = {}
            for i, spec in enumerate(self.w.requests):
                by_session.setdefault(spec.session, []).append((i, spec))
            sessions = deque(by_session.values())
            for _ in range(self.w.concurrency):
                self.env.process(self._session_client(sessions))
        elif self.w.concurrency:
            queue = deque(enumerate(self.w.requests))
            for _ in range(self.w.concurrency):
                self.env.process(self._client(queue))
        else:
            self.env.process(self._arrivals())
        for i in range(self.s.verifier.replicas):
            self.env.process(self._verifier(i))
        if self.s.scaling is not None and self.pools:
            self.env.process(self._autoscaler())
        if self.s.preemption is not None:
            for name in self.pools:
                self.env.process(self._preemptions(name, self.s.preemption))
        self.env.run(until=self.duration_s if self.duration_s else self.all_done)
        end = self.env.now if self.duration_s else self.out.makespan_s
        if self.duration_s:
            self.out.makespan_s = end
        self._cost(end)
        for name, tl in self.out.replicas_timeline.items():
            tl.append((end, self.replicas[name]))  # the timeline runs to the end of the run
        self.out.drafts_late = sum(sum(p.stats.drafts_late.values()) for p in self.proposers)
        self.out.replica_calls = {n: list(pool.calls) for n, pool in self.sim_pools.items() if pool.calls}
        return self.out

    def _cost(self, end_s: float) -> None:
        """GPU-hours at list price: the verifier for the whole run, each pool by its replica timeline
        (pools only where they run: `cosine`; `vanilla`'s drafter shares the verifier's GPUs)."""
        usd = self.s.verifier.price_per_hour_usd * self.s.verifier.replicas * end_s / 3600
        for name, tl in self.out.replicas_timeline.items() if self.s.mode == "cosine" else ():
            price = self.pools[name].price_per_hour_usd
            for (t0, n), (t1, _) in zip(tl, [*tl[1:], (end_s, 0)], strict=True):
                usd += price * n * max(0.0, min(t1, end_s) - t0) / 3600
        self.out.gpu_cost_usd = usd


def simulate(setup: SimSetup, workload: Workload, duration_s: float | None = None) -> SimResult:
    """Run one simulation: until every request completes, or for `duration_s` simulated seconds."""
    return _Cluster(setup, workload, duration_s).run()


def poisson_requests(rate_per_s: float, duration_s: float, prompt_tokens: int, output_tokens: int,
                     domains: tuple[str, ...], seed: int = 0) -> tuple[RequestSpec, ...]:
    """Poisson arrivals at `rate_per_s` for `duration_s`, domains drawn uniformly."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return tuple(out)
        out.append(RequestSpec(t, prompt_tokens, output_tokens, rng.choice(domains)))
