"""vLLM's GPU worker with CoSine's MRV2 seam (`vllm_mrv2.MRV2SeamWorker`): the speculator composed
after the model loads. Imported by name only inside vLLM's worker processes
(`vllm_hooks.GPU_WORKER`, vLLM's `worker_cls` engine argument).
"""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from cosine.vllm_mrv2 import MRV2SeamWorker


class CoSineGPUWorker(MRV2SeamWorker, Worker):
    """vLLM's `Worker` with the MRV2 seam."""
