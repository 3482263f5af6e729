"""The embedded multi-process cluster, as a user runs it: `cosine serve --cluster FILE`.

Real processes on loopback (a verifier with the gateway, a drafter process per replica), a real
small model (SmolLM2-135M-Instruct as both target and drafter, so it runs in seconds), the official
`openai` client. Faults: a drafter killed mid-stream costs speed, never a request, and is restarted
and rejoins; 50 requests at concurrency 8 all complete exactly once.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from cosine.roles import free_port
from cosine.runtime.model_store import pull

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
PROMPTS = ["Name three colors.", "What is 7 times 6?", "Write a haiku about the sea.", "List two fruits."]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pull(MODEL, progress=False)
    manifest = {
        "apiVersion": "cosine.dev/v1alpha1",
        "kind": "CoSineCluster",
        "metadata": {"name": "test"},
        "spec": {
            "verifier": {"model": MODEL, "threads": 1},
            "drafterPools": [{"name": "small", "model": MODEL, "replicas": 1, "threads": 1}],
            "speculation": {"maxDraftLen": 4, "adaptive": False},  # same model drafts: always speculate
        },
    }
    path = tmp_path_factory.mktemp("cluster") / "cluster.yaml"
    path.write_text(yaml.safe_dump(manifest))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "cosine", "serve", "--cluster", str(path), "--port", str(port)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, "cosine serve exited during start-up"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "cluster not healthy after 300 s"
        time.sleep(1)
    yield base, proc
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


def _drafter_pids(serve_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(serve_pid), "-f", "cosine drafter"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.fixture(scope="module")
def reference():
    """Target-only greedy outputs, computed in this process with the same thread count."""
    import torch

    from cosine.runtime.models import ModelRunner
    from cosine.runtime.speculative_decoding import generate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runner = ModelRunner.load(MODEL)
    out = {p: runner.decode(generate(runner, runner.encode_prompt(p), 24).token_ids) for p in PROMPTS}
    torch.set_num_threads(threads)
    return out


def _client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, prompt: str, stream: bool = False) -> str:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=24)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)


def test_openai_client_gets_target_identical_output(cluster, reference):
    base, _ = cluster
    client = _client(base)
    for p in PROMPTS[:2]:
        assert _chat(client, p) == reference[p]
        assert _chat(client, p, stream=True) == reference[p]
    metrics = httpx.get(f"{base}/metrics").text
    assert "cosine:spec_decode_num_accepted_tokens_total" in metrics


def test_killed_drafter_costs_speed_not_requests(cluster, reference):
    base, proc = cluster
    client = _client(base)
    pids = _drafter_pids(proc.pid)
    assert len(pids) == 1, "one drafter process per replica, visible as `cosine drafter` in ps"
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_chat, client, p, True) for p in PROMPTS]
        time.sleep(1.0)
        os.kill(pids[0], signal.SIGKILL)  # the drafter dies while requests are in flight
        results = [f.result(timeout=240) for f in futures]
    assert results == [reference[p] for p in PROMPTS]
    deadline = time.monotonic() + 120  # the supervisor restarts it
    while not (new := _drafter_pids(proc.pid)) or new == pids:
        assert time.monotonic() < deadline, "drafter was not restarted"
        time.sleep(1)
    time.sleep(8)  # model load + the failover's down window
    before = _accepted(base)
    assert _chat(client, PROMPTS[0]) == reference[PROMPTS[0]]
    assert _accepted(base) > before, "the restarted drafter drafts again"


def _accepted(base: str, pool: str = "small") -> float:
    """Accepted draft tokens of one drafter pool (prompt lookup counts under pool="lookup")."""
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("cosine:spec_decode_num_accepted_tokens_total{") and f'pool="{pool}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_fifty_requests_at_concurrency_eight(cluster):
    base, _ = cluster
    client = _client(base)

    def one(i: int) -> tuple[int, str, float]:
        t = time.perf_counter()
        r = client.completions.create(model=MODEL, prompt=f"Request {i}: count to three.", max_tokens=8,
                                      temperature=0, user=str(i))
        return i, r.id, time.perf_counter() - t

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(50)))
    ids = [r[1] for r in results]
    assert sorted(r[0] for r in results) == list(range(50))
    assert len(set(ids)) == 50, "no request answered twice or lost"
    lat = sorted(r[2] for r in results)
    p50, p99 = statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]
    print(f"\n50 requests at concurrency 8: p50 {p50:.2f} s, p99 {p99:.2f} s")
    assert httpx.get(f"{base}/health").status_code == 200
