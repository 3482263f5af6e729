"""A discrete-event simulation of one CoSineCluster (SimPy processes; no event loop of our own).

What serves, modelled step by step:
- each verifier replica is vLLM's scheduler: every engine step has a token budget
  (`max_batch_tokens`, vLLM's `max_num_batched_tokens`); running requests go first, each with its
  pending token plus its draft tokens (a draft clipped to what is left of the budget), a request
  still prefilling with the next chunk of its prompt (chunked prefill), then waiting requests are
  admitted first come, first served, up to `max_requests`, their prompts chunked into what is left.
  The step takes `pass_s(tokens in the step)`;
- after each step CoSine's proposer drafts for every running decode request from what is available
  *now*: prompt lookup (found on a share of steps, `LookupModel`) and any pool draft that has
  arrived and still continues the context (`PoolModel.use_prob`); the chain's length k comes from
  the product's `speculation_control.next_draft_len` on the pass curve (`BatchedCost`, per request
  and per source, probes included). Every decision about pools is the serving path's own
  `pool_policy.PoolPolicy`: whether to ask a pool (where it pays, or on probe steps), how many
  tokens and branches (sized to the verifier's step from the pool's learnt speed), the on-time
  and lookup-hit estimates, routing with fusion. A pool's draft, made while the verifier
  computes, serves a later step: the verifier never waits for a pool;
- a pool is replicas, each a SimPy container of `slots` behind a network (RTT, bandwidth); a
  request is assigned to one replica for its lifetime by `pool_policy.assign_replica`, as the
  proposer's `ReplicaPool` does (a replica added takes new requests; a request whose replica was
  removed is re-homed and sends its whole context again); `routing.route` picks pools, the
  operator's `autoscaling.desired_replicas` scales them every `interval_s`.

Modes: `target-only` (vLLM, no speculation); `cosine` (the proposer: prompt lookup if the setup
has a `LookupModel`, and the pools); `vanilla` (a drafter co-located on the verifier drafts k
tokens for every request before each step: vLLM's draft-model speculation).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import simpy

from cosine import routing, speculation_control
from cosine.pool_policy import PoolPolicy, assign_replica
from cosine.simulation.cost_models import AcceptanceModel, accepted_tokens
from cosine_operator import autoscaling
from cosine_operator.settings import SpeculationSpec

MODES = ("target-only", "vanilla", "cosine")
LOOKUP = "lookup"  # prompt lookup's source name (its acceptance key in `AcceptanceModel`)
DRAFT_BYTES_PER_TOKEN = 8  # a draft token on the wire: its id and its confidence (no distribution)


@dataclass(frozen=True)
class PoolModel:
    """A drafter pool: `slots` requests drafted at once per replica, `draft_token_s` per token per
    request at that load, `catch_up_token_s` per unseen context token; the link to the verifier.
    How many tokens a call drafts is the proposer's `PoolPolicy.ask`. use_prob: share of drafts
    back in time that the verifier can use (the draft still continues the context when it is
    looked at; 0.5 measured on this machine's 2-core run)."""

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
    use_prob: float = 0.5


@dataclass(frozen=True)
class LookupModel:
    """Prompt lookup: on a decode step it finds a draft with probability `hit_rate`, of up to
    `draft_tokens` tokens (acceptance: the `lookup` key of the `AcceptanceModel`)."""

    hit_rate: float
    draft_tokens: int


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


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    domain: str


@dataclass(frozen=True)
class Workload:
    """`requests` in arrival order; with `concurrency` set, a closed loop (arrival times ignored):
    `concurrency` clients, each sending the next request when its last one completes."""

    requests: tuple[RequestSpec, ...]
    concurrency: int | None = None


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


@dataclass
class _Req:
    rid: str
    spec: RequestSpec
    arrival_s: float
    prefill_left: int
    emitted: int = 0
    draft_len: int = 0
    source: str = ""
    steps: int = 0
    pools: tuple[str, ...] = ()
    first_token_s: float | None = None
    states: dict[str, speculation_control.SpeculationState] = field(default_factory=dict)
    alphas: dict[str, float] = field(default_factory=dict)
    seen_tokens: dict[str, int] = field(default_factory=dict)
    replica: dict[str, int] = field(default_factory=dict)  # pool -> the replica holding its context
    inflight: set[str] = field(default_factory=set)  # pools drafting for it now
    arrived: set[str] = field(default_factory=set)  # pools whose draft has arrived, not looked at yet
    lookup_hit: float = 0.5  # EMA of steps on which prompt lookup found a draft (as the proposer keeps it)
    done: simpy.Event | None = None


@dataclass
class SimResult:
    """Per-request latencies and cluster counters; `summary()` for the JSON."""

    latencies_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
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
    replica_calls: dict[str, list[int]] = field(default_factory=dict)  # pool -> draft calls per replica
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [drafts, draft tokens, accepted]
    replicas_timeline: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    scale_events: list[tuple[float, str, int, int]] = field(default_factory=list)
    conditions: list[tuple[float, str, str, str]] = field(default_factory=list)  # (t, pool, condition, reason)
    gpu_cost_usd: float = 0.0
    verifier_replicas: int = 1

    def summary(self) -> dict[str, float | int]:
        lat = sorted(self.latencies_s)
        return {
            "requests": len(lat),
            "tokens": self.tokens,
            "throughput_tok_s": self.tokens / self.makespan_s if self.makespan_s else 0.0,
            "latency_p50_s": statistics.median(lat) if lat else 0.0,
            "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0,
            "ttft_p50_s": statistics.median(self.ttft_s) if self.ttft_s else 0.0,
            "mean_accepted_per_step": self.accepted / self.spec_steps if self.spec_steps else 0.0,
            "draft_tokens": self.draft_tokens,
            "acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else 0.0,
            "steps_with_draft_fraction": self.steps_with_draft / self.passes if self.passes else 0.0,
            "verifier_step_s": self.verifier_busy_s / self.passes if self.passes else 0.0,
            "drafts_late": self.drafts_late,
            "rehomes": self.rehomes,
            "verifier_utilization": self.verifier_busy_s / (self.makespan_s * self.verifier_replicas)
            if self.makespan_s else 0.0,
            "scale_events": len(self.scale_events),
            "usd_per_million_tokens": self.gpu_cost_usd / self.tokens * 1e6 if self.tokens else 0.0,
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
        self.waiting: list[_Req] = []  # vLLM's waiting queue, shared by the replicas
        self.running: list[list[_Req]] = [[] for _ in range(setup.verifier.replicas)]
        self.in_flight = 0
        self.idle_verifiers: list[simpy.Event] = []  # one wake-up event per idle verifier replica
        self.all_done = self.env.event()
        self.router = routing.RouterState()
        self.profiles = [routing.DrafterProfile(p.name, p.expertise) for p in setup.pools]
        self.pools = {p.name: p for p in setup.pools}
        self.replicas = {p.name: p.replicas for p in setup.pools}
        self.pods_ready = dict(self.replicas)  # replicas whose pods have started
        # per pool, its replicas' slots (index = replica number) and the replicas taking requests
        self.slots = {p.name: [simpy.Container(self.env, capacity=p.slots, init=p.slots) for _ in range(p.replicas)]
                      for p in setup.pools}
        self.active = {p.name: list(range(p.replicas)) for p in setup.pools}
        self.held = {p.name: dict[str, int]() for p in setup.pools}  # replica -> requests assigned to it
        self.on_time = dict.fromkeys(self.pools, 1.0)  # the proposer's per-pool on-time EMA
        self.rtt_s: dict[str, float] = {}  # the proposer's per-pool EMA of a call's round trip
        self.token_s: dict[str, float] = {}  # ... and of its seconds per draft token
        # The pass curve the k policy prices drafts on: the verifier's (the runtime measures it).
        ref_kv = int(statistics.mean(r.prompt_tokens + r.output_tokens // 2 for r in workload.requests))
        self.curve = speculation_control.PassCurve(tuple(
            (n, setup.verifier.pass_s(n, ref_kv)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)))
        self.window = self._new_window(list(self.pools))
        self.scaler = autoscaling.ScalerState()
        for p in setup.pools:
            self.out.replicas_timeline[p.name] = [(0.0, p.replicas)]

    # ------------------------------------------------------------------ requests
    def _start(self, i: int, spec: RequestSpec) -> _Req:
        r = _Req(f"r{i}", spec, self.env.now, spec.prompt_tokens, done=self.env.event())
        if self.s.mode == "cosine" and self.pools:
            # as the proposer routes (`CoSineProposer._route`): the first `max_drafters` pools up,
            # plus those the router preferred that are down (asked never; skipped as "down": demand)
            rs = PoolPolicy.routing_settings(self.s.routing_settings, len(self.pools), self.s.speculation.fusion)
            ranked = routing.route(spec.domain, self.profiles, self.router, replace(rs, max_drafters=len(self.pools)),
                                   self.rng.betavariate)
            up = [n for n in ranked if self.active[n]][: rs.max_drafters]
            r.pools = (*up, *(n for n in ranked[: rs.max_drafters] if n not in up))
        self.in_flight += 1
        self.waiting.append(r)
        for wake in self.idle_verifiers:
            wake.succeed()
        self.idle_verifiers = []
        return r

    def _arrivals(self) -> simpy.events.ProcessGenerator:
        for i, spec in enumerate(self.w.requests):
            yield self.env.timeout(max(0.0, spec.arrival_s - self.env.now))
            self._start(i, spec)

    def _client(self, queue: list[tuple[int, RequestSpec]]) -> simpy.events.ProcessGenerator:
        while queue:
            i, spec = queue.pop(0)
            r = self._start(i, spec)
            assert r.done is not None
            yield r.done

    # ------------------------------------------------------------------ verifier (vLLM's scheduler)
    def _schedule(self, running: list[_Req]) -> list[tuple[_Req, int]]:
        """One engine step: running requests first (pending token + draft, or the next prefill
        chunk), then waiting ones admitted while the token budget and `max_requests` allow."""
        v = self.s.verifier
        budget, step = v.max_batch_tokens, []
        for r in running:
            n = min(r.prefill_left if r.prefill_left > 0 else 1 + r.draft_len, budget)
            if n < 1:
                break
            step.append((r, n))
            budget -= n
        while self.waiting and budget > 0 and len(running) < v.max_requests:
            r = self.waiting.pop(0)
            running.append(r)
            n = min(r.prefill_left, budget)
            step.append((r, n))
            budget -= n
        return step

    def _verifier(self, replica: int) -> simpy.events.ProcessGenerator:
        s, v = self.s, self.s.verifier
        running = self.running[replica]
        while True:
            if not running and not self.waiting:
                wake = self.env.event()
                self.idle_verifiers.append(wake)
                yield wake
                continue
            step = self._schedule(running)
            tokens = sum(n for _, n in step)
            kv = sum(r.spec.prompt_tokens - r.prefill_left + r.emitted for r, _ in step)
            pass_s = v.pass_s(tokens, kv)
            decodes = [(r, n) for r, n in step if r.prefill_left == 0]
            if s.mode == "vanilla" and decodes:  # the co-located drafter drafts before the step
                pass_s += max(r.draft_len for r, _ in decodes) * v.colocated_draft_s(len(decodes))
            yield self.env.timeout(pass_s)
            self.out.verifier_busy_s += pass_s
            self.window["busy_s"] += pass_s
            self.window["steps"] += 1
            self.out.passes += 1
            if any(n > 1 for _, n in decodes):
                self.out.steps_with_draft += 1
            for r, n in step:
                self._after_step(r, n, running)
            contexts = [r for r in running if r.prefill_left == 0]
            drafted = 0
            for r in contexts:  # the proposer, for the next step
                self._propose(r, other_tokens=len(contexts) - 1 + drafted, num_requests=len(contexts))
                drafted += r.draft_len

    def _alpha(self, r: _Req, source: str) -> float:
        if source not in r.alphas:
            r.alphas[source] = self.s.acceptance.sample(source, r.spec.domain, self.rng)
        return r.alphas[source]

    def _state(self, r: _Req, source: str) -> speculation_control.SpeculationState:
        """The request's acceptance estimate for a source; it starts at the source's mean on the
        domain (what the runtime's router has learned from earlier requests)."""
        if source not in r.states:
            r.states[source] = speculation_control.initial_state(
                self.s.control, self.s.acceptance.mean(source, r.spec.domain))
        return r.states[source]

    def _after_step(self, r: _Req, n: int, running: list[_Req]) -> None:
        s = self.s
        if r.prefill_left > 0:
            r.prefill_left -= n
            if r.prefill_left > 0:
                return
            emitted = 1
            r.first_token_s = self.env.now
        else:
            k = n - 1
            emitted = 1
            if k > 0:
                acc = accepted_tokens(self._alpha(r, r.source), k, self.rng)
                emitted += acc
                self.out.draft_tokens += k
                self.out.accepted += acc
                self.out.spec_steps += 1
                counts = self.out.by_source.setdefault(r.source, [0, 0, 0])
                counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + k, counts[2] + acc
                r.states[r.source] = speculation_control.observe(self._state(r, r.source), s.control, k, acc)
                if r.source in self.pools:
                    self.router = routing.observe(self.router, r.source, r.spec.domain, k, acc,
                                                  self._alpha(r, r.source), s.routing_settings)
                    self.window["accepted"][r.source] += acc
        emitted = min(emitted, r.spec.output_tokens - r.emitted)
        r.emitted += emitted
        self.out.tokens += emitted
        self.window["verified"] += emitted
        r.draft_len, r.source = 0, ""
        if r.emitted >= r.spec.output_tokens:
            running.remove(r)
            self._finish(r)

    def _finish(self, r: _Req) -> None:
        self.in_flight -= 1
        self.out.latencies_s.append(self.env.now - r.arrival_s)
        self.out.ttft_s.append((r.first_token_s or self.env.now) - r.arrival_s)
        self.out.makespan_s = self.env.now
        self._release(r)
        assert r.done is not None
        r.done.succeed()
        if len(self.out.latencies_s) == len(self.w.requests):
            self.all_done.succeed()

    # ------------------------------------------------------------------ drafting (CoSine's proposer)
    def _propose(self, r: _Req, other_tokens: int, num_requests: int) -> None:
        """The next step's draft for `r` from what is available now, k from goodput; then ask the
        pools that pay for the request (their drafts serve a later step)."""
        s = self.s
        r.draft_len, r.source = 0, ""
        left = r.spec.output_tokens - r.emitted - 1
        if s.mode == "target-only" or left <= 0:
            return
        candidates: dict[str, int] = {}  # source -> tokens it offers
        if s.mode == "vanilla" and self.pools:
            candidates[next(iter(self.pools))] = s.speculation.max_draft_len
        if s.mode == "cosine" and s.lookup is not None:
            hit = self.rng.random() < s.lookup.hit_rate
            r.lookup_hit = PoolPolicy.lookup_hit(r.lookup_hit, hit)
            if hit:
                candidates[LOOKUP] = s.lookup.draft_tokens
        for name in r.pools:
            if name in r.arrived:
                r.arrived.discard(name)
                usable = self.rng.random() < self.pools[name].use_prob
                self.on_time[name] = PoolPolicy.on_time(self.on_time[name], usable)
                if usable:
                    candidates[name] = s.speculation.max_draft_len
            elif name in r.inflight:
                self.out.drafts_late += 1
                self.window["late"][name] += 1
                self.on_time[name] = PoolPolicy.on_time(self.on_time[name], False)
        r.steps += 1
        if candidates:  # fusion by confidence, reduced to its leader: the source trusted most
            source = max(candidates, key=lambda c: self._state(r, c).acceptance_rate)
            draft_s = self.pools[source].draft_token_s if s.mode == "vanilla" else 0.0
            cost = speculation_control.BatchedCost(draft_s, self.curve, max(0, other_tokens), max(1, num_requests))
            state, k = speculation_control.next_draft_len(self._state(r, source), s.speculation, s.control, cost)
            r.states[source] = state
            r.draft_len, r.source = min(k, candidates[source], left), source
        if s.mode == "cosine":
            for name in r.pools:
                if name in r.inflight:
                    continue
                skip = self._skip_reason(r, name)
                if skip:
                    self.window["skipped"][name][skip] += 1
                    continue
                r.inflight.add(name)
                self.window["asks"][name] += 1
                self.env.process(self._draft_on_pool(r, self.pools[name], verifying=r.draft_len > 0))

    def _skip_reason(self, r: _Req, name: str) -> str | None:
        """Why the pool is not asked for the request now (`None`: it is): "down" with no replica
        ready, else the proposer's rule (`PoolPolicy.skip_reason`) on the request's estimates."""
        if not self.active[name]:
            return "down"
        s = self.s
        lookup_alpha = self._state(r, LOOKUP).acceptance_rate if s.lookup else 0.0
        return s.pool_policy.skip_reason(r.steps, self._state(r, name).acceptance_rate, self.on_time[name],
                                          lookup_alpha, r.lookup_hit if s.lookup else 0.0,
                                          s.speculation.max_draft_len)

    def _replica_of(self, r: _Req, name: str) -> int:
        """The request's replica of the pool; a new request, or one whose replica was removed, is
        assigned one by `assign_replica` (a re-homed one has sent nothing to its new replica)."""
        home = r.replica.get(name)
        if home is not None and home in self.active[name]:
            return home
        held = self.held[name]
        if home is not None:
            held[str(home)] -= 1
            r.seen_tokens[name] = 0
            self.out.rehomes += 1
        new = int(assign_replica(held, [str(i) for i in self.active[name]]))  # type: ignore[arg-type]
        held[str(new)] = held.get(str(new), 0) + 1
        r.replica[name] = new
        return new

    def _release(self, r: _Req) -> None:
        for name, home in r.replica.items():
            self.held[name][str(home)] -= 1

    def _draft_on_pool(self, r: _Req, p: PoolModel, verifying: bool) -> simpy.events.ProcessGenerator:
        s, t0 = self.s, self.env.now
        replica = self._replica_of(r, p.name)
        ctx = r.spec.prompt_tokens + r.emitted
        unseen = ctx - r.seen_tokens.get(p.name, 0)
        k, branches = s.pool_policy.ask(self.curve.seconds(1), self.token_s.get(p.name),
                                        self.rtt_s.get(p.name, 0.0), s.speculation.max_draft_len, verifying)
        drafted = k * (1 + branches)
        yield self.env.timeout(p.rtt_s / 2 + 4 * unseen / p.bandwidth_bytes_per_s)  # context delta: token ids
        slots = self.slots[p.name][replica]
        yield slots.get(1)
        work_s = unseen * p.catch_up_token_s + drafted * p.draft_token_s
        yield self.env.timeout(work_s)
        yield slots.put(1)
        self.window["pool_busy_s"][p.name] += work_s
        self.window["rounds"][p.name] += 1
        self.window["drafted"][p.name] += drafted
        calls = self.out.replica_calls.setdefault(p.name, [])
        calls.extend([0] * (replica + 1 - len(calls)))
        calls[replica] += 1
        r.seen_tokens[p.name] = ctx
        yield self.env.timeout(p.rtt_s / 2 + drafted * DRAFT_BYTES_PER_TOKEN / p.bandwidth_bytes_per_s)
        self.rtt_s[p.name], self.token_s[p.name] = PoolPolicy.learn_speed(
            self.rtt_s.get(p.name), self.token_s.get(p.name), self.env.now - t0, drafted)
        r.inflight.discard(p.name)
        r.arrived.add(p.name)

    # ------------------------------------------------------------------ autoscaler
    def _autoscaler(self) -> simpy.events.ProcessGenerator:
        s = self.s
        assert s.scaling is not None
        while True:
            yield self.env.timeout(s.interval_s)
            w, iv = self.window, s.interval_s
            verifier = autoscaling.VerifierObservation(
                step_s=w["busy_s"] / w["steps"] if w["steps"] else None,
                tokens_verified_per_s=w["verified"] / iv,
                requests_running=float(self.in_flight - len(self.waiting)),
                requests_waiting=float(len(self.waiting)),
            )
            pools = tuple(
                autoscaling.PoolObservation(  # what the operator reads from the same series (metrics_scrape)
                    name=n, replicas=self.replicas[n], ready_replicas=self.pods_ready[n],
                    asks_per_s=w["asks"][n] / iv, late_per_s=w["late"][n] / iv,
                    skipped_per_s={k: v / iv for k, v in w["skipped"][n].items()},
                    accepted_tokens_per_s=w["accepted"][n] / iv,
                    acceptance_rate=w["accepted"][n] / w["drafted"][n] if w["drafted"][n] else None,
                    draft_tokens_per_s=w["drafted"][n] / iv,
                    # a call holds one of a replica's slots for its work: its calls in service at
                    # once (mean occupied slots per replica) are what a batched round holds
                    round_s=w["pool_busy_s"][n] / w["rounds"][n] if w["rounds"][n] else None,
                    batch=(max(1.0, w["pool_busy_s"][n] / (iv * max(1, self.pods_ready[n]))) if w["rounds"][n]
                           else None),
                    rtt_s=self.rtt_s.get(n),
                    yield_tokens=w["accepted"][n] / w["asks"][n] if w["asks"][n] else None,
                    # busy slot-seconds over the slots the pool had: its pods' busy fraction
                    utilization=(min(1.0, w["pool_busy_s"][n] / (iv * self.pods_ready[n] * self.pools[n].slots))
                                 if self.pods_ready[n] else None),
                    drafter_samples=self.pods_ready[n] > 0,
                ) for n in self.pools)
            decisions, self.scaler = autoscaling.desired_replicas(
                autoscaling.Observations(verifier, pools), s.scaling, self.scaler, self.env.now)
            for d in decisions:
                if d.changed:
                    self._scale(d.pool, d.current, d.desired)
                if d.condition:
                    self.out.conditions.append((self.env.now, d.pool, d.condition, d.reason))
            self.window = self._new_window(list(self.pools))

    @staticmethod
    def _new_window(pools: list[str]) -> dict:
        """The autoscaler's counters for one interval."""
        return {"busy_s": 0.0, "steps": 0, "verified": 0, "drafted": dict.fromkeys(pools, 0),
                "accepted": dict.fromkeys(pools, 0), "pool_busy_s": dict.fromkeys(pools, 0.0),
                "rounds": dict.fromkeys(pools, 0), "asks": dict.fromkeys(pools, 0), "late": dict.fromkeys(pools, 0),
                "skipped": {p: dict.fromkeys(autoscaling.SKIP_REASONS, 0) for p in pools}}

    def _scale(self, name: str, current: int, desired: int) -> None:
        self.replicas[name] = desired
        self.out.scale_events.append((self.env.now, name, current, desired))
        self.out.replicas_timeline[name].append((self.env.now, desired))
        if desired > current:
            self.env.process(self._add_replicas(name, desired - current))
        else:  # the newest replicas leave; their requests are re-homed at their next call
            for _ in range(current - desired):
                if self.active[name]:
                    self.active[name].pop()
                    self.pods_ready[name] -= 1

    def _add_replicas(self, name: str, count: int) -> simpy.events.ProcessGenerator:
        yield self.env.timeout(self.s.pod_start_s)  # a new pod pulls, loads and becomes ready
        p = self.pools[name]
        for _ in range(count):  # once ready, the proposer's next re-resolve finds it
            self.slots[name].append(simpy.Container(self.env, capacity=p.slots, init=p.slots))
            self.active[name].append(len(self.slots[name]) - 1)
            self.pods_ready[name] += 1

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        if self.w.concurrency:
            queue = list(enumerate(self.w.requests))
            for _ in range(self.w.concurrency):
                self.env.process(self._client(queue))
        else:
            self.env.process(self._arrivals())
        for i in range(self.s.verifier.replicas):
            self.env.process(self._verifier(i))
        if self.s.scaling is not None and self.pools:
            self.env.process(self._autoscaler())
        self.env.run(until=self.duration_s if self.duration_s else self.all_done)
        end = self.env.now if self.duration_s else self.out.makespan_s
        if self.duration_s:
            self.out.makespan_s = end
        self._cost(end)
        for name, tl in self.out.replicas_timeline.items():
            tl.append((end, self.replicas[name]))  # the timeline runs to the end of the run
        return self.out

    def _cost(self, end_s: float) -> None:
        """GPU-hours at list price: the verifier for the whole run, each pool by its replica timeline."""
        usd = self.s.verifier.price_per_hour_usd * self.s.verifier.replicas * end_s / 3600
        for name, tl in self.out.replicas_timeline.items():
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
