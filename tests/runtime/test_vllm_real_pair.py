"""The default pair through vLLM, as `make run` serves it: Qwen2.5-Coder-1.5B-Instruct verified by
vLLM with CoSine's proposer and the 0.5B drafter pool in its own process; greedy output identical
to vLLM serving the target alone, in float32, on real prompts; drafts verified and accepted.

Two servers, one after the other (both do not fit in RAM together with their KV caches).
"""

from __future__ import annotations

import sys

import pytest
import yaml

from tests.runtime.test_serve import _client, _counter, _start, _stop

pytest.importorskip("vllm")
# ~6 min (two 1.5B servers in turn): with -m slow. By default, test_serve checks the same path (target
# identical through CoSine's proposer and a drafter process) on a small real model, and every
# `cosine bench` run counts outputs identical to vLLM target-only on this pair.
pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PROMPTS = [
    "Rewrite this function with the parameter renamed from `xs` to `values`, changing nothing else:\n\n"
    "def total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s\n",
    "Write a Python function that reverses a string.",
    "Explain in two sentences why the sky is blue.",
]


def _chat_all(base: str, model: str) -> list[str]:
    client = _client(base, "none")
    return [_chat_model(client, model, p) for p in PROMPTS]


def _chat_model(client, model: str, prompt: str) -> str:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], temperature=0,
                                       max_tokens=40)
    return r.choices[0].message.content


def test_real_pair_identical_to_vllm_target_only(tmp_path):
    from importlib import resources

    from cosine.model_store import pull
    from cosine.processes import free_port

    manifest = yaml.safe_load(resources.files("cosine").joinpath("default_cluster.yaml").read_text())
    model = manifest["spec"]["verifier"]["model"]
    for name in (model, manifest["spec"]["drafterPools"][0]["model"]):
        pull(name, progress=False)
    alone = {**manifest, "spec": {**manifest["spec"], "speculation": {"maxDraftLen": 0}}}
    (tmp_path / "alone.yaml").write_text(yaml.safe_dump(alone))

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start([sys.executable, "-m", "cosine", "verifier", "--cluster", str(tmp_path / "alone.yaml"),
                   "--http-port", str(port), "--metrics-port", "0"], base, {})
    try:
        reference = _chat_all(base, model)
    finally:
        _stop(proc)

    port, metrics_port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start([sys.executable, "-m", "cosine", "serve", "--port", str(port), "--metrics-port",
                   str(metrics_port), "--pools-metrics-port", "0", "--placement", "split"], base, {})
    try:
        assert _chat_all(base, model) == reference
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        accepted = sum(_counter(metrics, "cosine_spec_decode_num_accepted_tokens_total", pool)
                       for pool in ("lookup", "coder"))
        assert accepted > 0, "drafts were verified and accepted"
    finally:
        _stop(proc)
