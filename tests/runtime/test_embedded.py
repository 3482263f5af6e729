"""`cosine serve`'s embedded cluster (`cosine.embedded`): the embedded autoscaler survives what fails.

No drafter process is started (the one pool is at zero and stays there); the scrape is replaced
by one that fails once and then reads an idle cluster, so the test shows the loop going on."""

from __future__ import annotations

import threading
import time

import pytest
import yaml
from cosine_spec import metrics_scrape
from cosine_spec.metrics_scrape import Scrape

from cosine.embedded import LocalPools
from cosine.manifest import load_manifest


def test_a_scrape_that_raises_does_not_end_embedded_autoscaling(tmp_path, monkeypatch):
    """Catches: the autoscaler thread ending on its first exception (it had no handler), so a
    cluster served on with its pools frozen at their size and nothing said."""
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "local"},
        "spec": {"verifier": {"model": "qwen2.5-coder-1.5b-instruct"},
                 "drafterPools": [{"name": "ngram", "kind": "ngram", "replicas": 0, "minReplicas": 0}],
                 "autoscaling": {"enabled": True, "intervalSeconds": 1}}}))
    calls: list[float] = []

    async def scrape(targets, timeout_s, time_s):  # noqa: ANN001, ANN202
        calls.append(time_s)
        if len(calls) == 1:
            raise ConnectionError("the verifier's metrics port refused")
        return Scrape(time_s, {"verifier": {}}, {})

    monkeypatch.setattr(metrics_scrape, "scrape_pods", scrape)
    pools = LocalPools(load_manifest(path), tmp_path / "pools", autoscaled=True)
    stop = threading.Event()
    thread = threading.Thread(target=pools.autoscale, args=("http://127.0.0.1:9/metrics", stop), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(calls) < 4:  # a failure, a first scrape, then decisions
            assert thread.is_alive(), "the autoscaler ended"
            assert time.monotonic() < deadline, calls
            time.sleep(0.1)
        assert pools.scaling is not None and pools.scaling.errors == {"observe": 1}
        assert [len(children) for children in pools.replicas.values()] == [0]  # idle: stays at zero
        # what `cosine serve --pools-metrics-port` shows: the failed stage counted, the passes going on
        registry = pools.metrics.registry
        assert registry.get_sample_value("cosine_embedded_autoscaler_errors_total", {"stage": "observe"}) == 1
        assert registry.get_sample_value("cosine_embedded_autoscaler_passes_total") >= 3
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()


def _replicas(url: str) -> dict[str, float] | None:
    """pool -> `cosine_embedded_pool_replicas` at `url`; None while nothing answers there."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url, timeout=2).text
    except httpx.HTTPError:
        return None
    return {s.labels["pool"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "cosine_embedded_pool_replicas"}


def _serve_and_see(path, url: str, expected: dict[str, float], *flags: str) -> None:  # noqa: ANN001
    """Start `cosine serve --cluster path flags`, wait for its pools' replicas at `url` to be
    `expected` (within a minute: before the verifier's model has loaded), stop it and everything
    it started."""
    import os
    import signal
    import subprocess
    import sys

    from cosine.processes import free_port
    from tests.runtime.test_processes import assert_all_gone, descendants

    proc = subprocess.Popen([sys.executable, "-m", "cosine", "serve", "--cluster", str(path), "--port",
                             str(free_port()), "--metrics-port", "0", *flags], start_new_session=True)
    below = []
    try:
        deadline = time.monotonic() + 60
        while (seen := _replicas(url)) != expected:
            assert proc.poll() is None, "cosine serve exited"
            assert time.monotonic() < deadline, (url, seen)
            time.sleep(0.2)
        below = descendants(proc.pid)
    finally:  # SIGTERM, then SIGKILL: a verifier already loading can take long to drain
        below += [p for p in descendants(proc.pid) if p not in below]
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its reaper takes the verifier's group with it
            proc.wait()
        assert_all_gone(below, 30)


def test_cosine_serve_shows_each_pools_replicas_by_default(tmp_path):
    """Catches: `cosine serve` keeping the embedded cluster's own series to itself unless asked
    (`--pools-metrics-port` was 0, off, by default), so a fixed pool's replicas were in no scrape
    and the dashboards' replicas panel stayed empty; and `--placement lookup`, which runs no
    replica, serving nothing on that port where its pools are at zero. Real `cosine serve`
    processes with a fixed ngram pool of two replicas, read before the verifier has loaded."""
    import socket

    from cosine_spec.contract import EMBEDDED_METRICS_PORT

    from cosine.processes import free_port

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "fixed"},
        "spec": {"verifier": {"model": "smollm2-135m-instruct", "threads": 1},
                 "drafterPools": [{"name": "ngram", "kind": "ngram", "replicas": 2}],
                 "autoscaling": {"enabled": False}}}))
    port = free_port()
    _serve_and_see(path, f"http://127.0.0.1:{port}/metrics", {"ngram": 0}, "--placement", "lookup",
                   "--pools-metrics-port", str(port))
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", EMBEDDED_METRICS_PORT)) == 0:
            pytest.skip(f"port {EMBEDDED_METRICS_PORT} is taken on this machine")
    _serve_and_see(path, f"http://127.0.0.1:{EMBEDDED_METRICS_PORT}/metrics", {"ngram": 2}, "--placement", "split")
