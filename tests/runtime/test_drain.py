"""A rollout drains: `cosine serve` sent SIGTERM with 8 requests in flight finishes all 8 (the same
greedy outputs as before), refuses new ones, and exits by itself.

Real processes: vLLM's OpenAI server with CoSine's proposer (prompt lookup; `--placement lookup`,
no pools) on a real small model (SmolLM2-135M-Instruct), the official `openai` client. The drain is
vLLM's own (`--shutdown-timeout`, from `spec.verifier.terminationGracePeriodSeconds`:
`VerifierSpec.shutdown_timeout_s`); on Kubernetes the pod's preStop wait comes first.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from cosine.model_store import pull
from cosine.processes import free_port

from .test_serve import _start, _stop

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
PROMPTS = [f"Write a long story about a {thing}." for thing in
           ("lighthouse", "fox", "baker", "comet", "violin", "glacier", "market", "robot")]
MAX_TOKENS = 128  # each of the 8 is still mid-stream when SIGTERM lands after every first token


def _client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def _stream(client, prompt: str, started: threading.Barrier | None = None) -> str:
    text = []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=MAX_TOKENS,
            stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            if started is not None and not text:
                started.wait(timeout=120)
            text.append(chunk.choices[0].delta.content)
    return "".join(text)


def test_sigterm_finishes_the_requests_in_flight_and_refuses_new_ones(tmp_path):
    pull(MODEL, progress=False)
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(yaml.safe_dump({
        "apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "drain"},
        "spec": {"verifier": {"model": MODEL, "threads": 1, "terminationGracePeriodSeconds": 60},
                 "drafterPools": [{"name": "lookup", "kind": "ngram"}]}}))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start([sys.executable, "-m", "cosine", "serve", "--cluster", str(manifest), "--port", str(port),
                   "--metrics-port", "0", "--pools-metrics-port", "0", "--placement", "lookup"], base, {})
    try:
        # vLLM's drain time comes from the grace period (60 s - 10 s preStop - 5 s): not a fixed 5 s
        verifier = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "vllm"], capture_output=True, text=True)
        argv = open(f"/proc/{verifier.stdout.split()[0]}/cmdline").read().split("\0")
        timeout = int(argv[argv.index("--shutdown-timeout") + 1])
        assert timeout == 45, argv
        client = _client(base)
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            reference = dict(zip(PROMPTS, pool.map(lambda p: _stream(client, p), PROMPTS), strict=True))
        assert all(reference.values())
        started = threading.Barrier(len(PROMPTS) + 1)
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = {p: pool.submit(_stream, client, p, started) for p in PROMPTS}
            started.wait(timeout=120)  # every request has its first tokens: all 8 in flight
            os.kill(proc.pid, signal.SIGTERM)  # what the kubelet sends after preStop
            sigterm_s = time.monotonic()
            # a new request is refused, not served (vLLM's engine rejects adds while it drains)
            with pytest.raises(Exception):  # noqa: B017 - refused or cut off, whichever comes first
                text = _stream(client, "Say hi.")
                assert not text, text
            done = {p: f.result(timeout=120) for p, f in futures.items()}
            drained_s = time.monotonic() - sigterm_s
        assert done == reference  # all 8 finished, each with its whole greedy output
        assert proc.wait(timeout=60) == 0  # exits by itself once drained
        print(f"drained 8 requests in {drained_s:.1f} s after SIGTERM (vLLM given {timeout} s)")
    finally:
        if proc.poll() is None:
            _stop(proc)
