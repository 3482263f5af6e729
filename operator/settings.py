"""Typed views of a ``CoSineCluster`` spec and of the operator's own configuration.

The CRD (``crds/cosine.dev_cosineclusters.yaml``) is the one source of truth for the spec's shape
and defaults; the API server applies them. These dataclasses repeat the defaults only so that the
operator behaves the same on a server that did not default (the test emulator, an old object),
and ``tests/operator/test_settings.py`` checks that every default here equals the CRD's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GROUP = "cosine.dev"
VERSION = "v1alpha1"
CLUSTER_PLURAL = "cosineclusters"
POOL_PLURAL = "cosinedrafterpools"
CLUSTER_KIND = "CoSineCluster"
POOL_KIND = "CoSineDrafterPool"

# Port numbers of the runtime contract (see the runtime's CLI).
VERIFIER_HTTP_PORT = 8000  # vLLM's OpenAI server: the API, /health and /metrics (vllm: series)
VERIFIER_METRICS_PORT = 9091  # CoSine's proposer in vLLM's engine core: cosine: series (the autoscaler's)
VERIFIER_GRPC_PORT = 50051
DRAFTER_GRPC_PORT = 50052
DRAFTER_METRICS_PORT = 9090

GPU_RESOURCE = "nvidia.com/gpu"
DRAFTER_ENGINES = ("llamacpp", "vllm")  # spec.drafterPools[].engine, the CRD's enum
MAX_DRAFT_LEN = 32  # spec.speculation.maxDraftLen's maximum in the CRD


@dataclass(frozen=True)
class ImageSpec:
    """The runtime image the verifier and drafter pods run (``cosine`` entrypoint; the operator has its own)."""

    repository: str = "ghcr.io/cosine-project/cosine"
    tag: str = "0.1.0"
    pull_policy: str = "IfNotPresent"

    @property
    def reference(self) -> str:
        """``repository:tag``."""
        return f"{self.repository}:{self.tag}"


@dataclass(frozen=True)
class PodOverrides:
    """Scheduling and environment overrides copied verbatim into a pod template."""

    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    env: tuple[Mapping[str, Any], ...] = ()

    @property
    def requests_gpu(self) -> bool:
        """Whether the container asks for ``nvidia.com/gpu`` (in its limits or its requests)."""
        return any(GPU_RESOURCE in (self.resources.get(k) or {}) for k in ("limits", "requests"))


@dataclass(frozen=True)
class VerifierSpec:
    """The target model's pods: gateway, coordinator and batched verifier."""

    model: str
    tokenizer: str | None = None
    dtype: str = "float32"
    replicas: int = 1
    threads: int = 1  # CPU cores for the engine's threads (vLLM's OpenMP threads on CPU nodes)
    max_batch_tokens: int = 512  # vLLM max_num_batched_tokens
    max_model_len: int | None = None  # vLLM max_model_len (None: the model's)
    max_num_seqs: int | None = None  # vLLM max_num_seqs (None: vLLM's default)
    gpu_memory_utilization: float | None = None  # GPU pods (None: vLLM's default)
    kv_cache_space_gib: float | None = None  # CPU pods: VLLM_CPU_KVCACHE_SPACE (None: 4)
    pod: PodOverrides = field(default_factory=PodOverrides)

    @property
    def tokenizer_family(self) -> str:
        """The declared tokenizer, or the model name when none is declared."""
        return self.tokenizer or self.model


@dataclass(frozen=True)
class DrafterPoolSpec:
    """One pool of identical drafter pods (a model drafter or a model-free n-gram drafter).

    ``engine``: the model drafter's inference engine as written in the spec (``llamacpp``,
    ``vllm``), ``None`` when unset; :attr:`resolved_engine` applies the default.
    """

    name: str
    kind: str = "model"
    model: str | None = None
    engine: str | None = None
    tokenizer: str | None = None
    translate_tokenizer: bool = False
    expertise: tuple[str, ...] = ()
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 4
    threads: int = 1  # CPU threads of the drafter engine (llama.cpp n_threads)
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


@dataclass(frozen=True)
class SpeculationSpec:
    """``spec.speculation``: how the verifier's proposer asks pools for drafts.

    ``max_draft_len``: most tokens drafted per request per step (k), ``0..MAX_DRAFT_LEN``; 0 turns
    speculation off. ``adaptive``: choose k per request from measured acceptance and verifier load
    (else always ``max_draft_len``). ``fusion``: when the router expects two or more pools to pay
    for a request's domain, they all draft and their chains are fused by confidence per position;
    ``False``: one pool per request. ``min_confidence``: a pool's drafter stops a draft at the first
    token whose top-1 probability is below this, ``0..1`` (0 never stops early).
    """

    max_draft_len: int = 8
    adaptive: bool = True
    fusion: bool = True
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.max_draft_len <= MAX_DRAFT_LEN:
            raise ValueError(f"spec.speculation.maxDraftLen must be in [0, {MAX_DRAFT_LEN}], got {self.max_draft_len}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"spec.speculation.minConfidence must be in [0, 1], got {self.min_confidence}")


@dataclass(frozen=True)
class AutoscalingSpec:
    """How the operator scales drafter pools against verifier throughput."""

    enabled: bool = True
    interval_s: int = 30
    stabilization_s: int = 120
    target_drafter_utilization: float = 0.7  # busy fraction of a drafter pool's pods, 0..1
    max_scale_down_step: int = 1  # replicas removed per pool per decision, at most
    prometheus_url: str | None = None


@dataclass(frozen=True)
class GatewaySpec:
    """The OpenAI-compatible front door's Service."""

    service_type: str = "ClusterIP"
    port: int = 8000
    api_key_secret_name: str | None = None
    api_key_secret_key: str | None = None


@dataclass(frozen=True)
class ClusterSpec:
    """A whole ``CoSineCluster.spec``."""

    verifier: VerifierSpec
    drafter_pools: tuple[DrafterPoolSpec, ...]
    image: ImageSpec = field(default_factory=ImageSpec)
    speculation: SpeculationSpec = field(default_factory=SpeculationSpec)
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    gateway: GatewaySpec = field(default_factory=GatewaySpec)

    def pool(self, name: str) -> DrafterPoolSpec:
        """The pool named ``name`` (``KeyError`` if absent)."""
        for pool in self.drafter_pools:
            if pool.name == name:
                return pool
        raise KeyError(name)


def _pod(raw: Mapping[str, Any]) -> PodOverrides:
    return PodOverrides(
        resources=dict(raw.get("resources") or {}),
        node_selector=dict(raw.get("nodeSelector") or {}),
        tolerations=tuple(raw.get("tolerations") or ()),
        affinity=dict(raw.get("affinity") or {}),
        env=tuple(raw.get("env") or ()),
    )


def _opt(raw: Mapping[str, Any], key: str, kind: type) -> Any:
    value = raw.get(key)
    return None if value is None else kind(value)


def parse_cluster_spec(spec: Mapping[str, Any]) -> ClusterSpec:
    """Map a (possibly not defaulted) ``spec`` dict onto :class:`ClusterSpec`.

    Raises ``KeyError``/``ValueError`` on a spec the CRD schema would have rejected.
    """
    v = spec["verifier"]
    verifier = VerifierSpec(
        model=v["model"],
        tokenizer=v.get("tokenizer"),
        dtype=v.get("dtype", VerifierSpec.dtype),
        replicas=int(v.get("replicas", VerifierSpec.replicas)),
        threads=int(v.get("threads", VerifierSpec.threads)),
        max_batch_tokens=int(v.get("maxBatchTokens", VerifierSpec.max_batch_tokens)),
        max_model_len=_opt(v, "maxModelLen", int),
        max_num_seqs=_opt(v, "maxNumSeqs", int),
        gpu_memory_utilization=_opt(v, "gpuMemoryUtilization", float),
        kv_cache_space_gib=_opt(v, "kvCacheSpaceGiB", float),
        pod=_pod(v),
    )
    pools = tuple(
        DrafterPoolSpec(
            name=p["name"],
            kind=p.get("kind", DrafterPoolSpec.kind),
            model=p.get("model"),
            engine=p.get("engine"),
            tokenizer=p.get("tokenizer"),
            translate_tokenizer=bool(p.get("translateTokenizer", DrafterPoolSpec.translate_tokenizer)),
            expertise=tuple(p.get("expertise") or ()),
            replicas=int(p.get("replicas", DrafterPoolSpec.replicas)),
            min_replicas=int(p.get("minReplicas", DrafterPoolSpec.min_replicas)),
            max_replicas=int(p.get("maxReplicas", DrafterPoolSpec.max_replicas)),
            threads=int(p.get("threads", DrafterPoolSpec.threads)),
            pod=_pod(p),
        )
        for p in spec.get("drafterPools") or ()
    )
    if not pools:
        raise ValueError("spec.drafterPools must name at least one pool")
    img = spec.get("image") or {}
    image = ImageSpec(
        repository=img.get("repository", ImageSpec.repository),
        tag=str(img.get("tag", ImageSpec.tag)),
        pull_policy=img.get("pullPolicy", ImageSpec.pull_policy),
    )
    sp = spec.get("speculation") or {}
    speculation = SpeculationSpec(
        max_draft_len=int(sp.get("maxDraftLen", SpeculationSpec.max_draft_len)),
        adaptive=bool(sp.get("adaptive", SpeculationSpec.adaptive)),
        fusion=bool(sp.get("fusion", SpeculationSpec.fusion)),
        min_confidence=float(sp.get("minConfidence", SpeculationSpec.min_confidence)),
    )
    a = spec.get("autoscaling") or {}
    autoscaling = AutoscalingSpec(
        enabled=bool(a.get("enabled", AutoscalingSpec.enabled)),
        interval_s=int(a.get("intervalSeconds", AutoscalingSpec.interval_s)),
        stabilization_s=int(a.get("stabilizationSeconds", AutoscalingSpec.stabilization_s)),
        target_drafter_utilization=float(
            a.get("targetDrafterUtilization", AutoscalingSpec.target_drafter_utilization)
        ),
        max_scale_down_step=int(a.get("maxScaleDownStep", AutoscalingSpec.max_scale_down_step)),
        prometheus_url=a.get("prometheusUrl"),
    )
    g = spec.get("gateway") or {}
    secret = g.get("apiKeySecretRef") or {}
    gateway = GatewaySpec(
        service_type=g.get("serviceType", GatewaySpec.service_type),
        port=int(g.get("port", GatewaySpec.port)),
        api_key_secret_name=secret.get("name"),
        api_key_secret_key=secret.get("key"),
    )
    return ClusterSpec(
        verifier, pools, image=image, speculation=speculation, autoscaling=autoscaling, gateway=gateway
    )


@dataclass(frozen=True)
class OperatorConfig:
    """The operator process's own settings (chart values → container env), read once at start-up.

    ``webhook_port``: where the validating admission webhook listens (HTTPS), ``None`` = off.
    ``webhook_cert_dir``: ``tls.crt``/``tls.key`` for it (cert-manager or the chart's self-signed
    secret); empty = kopf generates a self-signed pair. ``webhook_insecure``: plain HTTP (tests).
    ``metrics_port``: the operator's Prometheus endpoint, ``None`` = off.
    ``scrape_timeout_s``: per-pod ``/metrics`` request timeout.
    ``tick_s``: how often the per-cluster autoscaler timer wakes; each cluster is then scraped
    every ``spec.autoscaling.intervalSeconds``.
    """

    webhook_port: int | None = None
    webhook_cert_dir: str = ""
    webhook_insecure: bool = False
    metrics_port: int | None = None
    scrape_timeout_s: float = 2.0
    tick_s: float = 1.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorConfig:
        """Read ``COSINE_OPERATOR_*`` variables (the chart sets them); absent means default."""

        def opt_int(key: str) -> int | None:
            value = env.get(key, "")
            return int(value) if value else None

        return cls(
            webhook_port=opt_int("COSINE_OPERATOR_WEBHOOK_PORT"),
            webhook_cert_dir=env.get("COSINE_OPERATOR_WEBHOOK_CERT_DIR", ""),
            webhook_insecure=env.get("COSINE_OPERATOR_WEBHOOK_INSECURE", "") in ("1", "true"),
            metrics_port=opt_int("COSINE_OPERATOR_METRICS_PORT"),
            scrape_timeout_s=float(env.get("COSINE_OPERATOR_SCRAPE_TIMEOUT_S", "2.0")),
        )
