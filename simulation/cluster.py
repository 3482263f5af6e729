"""A discrete-event simulation of one CoSineCluster (SimPy processes; no event loop of our own).

Processes: request arrivals (Poisson, closed loop or a trace), one process per verifier replica
(continuous batching), drafter pools as SimPy containers of replica slots with a network in front
(RTT, bandwidth, draft bytes), and the autoscaler acting every `interval_s`.

The decisions are pure policies: `batching.plan_batch` (the simulated verifier's scheduler) picks
each pass; the product's own `speculation_control.next_draft_len` / `adjust_for_load` / `observe`
set k, `routing.route` / `observe` pick pools, and `operator.autoscaling.desired_replicas` scales
the pools, called as the runtime and operator call them. The simulator only supplies time: pass
and draft durations from `cost_models`, acceptance draws from its distributions.

Modes (the systems of the paper's evaluation, arXiv:2503.10325 §6):
- `target-only`: continuous batching, no speculation (vLLM).
- `vanilla`: one drafter co-located on the verifier's GPUs; each cycle drafts k tokens for the
  batch, then verifies (no overlap).
- `specinfer`: several co-located drafters, their drafts merged into a tree verified in one pass
  (n * k tokens per request; accepted = the longest accepted branch).
- `cosine`: remote pools, routing, fusion of `max_drafters` drafts (accepted = the best candidate,
  an upper bound on per-position confidence fusion), pipelined: pools draft some requests while the
  verifier verifies others; a request waits only for its own draft.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import simpy

from cosine.operator import autoscaling
from cosine.runtime import routing, speculation_control
from cosine.simulation import batching
from cosine.simulation.cost_models import AcceptanceModel, accepted_tokens

MODES = ("target-only", "vanilla", "specinfer", "cosine")
DRAFT_BYTES_PER_TOKEN = 8  # a draft token on the wire: its id and its confidence (no distribution)


@dataclass(frozen=True)
class PoolModel:
    """A drafter pool: `slots` requests drafted at once per replica, `draft_token_s` per token per
    request at that load, `catch_up_token_s` per unseen context token; the link to the verifier."""

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
class VerifierModel:
    """pass_s(tokens, kv_tokens) -> seconds; `colocated_draft_s(batch)`: one draft step of a
    co-located drafter for a batch (vanilla/specinfer modes)."""

    pass_s: Callable[[int, int], float]
    replicas: int = 1
    max_batch_tokens: int = 2048
    max_requests: int = 256
    max_kv_tokens: int = 1 << 22
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
    mode: str
    verifier: VerifierModel
    pools: tuple[PoolModel, ...]
    acceptance: AcceptanceModel
    speculation: speculation_control.SpeculationSettings
    routing_settings: routing.RoutingSettings = routing.RoutingSettings()
    batch_settings: batching.BatchSettings = batching.BatchSettings()
    scaling: autoscaling.ScalingPolicy | None = None
    interval_s: float = 30.0
    pod_start_s: float = 30.0
    num_colocated_drafters: int = 1
    seed: int = 0


@dataclass
class _Req:
    rid: str
    spec: RequestSpec
    state: speculation_control.SpeculationState
    arrival_s: float
    prefill_left: int
    emitted: int = 0
    draft_len: int = 0
    drafters: tuple[str, ...] = ()
    ready_since_s: float = 0.0
    first_token_s: float | None = None
    alphas: dict[str, float] = field(default_factory=dict)
    seen_tokens: dict[str, int] = field(default_factory=dict)
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
    draft_tokens: int = 0
    accepted: int = 0
    spec_steps: int = 0
    replicas_timeline: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    scale_events: list[tuple[float, str, int, int]] = field(default_factory=list)
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
        self.ready: list[_Req] = []
        self.in_flight = 0
        self.idle_verifiers: list[simpy.Event] = []  # one wake-up event per idle verifier replica
        self.all_done = self.env.event()
        self.router = routing.RouterState()
        self.profiles = [routing.DrafterProfile(p.name, p.expertise) for p in setup.pools]
        self.pools = {p.name: p for p in setup.pools}
        self.replicas = {p.name: p.replicas for p in setup.pools}
        self.pods_ready = dict(self.replicas)  # replicas whose pods have started
        self.slots = {p.name: simpy.Container(self.env, capacity=max(1, p.max_replicas * p.slots),
                                              init=p.replicas * p.slots) for p in setup.pools}
        self.load = speculation_control.initial_load_state(setup.speculation)
        ref_kv = int(statistics.mean(r.prompt_tokens + r.output_tokens // 2 for r in workload.requests))
        # The pass curve the k policy sees: the verifier's, at a typical context (the runtime learns it).
        self.curve = speculation_control.PassCurve(tuple(
            (n, setup.verifier.pass_s(n, ref_kv)) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)))
        self.last_batch = (0, 1)  # (tokens, requests) of the last pass
        self.window = self._new_window([p.name for p in setup.pools])
        self.scaler = autoscaling.ScalerState()
        for p in setup.pools:
            self.out.replicas_timeline[p.name] = [(0.0, p.replicas)]

    # ------------------------------------------------------------------ requests
    def _start(self, i: int, spec: RequestSpec) -> _Req:
        alpha = None
        r = _Req(f"r{i}", spec, speculation_control.initial_state(self.s.speculation, alpha), self.env.now,
                 spec.prompt_tokens, ready_since_s=self.env.now, done=self.env.event())
        self.in_flight += 1
        self._make_ready(r)
        return r

    def _make_ready(self, r: _Req) -> None:
        r.ready_since_s = self.env.now
        self.ready.append(r)
        for wake in self.idle_verifiers:
            wake.succeed()
        self.idle_verifiers = []

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

    # ------------------------------------------------------------------ verifier
    def _verifier(self) -> simpy.events.ProcessGenerator:
        s, v = self.s, self.s.verifier
        budget = batching.BatchBudget(v.max_batch_tokens, v.max_kv_tokens, v.max_requests)
        cost = batching.PassCost(self.curve.seconds(1), max(0.0, self.curve.seconds(2) - self.curve.seconds(1)))
        idle_since = self.env.now
        while True:
            if not self.ready:
                wake = self.env.event()
                self.idle_verifiers.append(wake)
                yield wake
                continue  # another replica may have taken everything
            now = self.env.now
            idle_s = now - idle_since
            by_id = {r.rid: r for r in self.ready}
            ready = [self._ready_view(r) for r in self.ready]
            plan = batching.plan_batch(ready, budget, s.batch_settings, now, cost=cost)
            taken = [(by_id[t.request_id], t.num_tokens) for t in plan.taken]
            taken_ids = {r.rid for r, _ in taken}
            self.ready = [r for r in self.ready if r.rid not in taken_ids]
            tokens = sum(n for _, n in taken)
            kv = sum(r.spec.prompt_tokens - r.prefill_left + r.emitted for r, _ in taken)
            pass_s = v.pass_s(tokens, kv)
            if s.mode in ("vanilla", "specinfer"):  # co-located drafting precedes the pass
                k_max = max((r.draft_len for r, _ in taken), default=0)
                pass_s += k_max * v.colocated_draft_s(len(taken)) * s.num_colocated_drafters
            backlog = sum(x.num_tokens for x in ready if x.request_id not in taken_ids)
            signal = speculation_control.LoadSignal(min(1.0, idle_s / max(idle_s + pass_s, 1e-9)), backlog,
                                                    v.max_batch_tokens)
            self.load = speculation_control.adjust_for_load(self.load, signal, s.speculation)
            yield self.env.timeout(pass_s)
            self.out.verifier_busy_s += pass_s
            self.window["busy_s"] += pass_s
            self.out.passes += 1
            self.last_batch = (tokens, max(1, len(taken)))
            for r, n in taken:
                self._after_pass(r, n)
            idle_since = self.env.now

    def _ready_view(self, r: _Req) -> batching.ReadyRequest:
        kv = r.spec.prompt_tokens - r.prefill_left + r.emitted
        if r.prefill_left > 0:
            return batching.ReadyRequest(r.rid, r.prefill_left, kv, r.arrival_s, r.ready_since_s, 1.0,
                                         is_prefill=True)
        width = r.draft_len * (self.s.num_colocated_drafters if self.s.mode == "specinfer" else 1)
        alpha = r.state.acceptance_rate
        return batching.ReadyRequest(r.rid, width + 1, kv, r.arrival_s, r.ready_since_s,
                                     speculation_control.expected_tokens(alpha, r.draft_len))

    def _alpha(self, r: _Req, drafter: str) -> float:
        if drafter not in r.alphas:
            r.alphas[drafter] = self.s.acceptance.sample(drafter, r.spec.domain, self.rng)
        return r.alphas[drafter]

    def _after_pass(self, r: _Req, n: int) -> None:
        s = self.s
        if r.prefill_left > 0:
            r.prefill_left -= n
            if r.prefill_left > 0:
                self._make_ready(r)
                return
            emitted = 1
            r.first_token_s = self.env.now
        else:
            k = min(r.draft_len, n - 1)
            emitted = 1
            if k > 0:
                names = r.drafters or tuple(self.pools)[:1]
                if s.mode == "specinfer":
                    names = tuple(self.pools)[: s.num_colocated_drafters]
                acc = {d: accepted_tokens(self._alpha(r, d), k, self.rng) for d in names}
                best = max(acc.values())
                emitted += best
                self.out.draft_tokens += k
                self.out.accepted += best
                self.out.spec_steps += 1
                r.state = speculation_control.observe(r.state, s.speculation, k, best)
                for d, a in acc.items():
                    self.router = routing.observe(self.router, d, r.spec.domain, k, a, self._alpha(r, d),
                                                  s.routing_settings)
                    if d in self.window["accepted"]:
                        self.window["accepted"][d] += a
        emitted = min(emitted, r.spec.output_tokens - r.emitted)
        r.emitted += emitted
        self.out.tokens += emitted
        self.window["verified"] += emitted
        if r.emitted >= r.spec.output_tokens:
            self._finish(r)
            return
        self._next_draft(r)

    def _finish(self, r: _Req) -> None:
        self.in_flight -= 1
        self.out.latencies_s.append(self.env.now - r.arrival_s)
        self.out.ttft_s.append((r.first_token_s or self.env.now) - r.arrival_s)
        self.out.makespan_s = self.env.now
        assert r.done is not None
        r.done.succeed()
        if len(self.out.latencies_s) == len(self.w.requests):
            self.all_done.succeed()

    # ------------------------------------------------------------------ drafting
    def _next_draft(self, r: _Req) -> None:
        s = self.s
        r.draft_len, r.drafters = 0, ()
        if s.mode == "target-only" or not self.pools:
            self._make_ready(r)
            return
        if s.mode == "cosine":
            up = [n for n in self.pools if self.replicas[n] > 0]
            r.drafters = tuple(routing.route(r.spec.domain, self.profiles, self.router, s.routing_settings,
                                             self.rng.betavariate, available=lambda n: n in up))
            if not r.drafters:
                self._make_ready(r)
                return
        pool = self.pools[(r.drafters or tuple(self.pools))[0]]
        tokens, reqs = self.last_batch
        cost = speculation_control.BatchedCost(pool.draft_token_s, self.curve, max(0, tokens - 1), reqs)
        r.state, k = speculation_control.next_draft_len(r.state, s.speculation, cost, self.load.cap_tokens)
        r.draft_len = min(k, r.spec.output_tokens - r.emitted - 1)
        if r.draft_len <= 0 or s.mode != "cosine":
            r.draft_len = max(0, r.draft_len)
            self._make_ready(r)
            return
        self.env.process(self._draft_remote(r))

    def _draft_remote(self, r: _Req) -> simpy.events.ProcessGenerator:
        drafts = [self.env.process(self._draft_one(r, self.pools[name])) for name in r.drafters]
        yield self.env.all_of(drafts)
        self._make_ready(r)

    def _draft_one(self, r: _Req, p: PoolModel) -> simpy.events.ProcessGenerator:
        ctx = r.spec.prompt_tokens + r.emitted
        unseen = ctx - r.seen_tokens.get(p.name, 0)
        up_bytes = 4 * min(unseen, ctx)  # context delta: token ids
        down_bytes = r.draft_len * DRAFT_BYTES_PER_TOKEN
        yield self.env.timeout(p.rtt_s / 2 + up_bytes / p.bandwidth_bytes_per_s)
        yield self.slots[p.name].get(1)
        work_s = unseen * p.catch_up_token_s + r.draft_len * p.draft_token_s
        yield self.env.timeout(work_s)
        yield self.slots[p.name].put(1)
        self.window["pool_busy_s"][p.name] += work_s
        r.seen_tokens[p.name] = ctx
        self.window["drafted"][p.name] += r.draft_len
        yield self.env.timeout(p.rtt_s / 2 + down_bytes / p.bandwidth_bytes_per_s)

    # ------------------------------------------------------------------ autoscaler
    def _autoscaler(self) -> simpy.events.ProcessGenerator:
        s = self.s
        assert s.scaling is not None
        while True:
            yield self.env.timeout(s.interval_s)
            w, iv = self.window, s.interval_s
            total_drafted = sum(w["drafted"].values())
            verifier = autoscaling.VerifierObservation(
                utilization=min(1.0, w["busy_s"] / (iv * s.verifier.replicas)),
                tokens_verified_per_s=w["verified"] / iv,
                requests_running=float(self.in_flight - len(self.ready)),
                requests_waiting=float(len(self.ready)),
            )
            pools = tuple(
                autoscaling.PoolObservation(
                    name=n, replicas=self.replicas[n], ready_replicas=self.pods_ready[n],
                    draft_tokens_per_s=w["drafted"][n] / iv,
                    acceptance_rate=w["accepted"][n] / w["drafted"][n] if w["drafted"][n] else None,
                    share=w["drafted"][n] / total_drafted if total_drafted else None,
                    # busy slot-seconds over the slots the pool had: its pods' busy fraction
                    utilization=min(1.0, w["pool_busy_s"][n] / (iv * max(1, self.pods_ready[n]) * self.pools[n].slots)),
                ) for n in self.pools)
            decisions, self.scaler = autoscaling.desired_replicas(
                autoscaling.Observations(verifier, pools), s.scaling, self.scaler, self.env.now)
            for d in decisions:
                if d.changed:
                    self._scale(d.pool, d.current, d.desired)
            self.window = self._new_window(list(self.pools))

    @staticmethod
    def _new_window(pools: list[str]) -> dict:
        """The autoscaler's counters for one interval."""
        return {"busy_s": 0.0, "verified": 0, "drafted": dict.fromkeys(pools, 0), "accepted": dict.fromkeys(pools, 0),
                "pool_busy_s": dict.fromkeys(pools, 0.0)}

    def _scale(self, name: str, current: int, desired: int) -> None:
        self.replicas[name] = desired
        self.out.scale_events.append((self.env.now, name, current, desired))
        self.out.replicas_timeline[name].append((self.env.now, desired))
        slots = self.pools[name].slots * abs(desired - current)
        if desired > current:
            self.env.process(self._add_slots(name, slots))
        else:
            self.env.process(self._remove_slots(name, slots))

    def _add_slots(self, name: str, slots: int) -> simpy.events.ProcessGenerator:
        yield self.env.timeout(self.s.pod_start_s)  # a new pod pulls, loads and becomes ready
        yield self.slots[name].put(slots)
        self.pods_ready[name] += slots // self.pools[name].slots

    def _remove_slots(self, name: str, slots: int) -> simpy.events.ProcessGenerator:
        self.pods_ready[name] -= slots // self.pools[name].slots  # a pod leaving is not ready any more
        yield self.slots[name].get(slots)  # it drains its in-flight drafts first

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        if self.w.concurrency:
            queue = list(enumerate(self.w.requests))
            for _ in range(self.w.concurrency):
                self.env.process(self._client(queue))
        else:
            self.env.process(self._arrivals())
        for _ in range(self.s.verifier.replicas):
            self.env.process(self._verifier())
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
