"""vLLM-CPU's worker with its speculative sampling repaired, on every speculative path.

vLLM builds the worker (`WorkerWrapperBase.init_worker`) after the platform registered its kernel
overrides, so the check in `vllm_hooks.ensure_lossless_cpu_sampling` sees the kernel the rejection
sampler will run (vllm-project/vllm#55005). Imported only inside vLLM-CPU's worker processes,
by name (`vllm_hooks.LOSSLESS_CPU_WORKER`, vLLM's `worker_cls` engine argument).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from cosine.vllm_hooks import ensure_lossless_cpu_sampling
from cosine.vllm_mrv2 import MRV2SeamWorker


class LosslessCPUWorker(MRV2SeamWorker, CPUWorker):
    """`CPUWorker`, then `ensure_lossless_cpu_sampling()` (a no-op once vLLM's kernel is right);
    with the MRV2 seam composed where vLLM built its GPU runner (`mrv2_harness`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ensure_lossless_cpu_sampling()
