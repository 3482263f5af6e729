"""The one inventory (builders/inventory.py): every kind it makes is one the handlers list, and
what a cluster owns beyond its spec's children is exactly what the pass deletes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from cosine_spec.cluster_spec import parse_cluster_spec

from cosine_operator.builders.inventory import CHILD_KINDS, build_children, leftovers, pass_made

ROOT = Path(__file__).resolve().parents[2]
SPEC: dict[str, Any] = {
    "verifier": {"model": "qwen2.5-coder-1.5b-instruct"},
    "drafterPools": [{"name": "code", "model": "qwen2.5-coder-0.5b-instruct"}, {"name": "ngram", "kind": "ngram"}],
    "modelCache": {"size": "10Gi"},
    "router": {"enabled": True, "gatewayName": "gw", "provider": "gke"},
}


def _children(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return build_children("demo", "ns", parse_cluster_spec(spec), {})


def _owned(children: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """As the API server lists them: by kind, the items without their ``kind``."""
    return [(c["kind"], {k: v for k, v in c.items() if k != "kind"}) for c in children]


def _keys(pairs: list[tuple[str, dict[str, Any]]]) -> set[tuple[str, str]]:
    return {(kind, obj["metadata"]["name"]) for kind, obj in pairs}


def test_every_kind_built_is_one_the_pass_lists() -> None:
    """Catches: a new kind of child that the prune never lists, so it outlives the spec that made it."""
    examples = sorted((ROOT / "manifests" / "examples").rglob("*.yaml"))
    specs = [doc["spec"] for f in examples for doc in yaml.safe_load_all(f.read_text())
             if isinstance(doc, dict) and doc.get("kind") == "CoSineCluster"]
    multinode = copy.deepcopy(SPEC)
    multinode["verifier"].update(resources={"limits": {"nvidia.com/gpu": 8}}, parallelism={"nodes": 2})
    built = {c["kind"] for spec in [*specs, SPEC, multinode] for c in _children(spec)}
    assert built <= set(CHILD_KINDS), built - set(CHILD_KINDS)
    assert {"LeaderWorkerSet", "GCPBackendPolicy", "HealthCheckPolicy", "Job", "PersistentVolumeClaim"} <= built


def test_nothing_is_left_over_while_the_spec_is_unchanged() -> None:
    children = _children(SPEC)
    assert leftovers("demo", parse_cluster_spec(SPEC), children, _owned(children)) == []


def test_what_the_spec_stopped_implying_is_left_over() -> None:
    """One rule for what the handlers once pruned by hand: a removed pool's children, the router's
    and GKE's objects once off, a replaced pull Job, the claim of a dropped cache, the verifier's
    other kind, the NetworkPolicies once disabled."""
    before = _children(SPEC)
    after = copy.deepcopy(SPEC)
    after["drafterPools"] = after["drafterPools"][:1]
    after["router"] = {"enabled": False}
    del after["modelCache"]
    after["networkPolicy"] = {"enabled": False}
    after["verifier"].update(resources={"limits": {"nvidia.com/gpu": 8}}, parallelism={"nodes": 2})
    cluster = parse_cluster_spec(after)
    now = build_children("demo", "ns", cluster, {})
    gone = _keys(leftovers("demo", cluster, now, _owned(before + now)))
    assert gone == _keys(_owned(before)) - _keys(_owned(now))
    assert {("CoSineDrafterPool", "demo-ngram"), ("Deployment", "demo-drafter-ngram"),
            ("Service", "demo-drafter-ngram"), ("PodDisruptionBudget", "demo-drafter-ngram"),
            ("Deployment", "demo-verifier"), ("InferencePool", "demo-router"), ("HTTPRoute", "demo-router"),
            ("GCPBackendPolicy", "demo-router"), ("HealthCheckPolicy", "demo-router"), ("Role", "demo-epp"),
            ("PersistentVolumeClaim", "demo-models"), ("NetworkPolicy", "demo-verifier")} <= gone
    assert not any(kind == "Job" for kind, _ in _keys(_owned(now))) and any(k == "Job" for k, _ in gone)
    assert ("LeaderWorkerSet", "demo-verifier") not in gone


def test_a_spot_pools_fallback_is_the_passs_own() -> None:
    """Catches: the prune deleting the on-demand sibling that the same pass just sized."""
    spec = copy.deepcopy(SPEC)
    spec["spot"] = {"provider": "gke"}
    spec["drafterPools"][0]["capacity"] = "spot"
    cluster = parse_cluster_spec(spec)
    children = build_children("demo", "ns", cluster, {})
    fallback = ("Deployment", {"metadata": {"name": "demo-drafter-code-ondemand", "labels": {}}})
    assert pass_made("demo", cluster) == {("Deployment", "demo-drafter-code-ondemand")}
    assert leftovers("demo", cluster, children, [*_owned(children), fallback]) == []
    spec["drafterPools"][0]["capacity"] = "onDemand"  # back on demand: its sibling goes
    on_demand = parse_cluster_spec(spec)
    assert leftovers("demo", on_demand, build_children("demo", "ns", on_demand, {}), [fallback]) == [fallback]
