"""Pods restart only when what they run changes: each role's pod template carries the hash of the
fields its process reads at start (config_hashes), so an edit that role does not read leaves its
template, hence its pods, as they are. Catches the old single hash over the whole spec, with which
a pool's price, ``spot.pendingTimeoutSeconds``, the gateway's port or the router's weights rolled
every verifier pod (one replica with ``maxSurge: 0``: an outage for a model load)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from cosine_spec.cluster_spec import parse_cluster_spec
from cosine_spec.contract import CONFIG_DIR

from cosine_operator.builders.inventory import build_children
from cosine_operator.builders.workloads import build_config_map, build_fallback_deployment

SPEC: dict[str, Any] = {
    "verifier": {"model": "qwen2.5-coder-1.5b-instruct"},
    "drafterPools": [
        {"name": "code", "model": "qwen2.5-coder-0.5b-instruct", "capacity": "spot", "pricePerHourUsd": 0.7,
         "spotPricePerHourUsd": 0.2, "expertise": ["code"]},
        {"name": "ngram", "kind": "ngram"},
    ],
    "spot": {"provider": "gke", "pendingTimeoutSeconds": 300},
    "gateway": {"serviceType": "LoadBalancer", "port": 80},
    "router": {"enabled": True, "gatewayName": "gw"},
}
Edit = Callable[[dict[str, Any]], None]


def _templates(spec: dict[str, Any]) -> dict[str, Any]:
    """Every workload's pod template by workload name (a spot pool's fallback included)."""
    cluster = parse_cluster_spec(spec)
    children = build_children("demo", "ns", cluster, {})
    out = {c["metadata"]["name"]: c["spec"]["template"] for c in children if c["kind"] == "Deployment"}
    fallback = build_fallback_deployment("demo", "ns", cluster, "code", 1)
    out[fallback["metadata"]["name"]] = fallback["spec"]["template"]
    return out


def _edited(edit: Edit) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    edit(spec)
    return _templates(spec)


def _changed(edit: Edit) -> set[str]:
    before, after = _templates(SPEC), _edited(edit)
    return {name for name in before if before[name] != after[name]}


def _set(path: str, value: Any) -> Edit:
    def edit(spec: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node: Any = spec
        for key in parents:
            node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
        node[leaf] = value
    return edit


@pytest.mark.parametrize("edit", [
    _set("drafterPools.0.pricePerHourUsd", 1.4),
    _set("drafterPools.0.spotPricePerHourUsd", 0.3),
    _set("drafterPools.0.maxReplicas", 9),
    _set("spot.pendingTimeoutSeconds", 60),
    _set("gateway.port", 8080),
    _set("gateway.serviceType", "ClusterIP"),
    _set("router.weights", {"prefixCache": 5, "queue": 2}),
    _set("router.endpointPickerReplicas", 2),
    _set("autoscaling", {"intervalSeconds": 10}),
    _set("networkPolicy", {"metricsFrom": [{"podSelector": {}}]}),
    _set("verifier.rollout", {"maxSurge": 1}),  # the Deployment's strategy, not what its pods run
], ids=["price", "spot-price", "max-replicas", "pending-timeout", "gateway-port", "gateway-type",
        "router-weights", "picker-replicas", "autoscaling", "network-policy", "verifier-surge"])
def test_what_no_process_reads_at_start_restarts_no_drafter_or_verifier(edit: Edit) -> None:
    assert not _changed(edit) - {"demo-epp"}


def test_a_model_change_restarts_the_verifier() -> None:
    assert "demo-verifier" in _changed(_set("verifier.model", "qwen2.5-coder-3b-instruct"))
    assert "demo-verifier" in _changed(_set("speculation", {"maxDraftLen": 3}))


def test_a_pool_change_restarts_that_pool_and_its_fallback_only() -> None:
    changed = _changed(_set("drafterPools.0.model", "qwen2.5-0.5b-instruct"))
    assert changed == {"demo-drafter-code", "demo-drafter-code-ondemand"}
    # the verifier's proposer routes by each pool's expertise: it reads it at start
    assert "demo-verifier" in _changed(_set("drafterPools.0.expertise", ["math"]))


def test_router_weights_restart_the_endpoint_picker_only() -> None:
    assert _changed(_set("router.weights", {"prefixCache": 5})) == {"demo-epp"}


def test_a_price_reaches_the_running_pods_through_the_mounted_config_map() -> None:
    """What no process needs at start still reaches the pods: the cluster's ConfigMap changes and is
    mounted as a directory (no subPath), which the kubelet refreshes in place."""
    edited = copy.deepcopy(SPEC)
    _set("drafterPools.0.pricePerHourUsd", 1.4)(edited)
    before = build_config_map("demo", "ns", parse_cluster_spec(SPEC))["data"]["cluster.yaml"]
    after = build_config_map("demo", "ns", parse_cluster_spec(edited))["data"]["cluster.yaml"]
    assert "1.4" in after and before != after
    for name, template in _templates(SPEC).items():
        if name == "demo-epp":
            continue
        (mount,) = [m for c in template["spec"]["containers"] for m in c["volumeMounts"] if m["name"] == "config"]
        assert mount["mountPath"] == CONFIG_DIR and "subPath" not in mount, name
