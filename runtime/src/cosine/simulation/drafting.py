"""The drafters the simulator models, behind the interfaces the proposer calls: prompt lookup
(`SimLookup`, `lookup.SuffixLookup`'s), drafter pools (`SimPool`, `drafter.Drafter`'s, as
`ReplicaPool`), a source whose candidates reach the device a step stale (`AnchoredSource`), and
the executor their calls run on in simulated time (`SimExecutor`). Each draft
token is the target's at the request's acceptance rate for its source (`target.SimRequest.guess`).
They see the cluster only through `World`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any, Protocol

import simpy

from cosine.drafter import Draft, DraftBranch
from cosine.pool_clients import PoolDraft, continuation
from cosine.pool_policy import assign_replica
from cosine.simulation.cost_models import AcceptanceModel
from cosine.simulation.setup import LookupModel, PoolModel
from cosine.simulation.target import SimRequest
from cosine.sources import Candidate, DraftSource, Where
from cosine.sources.lookup import LOOKUP

DRAFT_BYTES_PER_TOKEN = 8  # a draft token on the wire: its id and its confidence (no distribution)


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


class World(Protocol):
    """What the modelled drafters need of the simulated cluster (`cluster._Cluster` is one): its
    clock and executor, the acceptance model, the running requests, and where to report what they
    did. Nothing else of the cluster's state is theirs to touch."""

    env: simpy.Environment
    executor: SimExecutor
    acceptance: AcceptanceModel

    def request(self, request_id: str) -> SimRequest:
        """The running request of that id."""
        ...

    def alpha(self, seq: SimRequest, source: str) -> float:
        """The request's per-token acceptance rate for a source."""
        ...

    def seen_by(self, seq: SimRequest) -> bool:
        """Whether the request's verifier replica served an earlier turn of its conversation."""
        ...

    def observe_lookup(self, replica: int, hit: bool) -> None:
        """One lookup on a verifier replica, found a draft or not."""
        ...

    def rehomed(self, request_id: str) -> None:
        """A pool moved the request to another replica (its own was removed)."""
        ...

    def pool_work(self, pool: str, work_s: float, drafted: int) -> None:
        """A pool's call finished its work: `work_s` seconds of a slot, `drafted` tokens."""
        ...


class SimLookup:
    """Prompt lookup as `lookup.SuffixLookup`'s interface: on a share `hit_rate` of calls it finds a
    draft of `draft_tokens` on average (`LookupModel.draft_len`), each token the target's at the
    request's lookup acceptance rate; its path probabilities are the domain's mean rate compounded
    (the tree's counts would be the request's own: the proposer's per-request calibration learns
    the difference, as it does live)."""

    def __init__(self, model: LookupModel, world: World) -> None:
        self.model, self.world = model, world

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        pass

    def propose(self, request_id: str, context: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        seq = self.world.request(request_id)
        hit_rate, draft_tokens = self.model.on(seq.spec.domain, self.world.seen_by(seq))
        if max_tokens <= 0:
            return [], []
        hit = seq.rng.random() < hit_rate
        self.world.observe_lookup(seq.replica, hit)
        if not hit:
            return [], []
        whole = draft_tokens == int(draft_tokens)  # a whole mean needs no draw (the request's stream unchanged)
        n = min(max_tokens, LookupModel.draft_len(draft_tokens, 1.0 if whole else seq.rng.random()))
        mean = self.world.acceptance.mean(LOOKUP, seq.spec.domain)
        tokens = seq.guess(len(context) - seq.spec.prompt_tokens, n, self.world.alpha(seq, LOOKUP))
        return tokens, [mean ** (i + 1) for i in range(n)]

    def release(self, request_id: str) -> None:
        pass


class AnchoredSource:
    """A local source run in the verifier's process, as the model runner seam takes it: its
    candidate for a step is made from the context a step before (the scheduler's output for step
    t+1 is built while step t runs, from the tokens known then), sent with that context's length
    (an anchored candidate), and used on the device only where the tokens emitted since are its
    own first ones; the rest of it is the candidate (`pool_clients.continuation`, the check the
    proposer makes of a pool's draft). Elsewhere it has none, and another source's draft (the
    head's) is verified. The inner source is asked for `reach` times `max_tokens` plus one, so a
    candidate can outlast the step it waits through, as far as the source drafts."""

    where = Where.PROCESS

    def __init__(self, inner: DraftSource, reach: int = 2) -> None:
        self.inner, self.name, self.reach = inner, inner.name, reach
        self._made: dict[str, PoolDraft] = {}  # request id -> its candidate made at the last step

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        self.inner.start(request_id, prompt)

    def candidate(self, request_id: str, context: Sequence[int], max_tokens: int,
                  acceptance_rate: float) -> Candidate | None:
        made = self._made.pop(request_id, None)
        fresh = self.inner.candidate(request_id, context, self.reach * max_tokens + 1, acceptance_rate)
        if fresh is not None and context:
            self._made[request_id] = PoolDraft(len(context), context[-1], ((fresh.token_ids, fresh.confidences),))
        rest = continuation(made, context) if made is not None else None
        if rest is None or max_tokens <= 0:
            return None
        return Candidate(rest[0][:max_tokens], rest[1][:max_tokens])

    def release(self, request_id: str) -> None:
        self._made.pop(request_id, None)
        self.inner.release(request_id)


class SimPool:
    """A drafter pool as the proposer calls it (`drafter.Drafter`, like `ReplicaPool`): each
    request assigned to one replica for its lifetime (`pool_policy.assign_replica`; a request whose
    replica was removed is re-homed and sends its whole context again), a call queued for one of the
    replica's `slots`, then drafting. Its draft continues the context past `expected` (the draft the
    verifier checks meanwhile) and branches at `expected`'s rejection points where the pool's own
    guess differs (PEARL's post-verify drafting); confidences are the pool's mean acceptance on
    the domain. No replica: `RuntimeError`, as `ReplicaPool` raises."""

    def __init__(self, model: PoolModel, world: World) -> None:
        self.model, self.name, self.world = model, model.name, world
        self.slots: list[simpy.Container] = []  # per replica, its slots
        self.active: list[int] = []  # the replicas taking requests
        self.held: dict[str, int] = {}  # replica -> requests assigned to it
        self.home: dict[str, int] = {}  # request -> its replica
        self.seen: dict[str, int] = {}  # request -> context tokens its replica holds
        self.calls: list[int] = []  # draft calls per replica
        for _ in range(model.replicas):
            self.add_replica()

    def propose(self, request_id: str, context_ids: Sequence[int], max_tokens: int, *, min_confidence: float = 0.0,
                expected: Sequence[int] = (), max_branches: int = 0) -> Draft:
        replica = self._replica_of(request_id)
        seq = self.world.request(request_id)
        alpha = self.world.alpha(seq, self.name)
        conf = self.world.acceptance.mean(self.name, seq.spec.domain)
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
        self.world.executor.defer(self._work(request_id, replica, len(context_ids), drafted))
        return Draft(main, (conf,) * len(main), self.name, 0.0, len(expected), tuple(branches))

    def release(self, request_id: str) -> None:
        home = self.home.pop(request_id, None)
        self.seen.pop(request_id, None)
        if home is not None:
            self.held[str(home)] -= 1

    @property
    def ready(self) -> int:
        """Replicas taking requests."""
        return len(self.active)

    def add_replica(self) -> None:
        """A new replica, ready: the proposer's next call may be assigned to it."""
        self.slots.append(simpy.Container(self.world.env, capacity=self.model.slots, init=self.model.slots))
        self.active.append(len(self.slots) - 1)

    def remove_replica(self, rng: random.Random | None = None) -> bool:
        """A replica stops taking requests (the newest, or one drawn with `rng`: a preemption); its
        requests are re-homed at their next call, the calls it holds finish. False: none left."""
        if not self.active:
            return False
        self.active.remove(rng.choice(self.active) if rng is not None else self.active[-1])
        return True

    def _replica_of(self, rid: str) -> int:
        home = self.home.get(rid)
        if home is not None and home in self.active:
            return home
        if not self.active:
            raise RuntimeError(f"pool {self.name!r} has no replica to draft on")
        if home is not None:
            self.held[str(home)] -= 1
            self.seen[rid] = 0
            self.world.rehomed(rid)
        new = int(assign_replica(self.held, [str(i) for i in self.active]))  # type: ignore[arg-type]
        self.held[str(new)] = self.held.get(str(new), 0) + 1
        self.home[rid] = new
        return new

    def _work(self, rid: str, replica: int, ctx_len: int, drafted: int) -> simpy.events.ProcessGenerator:
        p, env = self.model, self.world.env
        unseen = ctx_len - self.seen.get(rid, 0)
        yield env.timeout(p.rtt_s / 2 + 4 * unseen / p.bandwidth_bytes_per_s)  # the context delta: token ids
        slots = self.slots[replica]
        yield slots.get(1)
        work_s = unseen * p.catch_up_token_s + drafted * p.draft_token_s
        yield env.timeout(work_s)
        yield slots.put(1)
        self.world.pool_work(p.name, work_s, drafted)  # counted in the interval the work ends in
        self.calls.extend([0] * (replica + 1 - len(self.calls)))
        self.calls[replica] += 1
        if rid in self.home:
            self.seen[rid] = ctx_len
        yield env.timeout(p.rtt_s / 2 + drafted * DRAFT_BYTES_PER_TOKEN / p.bandwidth_bytes_per_s)
