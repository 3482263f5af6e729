"""The vLLM seams CoSine hooks into are the ones we wrote against (fails loudly on a vLLM upgrade).

`vllm_hooks` depends on: the `custom_class` proposer's call shape, `Scheduler.schedule`,
`update_from_output`, `update_draft_token_ids`, `DraftTokenIds`, the `Request` fields it reads,
the engine core's `post_step` calling `update_draft_token_ids` (synchronous scheduling), and
`additional_config` carrying our settings into the engine-core process.
"""

from __future__ import annotations

import inspect

import pytest
import vllm  # required: a broken install fails here, never skips

from cosine import vllm_hooks


def test_seams_are_the_ones_written_against():
    """`seam_problems` reads vLLM's source; the runtime images' smoke tests run it in each build."""
    assert vllm_hooks.seam_problems() == []
    assert issubclass(vllm_hooks.CoSineScheduler, __import__("vllm").v1.core.sched.scheduler.Scheduler)
    sig = inspect.signature(vllm_hooks.NoDraftProposer.propose)
    assert list(sig.parameters)[1:] == ["sampled_token_ids", "num_tokens_no_spec", "token_ids_cpu", "slot_mappings"]
    assert vllm_hooks.NoDraftProposer(None).propose([[1], [2, 3]], None, None) == [[], []]


def test_seam_problems_names_a_changed_seam(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setattr(Scheduler, "schedule", lambda self: None)
    monkeypatch.setattr(Scheduler, "finish_requests", lambda self, request_ids: None)
    problems = vllm_hooks.seam_problems()
    assert any("0.99.0" in p for p in problems) and any("throttle_prefills" in p for p in problems)
    assert any("finish_requests" in p for p in problems)


def test_engine_kwargs():
    from cosine_spec.cluster_spec import SpeculationSpec

    kw = vllm_hooks.engine_kwargs(SpeculationSpec(max_draft_len=5))
    assert kw["speculative_config"] == {"method": "custom_class", "model": vllm_hooks.NO_DRAFT_PROPOSER,
                                        "num_speculative_tokens": 5}
    assert kw["scheduler_cls"] == vllm_hooks.SCHEDULER_CLS
    assert kw["additional_config"]["cosine"]["speculation"]["maxDraftLen"] == 5  # the CRD's spelling
    assert kw["async_scheduling"] is False  # post_step hands drafts to the scheduler only without it


def test_engine_kwargs_with_the_engines_own_drafter():
    """`spec.verifier.speculator`: vLLM's own method drafts, greedily (a probabilistic draft
    sampler caches q(x) that a substituted draft would make wrong), CoSine's scheduler chooses, and
    on vLLM-CPU the worker class repairs sampling on this path too."""
    from cosine_spec.cluster_spec import SpeculationSpec
    from cosine_spec.verifier_spec import SpeculatorSpec

    kw = vllm_hooks.engine_kwargs(SpeculationSpec(max_draft_len=4), SpeculatorSpec("draftModel", "qwen-0.5b"),
                                  "/models/qwen-0.5b", cpu=True)
    assert kw["speculative_config"] == {"method": "draft_model", "model": "/models/qwen-0.5b",
                                        "draft_sample_method": "greedy", "num_speculative_tokens": 4}
    assert kw["additional_config"]["cosine"]["engine_source"] == "draftModel"
    assert kw["worker_cls"] == vllm_hooks.LOSSLESS_CPU_WORKER and kw["async_scheduling"] is False


def test_on_a_gpu_every_configuration_takes_the_mrv2_seam_with_async_scheduling_on(monkeypatch):
    """vLLM 0.32 runs every in-engine drafter on Model Runner V2 wherever Triton runs: CoSine's
    choice is then a speculator (`vllm_mrv2`), async scheduling stays on, and without an engine
    drafter vLLM's device lookup (`ngram_gpu`) is the inner drafter (MRV2 has no custom_class)."""
    from cosine_spec.cluster_spec import SpeculationSpec
    from cosine_spec.verifier_spec import SpeculatorSpec

    from cosine import vllm_mrv2

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert vllm_hooks.model_runner(cpu=False) == "mrv2" and vllm_hooks.model_runner(cpu=True) == "v1"
    mtp = vllm_hooks.engine_kwargs(SpeculationSpec(max_draft_len=2), SpeculatorSpec("mtp"), cpu=False)
    assert mtp["speculative_config"] == {"method": "mtp", "draft_sample_method": "greedy", "num_speculative_tokens": 2}
    assert vllm_hooks.MRV2_SCHEDULER_CLS == f"{vllm_mrv2.__name__}.{vllm_mrv2.CoSineAsyncScheduler.__name__}"
    assert mtp["scheduler_cls"] == vllm_hooks.MRV2_SCHEDULER_CLS and mtp["async_scheduling"] is True
    assert mtp["worker_cls"] == vllm_hooks.GPU_WORKER and mtp["additional_config"]["cosine"]["seam"] == "mrv2"
    lookup = vllm_hooks.engine_kwargs(SpeculationSpec(max_draft_len=3), cpu=False)
    assert lookup["speculative_config"]["method"] == "ngram_gpu" and lookup["async_scheduling"] is True
    assert lookup["scheduler_cls"] == vllm_hooks.MRV2_SCHEDULER_CLS
    # the GPU worker is vLLM's with the seam's mixin before it
    from vllm.v1.worker.gpu_worker import Worker

    module, _, name = vllm_hooks.GPU_WORKER.rpartition(".")
    worker = getattr(__import__(module, fromlist=[name]), name)
    assert issubclass(worker, vllm_mrv2.MRV2SeamWorker) and issubclass(worker, Worker)
    assert worker.__mro__.index(vllm_mrv2.MRV2SeamWorker) < worker.__mro__.index(Worker)


def test_lossless_cpu_worker_is_vllm_cpus_worker_repairing_sampling():
    from vllm.v1.worker.cpu_worker import CPUWorker

    module, _, name = vllm_hooks.LOSSLESS_CPU_WORKER.rpartition(".")
    worker = getattr(__import__(module, fromlist=[name]), name)
    assert issubclass(worker, CPUWorker)
    assert "ensure_lossless_cpu_sampling()" in inspect.getsource(worker.__init__)


def test_cpu_speculative_sampling_expands_per_request_parameters():
    """vLLM-CPU 0.32's `expand_kernel` shim drops its output (vllm-project/vllm#55005): the draft
    positions' temperature/top-k/top-p become uninitialised memory, so sampling is not lossless.
    The worker-side repair makes the expansion exact at the caller's dtype."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    if not current_platform.is_cpu():
        pytest.skip("the repair applies to vLLM's CPU platform only")
    current_platform.register_triton_kernel_overrides()
    assert vllm_hooks.ensure_lossless_cpu_sampling() is True  # what LosslessCPUWorker runs in each worker
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)
    temperature = expand_batch_to_tokens(torch.tensor([0.7, 0.0, 1.3]), cu, 6, replace_from=0, replace_to=1)
    assert temperature.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.3, 1.3, 1.3])
    top_k = expand_batch_to_tokens(torch.tensor([5, 50, 0], dtype=torch.int32), cu, 6)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [5, 5, 50, 0, 0, 0]
    assert vllm_hooks.ensure_lossless_cpu_sampling() is False, "repaired once, then correct"


def test_the_api_key_middleware_guards_every_route_but_the_probes(monkeypatch):
    """`ApiKeyOnEveryRoute` as vLLM adds it (`app.add_middleware(cls)`, no arguments: the key from
    VLLM_API_KEY), on an app with vLLM's route shapes. Catches: a route outside vLLM's
    GUARDED_PREFIX (/invocations, /tokenize, /pooling) served without the key, a probe or a
    scrape refused, a wrong key or scheme let in."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX

    monkeypatch.setenv("VLLM_API_KEY", "k")
    app = FastAPI()
    guarded = ["/invocations", "/tokenize", "/pooling", "/v1/chat/completions", "/inference/v1/generate"]
    open_ = ["/health", "/ping", "/load", "/version", "/metrics", "/metrics/"]
    for path in guarded + open_:
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    app.add_middleware(vllm_hooks.ApiKeyOnEveryRoute)
    client = TestClient(app)
    assert not any(p.startswith(GUARDED_PREFIX) for p in ("/invocations", "/tokenize", "/pooling"))  # vLLM's gap
    for path in guarded:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic k"}):
            assert client.post(path, headers=headers).status_code == 401, (path, headers)
        assert client.post(path, headers={"Authorization": "Bearer k"}).status_code == 200, path
        assert client.options(path).status_code != 401  # CORS preflight, as in vLLM's middleware
    for path in open_:
        assert client.get(path).status_code == 200, path
