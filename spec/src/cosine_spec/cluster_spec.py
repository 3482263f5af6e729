"""Typed views of a ``CoSineCluster`` spec.

The CRD (``crds/cosine.dev_cosineclusters.yaml``) is what the API server validates and defaults.
Each spec field is declared once, with :func:`cosine_spec.schema.spec_field`: its key in the spec,
its default, its bounds and its allowed values. :func:`parse_cluster_spec` reads a spec with those
declarations (so the operator behaves the same on a server that did not default: the test
emulator, an old object), and ``spec/crdgen.py`` writes every declaration into the CRD. Parse a
spec once and pass the :class:`ClusterSpec` around. The verifier's part is
:mod:`cosine_spec.verifier_spec`, the pods' images and overrides :mod:`cosine_spec.pods`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cosine_spec.pods import ImageSpec, PodOverrides, RoleImage
from cosine_spec.schema import Checked, read_fields, refuse_unknown, spec_field, spec_keys
from cosine_spec.spot import CAPACITY_TYPES, SPOT_PROVIDERS, SpotCapacity
from cosine_spec.verifier_spec import ParallelismSpec, RolloutSpec, SpeculatorSpec, VerifierSpec

DRAFTER_ENGINES = ("llamacpp", "vllm")  # spec.drafterPools[].engine
MAX_DRAFT_LEN = 32  # spec.speculation.maxDraftLen's maximum


def clamp_replicas(replicas: int, minimum: int, maximum: int) -> int:
    """``replicas`` within ``[minimum, maximum]`` (the pool's ``minReplicas``/``maxReplicas``)."""
    return max(minimum, min(maximum, replicas))


@dataclass(frozen=True)
class SpotSpec(Checked):
    """``spec.spot``: where pools with ``capacity: spot`` run. ``provider``: whose spot nodes
    (:data:`SPOT_PROVIDERS`: their label, taint and notice). ``pending_timeout_s``: seconds a spot
    replica may stay Pending before an on-demand sibling stands in for it
    (:mod:`cosine_spec.capacity`)."""

    SPEC_PATH: ClassVar[str] = "spec.spot"
    provider: str = spec_field("provider", enum=tuple(SPOT_PROVIDERS))
    pending_timeout_s: int = spec_field("pendingTimeoutSeconds", 300, minimum=0)

    @property
    def capacity(self) -> SpotCapacity:
        return SPOT_PROVIDERS[self.provider]


@dataclass(frozen=True)
class DrafterPoolSpec(Checked):
    """One pool of identical drafter pods (a model drafter or a model-free n-gram drafter).

    ``engine``: the model drafter's inference engine as written in the spec (``llamacpp``,
    ``vllm``), ``None`` when unset; :attr:`resolved_engine` applies the default.
    """

    SPEC_PATH: ClassVar[str] = "spec.drafterPools[]"
    name: str = spec_field("name")
    kind: str = spec_field("kind", "model", enum=("model", "ngram"))
    model: str | None = spec_field("model", None)
    engine: str | None = spec_field("engine", None, enum=DRAFTER_ENGINES)
    tokenizer: str | None = spec_field("tokenizer", None)
    translate_tokenizer: bool = spec_field("translateTokenizer", False)
    expertise: tuple[str, ...] = spec_field("expertise", ())
    replicas: int = spec_field("replicas", 1, minimum=0)
    min_replicas: int = spec_field("minReplicas", 1, minimum=0)
    max_replicas: int = spec_field("maxReplicas", 4, minimum=1)
    threads: int = spec_field("threads", 1, minimum=1)  # CPU threads of the drafter engine (llama.cpp)
    price_per_hour_usd: float = spec_field("pricePerHourUsd", 0.0, minimum=0)  # one replica's price (autoscaling)
    spot_price_per_hour_usd: float = spec_field("spotPricePerHourUsd", 0.0, minimum=0)  # the same on spot capacity
    gpu_memory_utilization: float | None = spec_field(
        "gpuMemoryUtilization", None, minimum=0.05, maximum=1
    )  # engine vllm on GPU pods: share of the GPU's memory (None: vLLM's default)
    startup_timeout_s: int = spec_field("startupTimeoutSeconds", 600, minimum=30)
    termination_grace_s: int = spec_field("terminationGracePeriodSeconds", 30, minimum=0)
    capacity: str = spec_field("capacity", "onDemand", enum=CAPACITY_TYPES)  # spot: on `spec.spot`'s nodes
    image: RoleImage = field(default_factory=RoleImage, metadata={"key": "image"})
    pod: PodOverrides = field(default_factory=PodOverrides)

    @property
    def tokenizer_family(self) -> str | None:
        """The declared tokenizer, else the model name; ``None`` for n-gram pools (no tokenizer)."""
        return self.tokenizer or self.model

    @property
    def resolved_engine(self) -> str | None:
        """The engine the pool's drafter runs: ``engine`` if set, else ``llamacpp`` when the pool
        requests no ``nvidia.com/gpu`` and ``vllm`` when it does; ``None`` for n-gram pools (no model).

        Not a CRD default because it depends on the device. Either engine runs on either device
        (llama.cpp can offload layers to a GPU; vLLM has a CPU build), so no combination is refused.
        """
        if self.kind == "ngram":
            return None
        if self.engine is not None:
            return self.engine
        return "vllm" if self.pod.requests_gpu else "llamacpp"

    def clamp(self, replicas: int) -> int:
        """``replicas`` within this pool's ``[min_replicas, max_replicas]``."""
        return clamp_replicas(replicas, self.min_replicas, self.max_replicas)

    @property
    def replica_price_per_hour_usd(self) -> float:
        """What the next replica costs, USD per hour: on spot capacity ``spotPricePerHourUsd`` (when
        given), else ``pricePerHourUsd``. The autoscaler's marginal-value gate weighs this price."""
        if self.capacity == "spot" and self.spot_price_per_hour_usd > 0:
            return self.spot_price_per_hour_usd
        return self.price_per_hour_usd

    def grace_s(self, spot: SpotSpec | None) -> int:
        """Seconds between a replica's SIGTERM and its SIGKILL: ``terminationGracePeriodSeconds``,
        on spot capacity at most what the provider's notice leaves a pod (``spot.capacity``)."""
        if self.capacity == "spot" and spot is not None:
            return min(self.termination_grace_s, spot.capacity.pod_grace_s)
        return self.termination_grace_s


DRAFT_LENGTH_RULES = ("pathProbability", "acceptanceRate")  # spec.speculation.draftLength


@dataclass(frozen=True)
class SpeculationSpec(Checked):
    """``spec.speculation``: how the verifier's proposer asks pools for drafts.

    ``max_draft_len``: most tokens drafted per request per step (k), ``0..MAX_DRAFT_LEN``; 0 turns
    speculation off. ``adaptive``: choose k per request from measured acceptance and verifier load
    (else always ``max_draft_len``). ``fusion``: when the router expects two or more pools to pay
    for a request's domain, they all draft and their chains are fused by confidence per position;
    ``False``: one pool per request. ``min_confidence``: a pool's drafter stops a draft at the first
    token whose top-1 probability is below this, ``0..1`` (0 never stops early). ``branches``: at
    most this many rejection points of the draft being verified a pool also drafts from (its
    guess of the target's token there), ``0..4``; fewer while the pool's round trip nears a
    verifier step; 0: a pool drafts past the verified draft only. ``draft_length``: what k weighs
    against a draft token's cost in the verifier's pass: ``pathProbability`` (each token of the
    draft at hand by its probability of being accepted with every token before it, from its
    source's own counts or probabilities, calibrated on what the target accepted) or
    ``acceptanceRate`` (the request's measured acceptance rate, the same for every draft).
    ``prompt_lookup``: prompt and suffix lookup in the verifier's process, a draft source beside
    the engine's own drafter and the pools (``False``: the other sources only).
    Out-of-bounds values raise ``ValueError`` (as for every spec dataclass here).
    """

    SPEC_PATH: ClassVar[str] = "spec.speculation"
    max_draft_len: int = spec_field("maxDraftLen", 8, minimum=0, maximum=MAX_DRAFT_LEN)
    adaptive: bool = spec_field("adaptive", True)
    fusion: bool = spec_field("fusion", True)
    min_confidence: float = spec_field("minConfidence", 0.0, minimum=0, maximum=1)
    branches: int = spec_field("branches", 2, minimum=0, maximum=4)
    draft_length: str = spec_field("draftLength", "pathProbability", enum=DRAFT_LENGTH_RULES)
    prompt_lookup: bool = spec_field("promptLookup", True)


@dataclass(frozen=True)
class AutoscalingSpec(Checked):
    """How the operator scales drafter pools against verifier throughput."""

    SPEC_PATH: ClassVar[str] = "spec.autoscaling"
    enabled: bool = spec_field("enabled", True)
    interval_s: int = spec_field("intervalSeconds", 30, minimum=1, maximum=3600)
    stabilization_s: int = spec_field("stabilizationSeconds", 120, minimum=0, maximum=86400)
    # busy fraction of a drafter pool's replicas to aim at, were they to serve all its demand
    target_drafter_utilization: float = spec_field("targetDrafterUtilization", 0.7, minimum=0.05, maximum=1)
    # the objective: what a million accepted draft tokens are worth, USD; with the pools'
    # pricePerHourUsd a replica is added only while what it adds is worth its price (0: not weighed)
    accepted_token_value_per_million_usd: float = spec_field("acceptedTokenValuePerMillionUsd", 0.0, minimum=0)
    max_scale_down_step: int = spec_field("maxScaleDownStep", 1, minimum=1)  # replicas per pool per decision
    prometheus_url: str | None = spec_field("prometheusUrl", None)


@dataclass(frozen=True)
class ApiKeySecretRef(Checked):
    """``spec.gateway.apiKeySecretRef``: the Secret key holding the API key the verifier's OpenAI server
    requires (passed to verifier pods as ``COSINE_API_KEY``)."""

    SPEC_PATH: ClassVar[str] = "spec.gateway.apiKeySecretRef"
    name: str = spec_field("name")
    key: str = spec_field("key")


@dataclass(frozen=True)
class HfTokenSecretRef(ApiKeySecretRef):
    """``spec.hfTokenSecretRef``: the Secret key holding a Hugging Face token, for gated or private
    models; it reaches only the containers that download models, as ``HF_TOKEN``."""

    SPEC_PATH: ClassVar[str] = "spec.hfTokenSecretRef"


@dataclass(frozen=True)
class ModelCredentialsSecretRef(Checked):
    """``spec.modelCredentialsSecretRef``: a Secret whose keys are the object stores' credentials, as
    their SDKs read them (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
    ``AWS_REGION``, ``AWS_ENDPOINT_URL_S3`` for s3://; ``GOOGLE_APPLICATION_CREDENTIALS`` for
    gs://). It reaches only the containers that download models: every key as an environment
    variable, and the Secret mounted read-only at ``MODEL_CREDENTIALS_DIR`` for what an SDK reads
    from a file (a GCS service-account key: ``GOOGLE_APPLICATION_CREDENTIALS`` set to
    ``MODEL_CREDENTIALS_DIR/<key>``)."""

    SPEC_PATH: ClassVar[str] = "spec.modelCredentialsSecretRef"
    name: str = spec_field("name")



@dataclass(frozen=True)
class ModelCacheSpec(Checked):
    """``spec.modelCache``: the models on a PersistentVolumeClaim, downloaded once by a Job
    (``cosine models pull``) before any pod starts, then mounted read-only by every pod: scale-ups
    and restarts download nothing. ``claim_name``: an existing claim (it must allow as many nodes
    as will mount it, e.g. ReadWriteMany or ReadOnlyMany); ``None``: the operator creates one,
    ``N-models``, of ``size`` on ``storage_class_name`` (``None``: the cluster's default class)
    with ``access_mode``, deleted with the cluster. Without ``spec.modelCache`` each pod downloads
    its models into an ``emptyDir`` at start (small models)."""

    SPEC_PATH: ClassVar[str] = "spec.modelCache"
    claim_name: str | None = spec_field("claimName", None)
    storage_class_name: str | None = spec_field("storageClassName", None)
    size: str = spec_field("size", "100Gi")
    access_mode: str = spec_field("accessMode", "ReadWriteMany", enum=("ReadWriteMany", "ReadWriteOnce"))
    # the claim already holds every model (filled by another cluster's pull, or by the team's own
    # copy): no pull Job, the pods read the claim as it is. Needs claimName: a new claim is empty
    pre_populated: bool = spec_field("prePopulated", False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pre_populated and not self.claim_name:
            raise ValueError("spec.modelCache.prePopulated needs spec.modelCache.claimName: the claim that holds "
                             "the models (a claim the operator creates starts empty)")


@dataclass(frozen=True)
class GatewaySpec(Checked):
    """``spec.gateway``: the OpenAI-compatible front door, a Service (``N-gateway``) onto the verifier pods'
    port 8000. ``annotations``, ``load_balancer_source_ranges`` and ``load_balancer_class`` go to
    the Service as written (an internal or restricted load balancer); the last two only with
    ``serviceType: LoadBalancer``."""

    SPEC_PATH: ClassVar[str] = "spec.gateway"
    service_type: str = spec_field("serviceType", "ClusterIP", enum=("ClusterIP", "NodePort", "LoadBalancer"))
    port: int = spec_field("port", 8000, minimum=1, maximum=65535)
    # the Service's metadata.annotations, as written: what a cloud's load-balancer controller
    # reads (an internal load balancer: GKE's networking.gke.io/load-balancer-type: Internal,
    # the AWS Load Balancer Controller's service.beta.kubernetes.io/aws-load-balancer-scheme)
    annotations: Mapping[str, str] = spec_field("annotations", default_factory=dict, verbatim=True)
    # Service.spec.loadBalancerSourceRanges: the client CIDRs a LoadBalancer admits (empty: any)
    load_balancer_source_ranges: tuple[str, ...] = spec_field("loadBalancerSourceRanges", (), verbatim=True)
    # Service.spec.loadBalancerClass: which controller implements the LoadBalancer (e.g. the AWS
    # Load Balancer Controller's service.k8s.aws/nlb); None: the cloud's default
    load_balancer_class: str | None = spec_field("loadBalancerClass", None, verbatim=True)
    # spec.gateway.apiKeySecretRef (None: no authentication)
    api_key_secret: ApiKeySecretRef | None = field(default=None, metadata={"key": "apiKeySecretRef"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, value in (("loadBalancerSourceRanges", self.load_balancer_source_ranges),
                           ("loadBalancerClass", self.load_balancer_class)):
            if value and self.service_type != "LoadBalancer":
                raise ValueError(f"spec.gateway.{key} needs spec.gateway.serviceType: LoadBalancer "
                                 f"(got {self.service_type})")


@dataclass(frozen=True)
class NetworkPolicySpec(Checked):
    """``spec.networkPolicy``: the NetworkPolicies the operator creates for the cluster's pods.

    ``enabled``: create them (``False``: the operator deletes the ones it made on the next
    reconcile). ``metrics_from``: Kubernetes ``NetworkPolicyPeer`` objects, verbatim, allowed to
    the metrics ports instead of every pod of the cluster's namespace (the operator's own pods are
    always allowed: its autoscaler scrapes them).
    """

    SPEC_PATH: ClassVar[str] = "spec.networkPolicy"
    enabled: bool = spec_field("enabled", True)
    metrics_from: tuple[Mapping[str, Any], ...] = spec_field("metricsFrom", (), verbatim=True)


@dataclass(frozen=True)
class DrafterTLSSpec(Checked):
    """``spec.drafterTLS``: TLS on the drafters' gRPC service from a ``kubernetes.io/tls`` Secret
    (``tls.crt``, ``tls.key``, ``ca.crt``) mounted into drafter and verifier pods.

    ``server_name``: the name the verifier checks the drafters' certificate against; ``None``:
    each pool's Service DNS name (``N-drafter-P.NS.svc``, or a ``*.NS.svc`` wildcard SAN).
    """

    SPEC_PATH: ClassVar[str] = "spec.drafterTLS"
    secret_name: str = spec_field("secretName")
    server_name: str | None = spec_field("serverName", None)


# The endpoint picker the router runs by default: llm-d's (the Gateway API Inference Extension's
# reference EPP now lives in llm-d/llm-d-router), a release tag. Override: spec.router.endpointPickerImage.
ENDPOINT_PICKER_IMAGE = "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0"
ENDPOINT_PICKER_FAILURE_MODES = ("FailOpen", "FailClose")
ROUTER_PROVIDERS = ("none", "gke", "istio")


@dataclass(frozen=True)
class RouterWeights(Checked):
    """``spec.router.weights``: each scorer's weight in the endpoint picker's sum (0 leaves it out).
    ``prefixCache``: the share of the prompt's prefix blocks a replica has served (its KV cache);
    ``sessionAffinity``: the replica that served the session's last request; ``suffixAffinity``:
    CoSine's ``cosine_suffix_tree_hit_rate`` gauge (how often the replica's suffix tree drafts from
    what it has seen); ``queue``: fewer waiting requests; ``kvCacheUtilization``: more free KV cache."""

    SPEC_PATH: ClassVar[str] = "spec.router.weights"
    prefix_cache: float = spec_field("prefixCache", 3.0, minimum=0)
    # 0 by default: its scorer is alpha at the pinned tag (the picker then needs
    # --allow-experimental-plugins), and it works only for clients that send back the
    # x-session-token header it sets (base64 of namespace/pod: it names the pods); OpenAI's
    # SDKs never do
    session_affinity: float = spec_field("sessionAffinity", 0.0, minimum=0)
    # 0 by default: measured to add nothing (docs/simulation.md, "Several verifiers"): a
    # conversation's history is in its prompt, which prompt lookup indexes on any replica
    suffix_affinity: float = spec_field("suffixAffinity", 0.0, minimum=0)
    queue: float = spec_field("queue", 1.0, minimum=0)
    kv_cache_utilization: float = spec_field("kvCacheUtilization", 1.0, minimum=0)


@dataclass(frozen=True)
class RouterSpec(Checked):
    """``spec.router``: cache-affine routing through the Gateway API Inference Extension. With
    ``enabled`` the operator creates an ``InferencePool`` of the verifier pods, an endpoint picker
    (EPP) scoring them (:class:`RouterWeights`) and an ``HTTPRoute`` from the user's Gateway
    ``gateway_name`` (in ``gateway_namespace``, default the cluster's) to the pool. ``failure_mode``:
    what the gateway does when the EPP does not answer (``FailOpen`` by default, as llm-d's chart:
    the gateway picks a verifier itself, which serves the same model, only less cache-affinely;
    ``FailClose``, GIE's API default: the request fails). ``image``/``replicas``: the EPP's;
    ``resources``/``node_selector``/``tolerations``: its pods' (Kubernetes' own types; empty
    resources: the operator's default, which fits an 8-vCPU node). ``gateway_from``: who may call
    the EPP (the Gateway's proxies; their labels are the implementation's), as
    ``NetworkPolicyPeer`` objects; empty: anyone."""

    SPEC_PATH: ClassVar[str] = "spec.router"
    enabled: bool = spec_field("enabled", False)
    gateway_name: str | None = spec_field("gatewayName", None)
    gateway_namespace: str | None = spec_field("gatewayNamespace", None)
    failure_mode: str = spec_field("failureMode", "FailOpen", enum=ENDPOINT_PICKER_FAILURE_MODES)
    image: str = spec_field("endpointPickerImage", ENDPOINT_PICKER_IMAGE)
    replicas: int = spec_field("endpointPickerReplicas", 1, minimum=1, maximum=16)
    resources: Mapping[str, Any] = spec_field("endpointPickerResources", default_factory=dict, verbatim=True)
    node_selector: Mapping[str, str] = spec_field("endpointPickerNodeSelector", default_factory=dict, verbatim=True)
    tolerations: tuple[Mapping[str, Any], ...] = spec_field("endpointPickerTolerations", (), verbatim=True)
    # NetworkPolicyPeers of the Gateway's proxies, allowed to the EPP's ext_proc port (empty: any)
    gateway_from: tuple[Mapping[str, Any], ...] = spec_field("gatewayFrom", (), verbatim=True)
    weights: RouterWeights = field(default_factory=RouterWeights, metadata={"key": "weights"})
    # the Gateway's implementation, for the objects it needs beside the route: gke adds GKE's
    # GCPBackendPolicy and HealthCheckPolicy on the pool and opens the picker's gRPC health port
    # to GKE's health checkers; istio adds the DestinationRule through which Istio's gateway
    # speaks TLS to the picker (ROUTER_PROVIDERS)
    provider: str = spec_field("provider", "none", enum=ROUTER_PROVIDERS)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.enabled and not self.gateway_name:
            raise ValueError("spec.router.gatewayName is required when spec.router.enabled is true: the "
                             "Gateway whose HTTPRoute sends requests to the verifiers")


@dataclass(frozen=True)
class ClusterSpec:
    """A whole ``CoSineCluster.spec``, parsed once (:func:`parse_cluster_spec`) and passed around.

    ``raw``: the spec as written (a plain deep copy): what the runtime reads from its ConfigMap and
    what the pods' config hash is taken of. Not to be mutated.
    """

    verifier: VerifierSpec = field(metadata={"key": "verifier"})
    drafter_pools: tuple[DrafterPoolSpec, ...] = field(metadata={"key": "drafterPools"})
    image: ImageSpec = field(default_factory=ImageSpec, metadata={"key": "image"})
    speculation: SpeculationSpec = field(default_factory=SpeculationSpec, metadata={"key": "speculation"})
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec, metadata={"key": "autoscaling"})
    gateway: GatewaySpec = field(default_factory=GatewaySpec, metadata={"key": "gateway"})
    network_policy: NetworkPolicySpec = field(default_factory=NetworkPolicySpec, metadata={"key": "networkPolicy"})
    # spec.drafterTLS (None: plain gRPC between the verifier and the drafters)
    drafter_tls: DrafterTLSSpec | None = field(default=None, metadata={"key": "drafterTLS"})
    # spec.modelCache (None: each pod downloads its models into an emptyDir)
    model_cache: ModelCacheSpec | None = field(default=None, metadata={"key": "modelCache"})
    # spec.hfTokenSecretRef (None: anonymous downloads)
    hf_token: HfTokenSecretRef | None = field(default=None, metadata={"key": "hfTokenSecretRef"})
    # spec.modelCredentialsSecretRef (None: the object stores' own defaults, e.g. the pod's workload identity)
    model_credentials: ModelCredentialsSecretRef | None = field(default=None,
                                                                metadata={"key": "modelCredentialsSecretRef"})
    # spec.spot (None: no pool may ask for spot capacity)
    spot: SpotSpec | None = field(default=None, metadata={"key": "spot"})
    router: RouterSpec = field(default_factory=RouterSpec, metadata={"key": "router"})
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def pool(self, name: str) -> DrafterPoolSpec:
        """The pool named ``name`` (``KeyError`` if absent)."""
        for pool in self.drafter_pools:
            if pool.name == name:
                return pool
        raise KeyError(name)


def _with_pod(cls: type, raw: Mapping[str, Any]) -> Any:
    role = getattr(cls, "SPEC_PATH", "spec")
    pod_keys = spec_keys(PodOverrides)
    try:
        image = read_fields(RoleImage, raw.get("image") or {})
        pod = read_fields(PodOverrides, {k: v for k, v in raw.items() if k in pod_keys})
    except ValueError as e:  # name the role: spec.verifier.image.tag, spec.drafterPools[].resources
        raise ValueError(str(e).replace("spec.<role>", role, 1)) from None
    if cls is VerifierSpec:
        parallelism = read_fields(ParallelismSpec, raw.get("parallelism") or {})
        sp = raw.get("speculator")
        speculator = read_fields(SpeculatorSpec, sp) if sp is not None else None
        rollout = read_fields(RolloutSpec, raw.get("rollout") or {})
        return read_fields(cls, raw, pod=pod, image=image, parallelism=parallelism, speculator=speculator,
                           rollout=rollout)
    return read_fields(cls, raw, pod=pod, image=image)


def parse_cluster_spec(spec: Mapping[str, Any]) -> ClusterSpec:
    """Map a (possibly not defaulted) ``spec`` mapping onto :class:`ClusterSpec`.

    Raises ``ValueError`` (its message starts with the offending field's path, e.g.
    ``spec.drafterPools[1].replicas``) on a spec the CRD schema would have rejected: a missing
    required field, a wrong type, a value out of bounds or not in its enum, no drafter pool.
    """
    if not isinstance(spec, Mapping):
        raise ValueError(f"spec must be a mapping, got {type(spec).__name__}")
    raw = json.loads(json.dumps(dict(spec)))  # plain deep copy
    refuse_unknown("spec", raw, spec_keys(ClusterSpec))
    if not isinstance(raw.get("verifier"), Mapping):
        raise ValueError("spec.verifier is required")
    verifier = _with_pod(VerifierSpec, raw["verifier"])
    pools = []
    for i, p in enumerate(raw.get("drafterPools") or ()):
        try:
            pools.append(_with_pod(DrafterPoolSpec, p))
        except ValueError as e:
            raise ValueError(str(e).replace("spec.drafterPools[]", f"spec.drafterPools[{i}]", 1)) from None
    if not pools:
        raise ValueError("spec.drafterPools must name at least one pool")
    spot = read_fields(SpotSpec, raw["spot"]) if raw.get("spot") is not None else None
    for i, pool in enumerate(pools):
        if pool.capacity == "spot" and spot is None:
            raise ValueError(f"spec.spot.provider is required: spec.drafterPools[{i}] ({pool.name}) asks for "
                             f"capacity: spot (one of {list(SPOT_PROVIDERS)})")
    r = raw.get("router") or {}
    router = read_fields(RouterSpec, r, weights=read_fields(RouterWeights, r.get("weights") or {}))
    g = raw.get("gateway") or {}
    secret = g.get("apiKeySecretRef")
    gateway = read_fields(GatewaySpec, g, api_key_secret=read_fields(ApiKeySecretRef, secret) if secret else None)
    return ClusterSpec(
        verifier,
        tuple(pools),
        image=read_fields(ImageSpec, raw.get("image") or {}),
        speculation=read_fields(SpeculationSpec, raw.get("speculation") or {}),
        autoscaling=read_fields(AutoscalingSpec, raw.get("autoscaling") or {}),
        gateway=gateway,
        network_policy=read_fields(NetworkPolicySpec, raw.get("networkPolicy") or {}),
        drafter_tls=read_fields(DrafterTLSSpec, raw["drafterTLS"]) if raw.get("drafterTLS") else None,
        model_cache=read_fields(ModelCacheSpec, raw["modelCache"]) if raw.get("modelCache") is not None else None,
        hf_token=read_fields(HfTokenSecretRef, raw["hfTokenSecretRef"]) if raw.get("hfTokenSecretRef") else None,
        model_credentials=(read_fields(ModelCredentialsSecretRef, raw["modelCredentialsSecretRef"])
                           if raw.get("modelCredentialsSecretRef") else None),
        spot=spot,
        router=router,
        raw=raw,
    )
