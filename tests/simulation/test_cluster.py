"""The simulated cluster drives the product's policies: sanity of each mode, autoscaler bounds."""

import dataclasses

import pytest

from cosine.runtime.routing import DOMAINS
from cosine.simulation import config
from cosine.simulation.cluster import RequestSpec, Workload, poisson_requests, simulate


def _setup(mode):
    setup, _ = config.build_setup(config.load_cluster(None), mode=mode)
    return setup


def test_target_only_single_request_matches_roofline():
    setup = _setup("target-only")
    res = simulate(setup, Workload((RequestSpec(0.0, 256, 32, "code"),)))
    expected = setup.verifier.pass_s(256, 0) + sum(setup.verifier.pass_s(1, 256 + i) for i in range(1, 32))
    assert res.summary()["latency_p50_s"] == pytest.approx(expected, rel=1e-6)
    assert res.tokens == 32


@pytest.mark.parametrize("mode", ["vanilla", "specinfer", "cosine"])
def test_speculation_lowers_latency_at_low_load(mode):
    reqs = poisson_requests(0.5, 40.0, 256, 64, DOMAINS, seed=1)
    base = simulate(_setup("target-only"), Workload(reqs)).summary()
    setup = _setup(mode)
    if mode == "specinfer":
        setup = dataclasses.replace(setup, num_colocated_drafters=3)
    spec = simulate(setup, Workload(reqs)).summary()
    assert spec["tokens"] == base["tokens"] == 64 * len(reqs)  # every request completes, nothing lost
    assert spec["mean_accepted_per_step"] > 0.5
    assert spec["latency_p50_s"] < base["latency_p50_s"]


def test_autoscaler_respects_bounds_and_step():
    setup = _setup("cosine")
    assert setup.scaling is not None
    lim = {p.name: p for p in setup.scaling.pools}
    reqs = poisson_requests(3.0, 300.0, 256, 64, DOMAINS, seed=2)
    res = simulate(setup, Workload(reqs), duration_s=300.0)
    for name, tl in res.replicas_timeline.items():
        assert all(lim[name].min_replicas <= n <= lim[name].max_replicas for _, n in tl)
        assert all(a[1] - b[1] <= setup.scaling.max_scale_down_step for a, b in zip(tl, tl[1:], strict=False))
    assert res.summary()["usd_per_million_tokens"] > 0
