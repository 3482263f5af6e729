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
- what the proposer cannot tell from a model is simulated: the target's output
  (`target.SimRequest`, greedy: a draft is accepted up to its first token that is not the
  target's); the engine's own drafter (`setup.EngineDrafterModel`: k tokens for every decoding
  request after every step); prompt lookup (`drafting.SimLookup`: a draft on a share of steps,
  `LookupModel`); pools (`drafting.SimPool`: replicas, each
  `slots` requests at once behind a network (RTT, bandwidth), requests assigned for their lifetime
  by `pool_policy.assign_replica` as `ReplicaPool` does, drafts past the draft being verified and
  from its rejection points). Each draft token is the target's at the request's acceptance rate for
  its source (`AcceptanceModel`), until the first miss;
- the operator's `autoscaling.desired_replicas` scales pools every `interval_s` on the series it
  scrapes (the proposers' counters, the pools' busy time).

Modes: `target-only` (vLLM, no speculation); `vanilla` (vLLM's own speculation: the engine's
drafter, `SimSetup.engine_drafter`, drafts its fixed k for every request before each step: vLLM's
`draft_model`, or `eagle3`/`mtp` with a head); `cosine` (the proposer, with every draft source the
setup has: the engine's drafter as an `EngineSource` offered its drafts each step, as
`vllm_hooks.CoSineScheduler.update_draft_token_ids` offers vLLM's; prompt lookup if the setup has
a `LookupModel`; the pools). An engine drafter is paid for its forwards over the whole batch
every step, whichever draft the step verifies (its first forward runs even where k = 0 wins): k of
them in vanilla; in cosine as many as the proposer will verify (`CoSineProposer.engine_draft_len`,
vLLM's `num_spec_tokens_to_schedule`), as `vllm_hooks.CoSineScheduler` asks of vLLM.

Where CoSine meets vLLM is what a step pays (`_step_s`). The scheduler seam (V1, async scheduling
off): `sync_step_s` and the proposer's time on every step. The model runner seam (MRV2, async
scheduling on): the proposer's Python beside the GPU's step, paying only what it takes past it;
prompt lookup on the device over the current tokens, `device_lookup_step_s` a step; candidates
from the verifier's process anchored and one step stale (a pool's draft always is: it is asked
while the step it follows is verified; lookup's where `SimSetup.lookup_anchored`).

The simulator's inputs are `setup`'s (re-exported here), its drafters `drafting`'s, its output
`results.SimResult`.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

import simpy
from cosine_spec import autoscaling
from cosine_spec.scaling_loop import ScalingLoop

from cosine.proposer import CoSineProposer, ProposerSettings, RequestOutcome, StepRecord
from cosine.simulation.drafting import AnchoredSource, SimExecutor, SimLookup, SimPool
from cosine.simulation.results import SimResult
from cosine.simulation.setup import (  # re-exported: the simulator's inputs, where they were
    EAGLE3,
    MODES,
    ROUTERS,
    EngineDrafterModel,
    LookupModel,
    PoolModel,
    Preemption,
    RequestSpec,
    SimSetup,
    VerifierModel,
    Workload,
    endpoint_score,
)
from cosine.simulation.target import SimRequest
from cosine.sources import DraftSource
from cosine.sources.engine import EngineSource
from cosine.sources.lookup import LookupSource

__all__ = ["EAGLE3", "MODES", "ROUTERS", "EngineDrafterModel", "LookupModel", "PoolModel", "Preemption",
           "RequestSpec", "SimExecutor", "SimResult", "SimSetup", "VerifierModel", "Workload", "endpoint_score",
           "poisson_requests", "simulate"]


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
        self.waiting: list[SimRequest] = []  # vLLM's waiting queue, shared by the replicas (router `shared`)
        # else one waiting queue per replica, filled by the router
        self.queues: list[list[SimRequest]] = [[] for _ in range(replicas)] if setup.router != "shared" else []
        self.running: list[list[SimRequest]] = [[] for _ in range(replicas)]
        self.prefix_cache: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(replicas)]  # session -> tokens
        self.seen: list[set[int]] = [set() for _ in range(replicas)]  # sessions whose outputs a replica's tree holds
        self.last_replica: dict[int, int] = {}  # session -> the replica of its last turn
        self.suffix_hit_rate = [0.0] * replicas  # each replica's cosine:suffix_tree_hit_rate (EMA)
        self.route_rng = random.Random(f"{setup.seed}/router")
        self.seqs: dict[str, SimRequest] = {}  # request id -> the request, while it runs
        self.in_flight = 0
        self.idle_verifiers: list[simpy.Event] = []  # one wake-up event per idle verifier replica
        self.all_done = self.env.event()
        self.pools = {p.name: p for p in setup.pools}
        self.replicas = {p.name: p.replicas for p in setup.pools}
        self.pods_ready = dict(self.replicas)  # replicas whose pods have started
        self.executor = SimExecutor(self.env)
        self.acceptance = setup.acceptance
        self.sim_pools = {p.name: SimPool(p, self) for p in setup.pools}
        self.proposers: list[CoSineProposer] = []  # one per verifier replica, as each serving replica has its own
        self.engines: list[EngineSource] = []  # each proposer's engine-drafter source (one per replica)
        self.head_depth = [setup.engine_drafter.k if setup.engine_drafter else 0] * setup.verifier.replicas  # tokens
        # the engine drafter drafts for each replica's next step (cosine: the proposer's `engine_draft_len`)
        if setup.mode == "cosine":
            if setup.engine_drafter is not None:
                self.engines = [EngineSource(setup.engine_drafter.name) for _ in range(setup.verifier.replicas)]
            head = setup.engine_drafter
            # the depth cost's prior, as `cosine serve` takes it from the weights' bytes: a forward's ratio
            ratio = head.draft_token_s(1) / setup.verifier.pass_s(1, 0) if head is not None else 0.0
            settings = ProposerSettings(speculation=setup.speculation, control=setup.control,
                                        routing=setup.routing_settings, lookup=setup.lookup is not None,
                                        pool=setup.pool_policy, engine_depth_ratio=ratio)
            expertise = {p.name: p.expertise for p in setup.pools}
            self.proposers = [
                CoSineProposer(settings, list(self.sim_pools.values()), expertise,
                               classify=lambda prompt: self.w.requests[prompt[0]].domain, clock=lambda: self.env.now,
                               seed=setup.seed + i, executor=self.executor,
                               sources=self._sources(i))
                for i in range(setup.verifier.replicas)]
        self._counted = self._proposer_counts()  # the proposers' counters at the window's start
        self.window = self._new_window(list(self.pools))
        for p in setup.pools:
            self.out.replicas_timeline[p.name] = [(0.0, p.replicas)]

    def _sources(self, replica: int) -> list[DraftSource]:
        """A replica's proposer's local sources, as `cosine serve` builds them: the engine's own
        drafter first (when the verifier runs one), then prompt lookup (a step stale where its
        candidates come from the verifier's process: `SimSetup.lookup_anchored`)."""
        out: list[DraftSource] = [self.engines[replica]] if self.engines else []
        if self.s.lookup is not None:
            lookup = LookupSource(SimLookup(self.s.lookup, self))
            out.append(AnchoredSource(lookup) if self.s.lookup_anchored else lookup)
        return out

    # ------------------------------------------------------------------ requests
    def _start(self, i: int, spec: RequestSpec) -> SimRequest:
        seq = SimRequest(f"r{i}", spec, self.env.now, spec.prompt_tokens, [i] + [0] * (spec.prompt_tokens - 1),
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

    def _route(self, seq: SimRequest) -> int:
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

    def seen_by(self, seq: SimRequest) -> bool:
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

    # ------------------------------------------------------------------ what the modelled drafters see (`World`)
    def request(self, request_id: str) -> SimRequest:
        """The running request of that id."""
        return self.seqs[request_id]

    def rehomed(self, request_id: str) -> None:
        """A pool re-homed the request (its replica was removed)."""
        self.out.rehomes += 1
        self.out.rehomed_requests.add(request_id)

    def pool_work(self, pool: str, work_s: float, drafted: int) -> None:
        """A pool's call finished `work_s` seconds of work, `drafted` tokens: the interval's counters."""
        w = self.window
        w["pool_busy_s"][pool] += work_s
        w["rounds"][pool] += 1
        w["drafted"][pool] += drafted

    def alpha(self, seq: SimRequest, source: str) -> float:
        """The request's per-token acceptance rate for a draft source (drawn once)."""
        if source not in seq.alphas:
            seq.alphas[source] = self.s.acceptance.sample(source, seq.spec.domain, seq.rng)
        return seq.alphas[source]

    # ------------------------------------------------------------------ verifier (vLLM's scheduler)
    def _schedule(self, running: list[SimRequest], replica: int) -> list[tuple[SimRequest, int]]:
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

    def _use_prefix_cache(self, seq: SimRequest, replica: int) -> None:
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
        v = self.s.verifier
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
            decodes = [seq for seq, _ in step if seq.prefill_left == 0]
            pass_s = self._step_s(v.pass_s(tokens, kv), len(decodes), self.head_depth[replica])
            yield self.env.timeout(pass_s)
            self.out.verifier_busy_s += pass_s
            self.window["busy_s"] += pass_s
            self.window["steps"] += 1
            self.out.passes += 1
            if any(seq.draft for seq in decodes):
                self.out.steps_with_draft += 1
            outcomes = [self._after_step(seq, n, running) for seq, n in step]
            if proposer is not None:
                t0 = time.perf_counter()
                depth = self.head_depth[replica] if decodes and self.s.engine_drafter else 0
                proposer.observe_step(StepRecord(pass_s, tokens, tuple(o for o in outcomes if o is not None),
                                                 has_prefill=len(decodes) < len(step), engine_depth=depth,
                                                 num_requests=len(decodes)))
                self.out.proposer_cpu_s += time.perf_counter() - t0
                self.out.proposer_steps += 1
            self._draft(running, proposer)

    def _step_s(self, pass_s: float, decodes: int, depth: int) -> float:
        """A step of `decodes` decoding requests whose target pass takes `pass_s`: on the GPU, the
        pass, the engine drafter's forwards over the batch, `depth` deep (its k in vanilla; in
        cosine what the proposer asked for, at least one forward) whichever draft wins, and lookup
        on the device; then async scheduling off, and CoSine's proposer's CPU time: all of it, or
        where it runs beside the step (`SimSetup.proposer_overlapped`) what it takes past the
        step's GPU time."""
        s, v = self.s, self.s.verifier
        gpu_s = pass_s
        if s.engine_drafter is not None and s.mode != "target-only":
            gpu_s += s.engine_drafter.step_s(decodes, depth)
        if decodes and s.lookup is not None and s.mode == "cosine":
            gpu_s += v.device_lookup_step_s
        cpu_s = v.proposer_step_s(decodes) if self.proposers and decodes else 0.0
        if s.proposer_overlapped:
            cpu_s = max(0.0, cpu_s - gpu_s)
        return gpu_s + cpu_s + (0.0 if s.async_scheduling else v.sync_step_s)

    def _after_step(self, seq: SimRequest, n: int, running: list[SimRequest]) -> RequestOutcome | None:
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

    def _draft(self, running: list[SimRequest], proposer: CoSineProposer | None) -> None:
        """The next step's drafts. The engine's drafter (if any) drafts its k for every decoding
        request; vanilla verifies that draft, cosine offers it to the proposer (as
        `vllm_hooks.CoSineScheduler` does) and verifies what the proposer chooses."""
        decodes = [seq for seq in running if seq.prefill_left == 0]
        if not decodes:
            return
        head = self.s.engine_drafter
        depth = 0
        if head is not None and self.s.mode != "target-only":
            # as `CoSineScheduler.schedule` sets vLLM's `num_spec_tokens_to_schedule`
            depth = min(head.k, proposer.engine_draft_len()) if proposer is not None else head.k
            self.head_depth[decodes[0].replica] = depth
        drafted = {seq.rid: seq.guess(seq.emitted, depth, self.alpha(seq, head.name)) for seq in decodes} \
            if depth else {}
        if proposer is not None:
            if self.engines:
                self.engines[decodes[0].replica].offer(drafted)
            t0 = time.perf_counter()
            drafts = proposer.propose({seq.rid: seq.tokens for seq in decodes},
                                      {seq.rid: seq.spec.prompt_tokens for seq in decodes})
            self.out.proposer_cpu_s += time.perf_counter() - t0  # with the simulated sources' own time
            for seq in decodes:
                seq.draft, seq.source = drafts[seq.rid], proposer.source_of(seq.rid)
        elif head is not None:
            for seq in decodes:
                seq.draft, seq.source = drafted[seq.rid], head.name

    def _finish(self, seq: SimRequest) -> None:
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
                asks_per_s=c[("asks", n)] / iv, late_per_s=c[("late", n)] / iv, probes_per_s=c[("probes", n)] / iv,
                gain_tokens_per_s=c[("gain", n)] / iv,
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

    def _proposer_counts(self) -> dict[tuple[str, ...], float]:
        """The proposers' counters the operator scrapes (`cosine.metrics`), summed over verifier
        replicas, per pool: asks (calls returned or failed), asks made only to probe, late drafts,
        asks skipped per reason, expected tokens added where wanted, accepted draft tokens."""
        out: dict[tuple[str, ...], float] = {}
        for n in self.pools:
            st = [p.stats for p in self.proposers]
            out[("asks", n)] = sum(x.pool_calls.get(n, 0) + x.pool_errors.get(n, 0) for x in st)
            out[("late", n)] = sum(x.drafts_late.get(n, 0) for x in st)
            out[("probes", n)] = sum(x.pool_probes.get(n, 0) for x in st)
            out[("gain", n)] = sum(x.pool_gain_tokens.get(n, 0.0) for x in st)
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
                if self.sim_pools[name].remove_replica():
                    self.pods_ready[name] -= 1

    def _preemptions(self, name: str, pre: Preemption) -> simpy.events.ProcessGenerator:
        """Spot preemptions of one pool's replicas (`Preemption`): a Poisson process at the
        per-replica rate times the replicas ready, each one drained at its notice and replaced."""
        rng = random.Random(f"{self.s.seed}/preempt/{name}")
        pool = self.sim_pools[name]
        while True:
            yield self.env.timeout(rng.expovariate(pre.per_replica_hour / 3600 * max(1, self.pods_ready[name])))
            if not pool.remove_replica(rng):  # drained: its requests re-home at their next call
                continue
            self.pods_ready[name] -= 1
            self.out.preemptions += 1
            self.out.replicas_timeline[name].append((self.env.now, self.pods_ready[name]))  # charged: ready pods
            # the Deployment keeps its replicas: its controller asks for the replacement at once
            self.env.process(self._add_replicas(name, 1, pre.replacement_s, timeline=True))

    def _add_replicas(self, name: str, count: int, delay_s: float | None = None,
                      timeline: bool = False) -> simpy.events.ProcessGenerator:
        yield self.env.timeout(self.s.pod_start_s if delay_s is None else delay_s)  # a new pod pulls, loads, is ready
        pool = self.sim_pools[name]
        for _ in range(count):  # once ready, the proposer's next re-resolve finds it
            pool.add_replica()
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
