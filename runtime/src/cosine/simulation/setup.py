"""What a simulation is given: the cluster's parts as models (`SimSetup`: the verifier, its own
drafter, prompt lookup, the pools, spot preemptions, the router in front) and the requests
(`RequestSpec`, `Workload`). Plain data, each field with its unit; `cluster.simulate` runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cosine_spec import autoscaling
from cosine_spec.cluster_spec import RouterWeights, SpeculationSpec

from cosine import routing, speculation_control
from cosine.pool_policy import PoolPolicy
from cosine.simulation.cost_models import AcceptanceModel

MODES = ("target-only", "vanilla", "cosine")
EAGLE3 = "eagle3"  # the draft source name of an in-verifier draft head (vLLM's method)


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
    """Prompt lookup: on a decode step it finds a draft with probability `hit_rate`, of
    `draft_tokens` tokens on average (`draft_len`; acceptance: the `lookup` key of the
    `AcceptanceModel`); `per_domain` overrides both for a domain: domain -> (hit_rate,
    draft_tokens). `seen_hit_factor`: the hit rate's factor on a later turn of a conversation whose
    earlier turns this verifier replica served (its global suffix tree holds their outputs;
    `Workload.sessions`)."""

    hit_rate: float
    draft_tokens: float
    per_domain: dict[str, tuple[float, float]] = field(default_factory=dict)
    seen_hit_factor: float = 1.0

    @staticmethod
    def draft_len(mean_tokens: float, u: float) -> int:
        """One draft's length for a mean of `mean_tokens` (at least 1), `u` uniform in [0, 1): the
        two whole lengths around the mean, the longer with the mean's fractional part as its
        probability, so drafts average the measured mean (rounding it cut code's 4.40 to 4, and
        its accepted tokens per draft from the measured 3.37 to 3.12 at the fitted acceptance)."""
        mean_tokens = max(1.0, mean_tokens)
        whole = int(mean_tokens)
        return whole + (1 if u < mean_tokens - whole else 0)

    def on(self, domain: str, seen: bool = False) -> tuple[float, float]:
        """(hit rate, draft tokens) on a domain; `seen`: the replica served the conversation before."""
        hit, tokens = self.per_domain.get(domain, (self.hit_rate, self.draft_tokens))
        return (min(1.0, hit * self.seen_hit_factor), tokens) if seen else (hit, tokens)


@dataclass(frozen=True)
class EngineDrafterModel:
    """The verifier engine's own drafter (vLLM's `eagle3`, `mtp` or `draft_model`): `name`, its
    source name and its key in the `AcceptanceModel`; `k`, vLLM's `num_speculative_tokens` (fixed
    when the engine starts: it drafts k tokens for every running request after every step);
    `draft_token_s(batch)`, one draft token's forward for a batch of `batch` requests, seconds."""

    name: str
    k: int
    draft_token_s: Callable[[int], float]

    def step_s(self, batch: int, depth: int | None = None) -> float:
        """What the drafter adds to a step of `batch` decoding requests: `depth` forwards over the
        batch (default k; at least one: vLLM runs the first at any depth)."""
        return max(1, self.k if depth is None else depth) * self.draft_token_s(batch) if batch else 0.0


@dataclass(frozen=True)
class VerifierModel:
    """pass_s(tokens, kv_tokens) -> seconds of one engine step; max_batch_tokens: vLLM's
    `max_num_batched_tokens`; max_requests: its `max_num_seqs`. `sync_step_s`: what a step costs
    more with vLLM's async scheduling off (its CPU work no longer overlaps the GPU's pass): paid by
    every engine running speculation vLLM cannot overlap (`suffix`, `ngram`, a `custom_class`
    proposer, CoSine's scheduler, which turns async scheduling off to receive the head's drafts),
    not by target-only nor by vLLM's own `eagle3`/`mtp`/`draft_model` (`SimSetup.async_scheduling`).
    `proposer_step_s(batch)`: the drafting plane's own CPU time per step of `batch` decoding
    requests (cosine mode): on the step's critical path, or only its excess over the step's GPU
    time where the proposer runs beside the step (`SimSetup.proposer_overlapped`).
    `device_lookup_step_s`: what prompt lookup on the device (the model runner seam's n-gram
    kernels over each request's token history) adds to a step with decoding requests."""

    pass_s: Callable[[int, int], float]
    replicas: int = 1
    max_batch_tokens: int = 2048
    max_requests: int = 256
    price_per_hour_usd: float = 0.0
    sync_step_s: float = 0.0
    proposer_step_s: Callable[[int], float] = lambda batch: 0.0
    device_lookup_step_s: float = 0.0
    # tokens of context each replica's prefix cache keeps after requests finish (vLLM's automatic
    # prefix caching in its free KV blocks, least recently used evicted); 0: not modelled
    prefix_cache_tokens: int = 0

    def usd_per_token(self, batch: int, kv_tokens_per_request: int) -> float:
        """What one replica spends on a token decoding `batch` requests without speculation (one
        token each a pass of `kv_tokens_per_request` context each): what an accepted draft token
        saves it, USD."""
        return self.price_per_hour_usd / 3600 * self.pass_s(batch, batch * kv_tokens_per_request) / max(1, batch)


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
    engine_drafter: EngineDrafterModel | None = None  # the verifier engine's own drafter (a head, a draft model)
    async_scheduling: bool = True  # vLLM's async scheduling on (False: each step pays `VerifierModel.sync_step_s`)
    # Where CoSine meets vLLM (cosine mode). The model runner seam: the proposer's Python runs beside
    # the GPU's step (a step stale), so a step pays its time only where it exceeds the step's GPU
    # time, and then the excess; False (the scheduler seam): every step pays all of it.
    proposer_overlapped: bool = False
    # Prompt lookup runs in the verifier's process and reaches the device as anchored candidates
    # (the context length they continue and their tokens) one step stale: made from the context a
    # step before, used only where they still continue the tokens there (`drafting.AnchoredSource`).
    # False: lookup drafts from the current tokens (on the device, or in the scheduler seam's process).
    lookup_anchored: bool = False


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
    `cosine:suffix_tree_hit_rate` through the metric scorer (linear on [0, 1]), queue (the
    emptiest waiting queue 1, the fullest 0) and KV-cache utilisation (free share)."""
    return (weights.prefix_cache * prefix_hit + weights.session_affinity * same_session
            + weights.suffix_affinity * suffix_hit_rate + weights.queue * queue_score
            + weights.kv_cache_utilization * kv_free)
