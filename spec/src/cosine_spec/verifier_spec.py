"""``spec.verifier``: the target model's pods (vLLM with CoSine's proposer), their parallelism and
the engine's own drafter, with the checks of what the spec alone shows cannot run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from cosine_spec.contract import GPU_RESOURCE
from cosine_spec.pods import PodOverrides, RoleImage
from cosine_spec.schema import Checked, spec_field


@dataclass(frozen=True)
class ParallelismSpec(Checked):
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


# spec.verifier.speculator.method -> vLLM's speculative_config method: the drafters vLLM 0.32 runs
# inside the engine for the target on its GPU runner (Model Runner V2), where CoSine composes them
# (`cosine.vllm_mrv2`). Not admitted: medusa and mlp_speculator (vLLM runs them on the V1 runner
# only: `VllmConfig._get_v2_model_runner_unsupported_features`), ngram, ngram_gpu and suffix (prompt
# lookup, which CoSine runs itself), custom_class and extract_hidden_states (no drafter).
SPECULATOR_METHODS = {"eagle3": "eagle3", "eagle": "eagle", "mtp": "mtp", "draftModel": "draft_model",
                      "dflash": "dflash", "dspark": "dspark"}


@dataclass(frozen=True)
class SpeculatorSpec(Checked):
    """``spec.verifier.speculator``: the engine's own drafter, run by vLLM inside the verifier
    (``eagle3``: a trained EAGLE-3 head; ``eagle``: an EAGLE-1/2 head; ``mtp``: the target's own
    multi-token-prediction layers; ``draftModel``: a small model sharing the target's vocabulary;
    ``dflash``, ``dspark``: vLLM's parallel drafters, run on its GPU runner only). CoSine takes its draft per
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
class RolloutSpec(Checked):
    """``spec.verifier.rollout``: how a change of the verifier's pods rolls. ``max_surge``: verifier
    replicas (pods; groups of a multi-node verifier) a roll may start beyond ``replicas`` before an
    old one goes; from 1 none is taken down before its successor is Ready (``maxUnavailable`` 0), which
    needs a node pool that can add a node (an autoscaled or spare GPU node). ``None``: the default,
    which surges no GPU pod (a new pod takes the old one's GPU) and so takes a lone GPU verifier
    down for a whole model load on every roll (the admission webhook warns)."""

    SPEC_PATH: ClassVar[str] = "spec.verifier.rollout"
    max_surge: int | None = spec_field("maxSurge", None, minimum=0)


@dataclass(frozen=True)
class VerifierSpec(Checked):
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
    rollout: RolloutSpec = field(default_factory=RolloutSpec, metadata={"key": "rollout"})
    pod: PodOverrides = field(default_factory=PodOverrides)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollout.max_surge is not None and self.pod.strategy:
            raise ValueError("spec.verifier.rollout.maxSurge and spec.verifier.strategy: set one (strategy is the "
                             "Deployment's as written; rollout.maxSurge also rolls a multi-node verifier's groups)")

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


# vLLM flags CoSine sets itself, which `spec.verifier.engineArgs` may not, each with what sets it
# instead: vllm/engine/arg_utils.py's names and their aliases (tests/test_roles.py checks the list
# against vLLM's own parser); `--config` reads any of them from a file.
_SPECULATION = "spec.speculation and spec.verifier.speculator set it"
_SEAM = "it is how CoSine's proposer enters vLLM's engine"
_GPU_SHARE = "spec.verifier.gpuMemoryUtilization sets it"
_TENSOR = "spec.verifier.parallelism.tensor sets it"
_PIPELINE = "spec.verifier.parallelism.pipeline sets it"
_NODES = "spec.verifier.parallelism.nodes sets it (vLLM's multi-node mode)"
_ADDRESS = "`cosine verifier --http-port/--host` set it (in a pod: the operator)"
RESERVED_ENGINE_ARGS: dict[str, str] = {
    "--speculative-config": _SPECULATION, "-sc": _SPECULATION,
    "--scheduler-cls": _SEAM, "--additional-config": _SEAM, "--async-scheduling": _SEAM,
    "--no-async-scheduling": _SEAM, "--worker-cls": _SEAM,
    "--port": _ADDRESS, "--host": _ADDRESS,
    "--model": "spec.verifier.model sets it", "--dtype": "spec.verifier.dtype sets it",
    "--max-num-batched-tokens": "spec.verifier.maxBatchTokens sets it",
    "--max-model-len": "spec.verifier.maxModelLen sets it", "--max-num-seqs": "spec.verifier.maxNumSeqs sets it",
    "--gpu-memory-utilization": _GPU_SHARE, "--device-memory-utilization": _GPU_SHARE,
    "--tensor-parallel-size": _TENSOR, "-tp": _TENSOR, "--pipeline-parallel-size": _PIPELINE, "-pp": _PIPELINE,
    "--nnodes": _NODES, "-n": _NODES, "--node-rank": _NODES, "-r": _NODES, "--master-addr": _NODES,
    "--master-port": _NODES, "--headless": _NODES,
    "--api-key": "spec.gateway.apiKeySecretRef sets it",
    "--config": "a config file can set any flag CoSine sets; give its flags here one by one",
}


def vllm_flag(arg: str) -> str | None:
    """The option an engine argument names, as vLLM 0.32's parser reads it
    (``FlexibleArgumentParser.parse_args``): ``--flag=value`` is ``--flag``, underscores in a
    ``--`` name are dashes, ``--flag.key value`` (and ``--flag.key+``) sets a field of ``--flag``'s
    JSON. None for a value (not starting with ``-``, or a negative number)."""
    if not arg.startswith("-") or arg[1:2].isdigit() or arg[1:2] in ("", "."):
        return None
    name = arg.split("=", 1)[0].split(".", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def reserved_flag(flag: str) -> str | None:
    """The flag of ``RESERVED_ENGINE_ARGS`` that ``flag`` (a ``vllm_flag``) reaches, or None:
    itself; a prefix of one (argparse takes an unambiguous prefix of an option, ``allow_abbrev``);
    ``-nVALUE`` (a one-letter option with its value attached)."""
    if flag in RESERVED_ENGINE_ARGS:
        return flag
    long = flag.startswith("--")
    if len(flag) > (2 if long else 1):
        hit = next((r for r in RESERVED_ENGINE_ARGS if r.startswith("--") == long and r.startswith(flag)), None)
        if hit is not None:
            return hit
    return flag[:2] if not long and flag[:2] in RESERVED_ENGINE_ARGS else None


def engine_args_problems(verifier: VerifierSpec) -> list[str]:
    """``spec.verifier.engineArgs`` entries that set a flag CoSine sets itself
    (``RESERVED_ENGINE_ARGS``) in any spelling vLLM reads (``vllm_flag``, ``reserved_flag``), one
    message per entry naming its index and what sets the flag instead. vLLM takes a flag's last
    value, so such an entry would silently replace CoSine's. The admission webhook, the operator's
    reconcile (an install without the webhook) and every runtime command that reads a manifest
    (``cosine serve``, ``cosine verifier``) run this check."""
    problems = []
    for i, arg in enumerate(verifier.engine_args):
        flag = vllm_flag(arg)
        hit = reserved_flag(flag) if flag else None
        if hit is not None:
            read = "" if arg == hit else f" (vLLM reads {arg!r} as {hit})"
            problems.append(f"spec.verifier.engineArgs[{i}]: {hit} is set by CoSine{read}: "
                            f"{RESERVED_ENGINE_ARGS[hit]}")
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
