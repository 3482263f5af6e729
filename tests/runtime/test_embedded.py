"""`cosine serve`'s embedded cluster (`cosine.embedded`): the embedded autoscaler survives what fails.

No drafter process is started (the one pool is at zero and stays there); the scrape is replaced
by one that fails once and then reads an idle cluster, so the test shows the loop going on."""

from __future__ import annotations

import threading
import time

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
