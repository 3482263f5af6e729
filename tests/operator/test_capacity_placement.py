"""The verifier and a spot pool's on-demand fallback stay off spot nodes, per provider. Catches:
a GKE Standard spot pool without a taint taking the only verifier; the EKS fallback keeping its
spot pool's Karpenter NodePool (``eks-gpu.yaml``: ``karpenter.sh/nodepool: gpu-spot``) and so
landing on spot again; a user's own node affinity lost or loosened by the rule; another
provider's keys in the rule, which GKE Autopilot's admission refuses."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from cosine_spec.cluster_spec import parse_cluster_spec
from cosine_spec.spot import SPOT_PROVIDERS
from node_affinity import admits
from pod_security import pod_specs

from cosine_operator import capacity_placement
from cosine_operator.builders.inventory import build_children
from cosine_operator.builders.workloads import (
    build_drafter_deployment,
    build_fallback_deployment,
    build_verifier_deployment,
)

# A node of each provider's spot capacity and one of its on-demand capacity, labelled as the
# provider labels them (GKE: cloud.google.com/gke-spot, on preemptible pools gke-preemptible;
# Karpenter: karpenter.sh/capacity-type; EKS managed node groups: eks.amazonaws.com/capacityType;
# AKS: kubernetes.azure.com/scalesetpriority). Each spot node below is one that must be refused.
SPOT_NODES = {
    "gke": [{"cloud.google.com/gke-spot": "true"}],
    "karpenter": [{"karpenter.sh/capacity-type": "spot", "karpenter.sh/nodepool": "gpu-spot"},
                  {"eks.amazonaws.com/capacityType": "SPOT", "eks.amazonaws.com/nodegroup": "gpu-spot"}],
    "aks": [{"kubernetes.azure.com/scalesetpriority": "spot"}],
}
ON_DEMAND_NODES = {
    "gke": {"cloud.google.com/gke-nodepool": "gpu"},
    "karpenter": {"karpenter.sh/capacity-type": "on-demand", "karpenter.sh/nodepool": "gpu"},
    "aks": {"kubernetes.azure.com/scalesetpriority": "regular"},
}
GPU = {"cloud.google.com/gke-accelerator": "nvidia-l4"}


def _spec(provider: str, pool_selector: dict[str, str]) -> dict[str, Any]:
    return {
        "verifier": {"model": "m", "nodeSelector": dict(GPU)},
        "drafterPools": [{"name": "p", "model": "d", "capacity": "spot", "nodeSelector": pool_selector}],
        "spot": {"provider": provider},
    }


def _pods(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = parse_cluster_spec(spec)
    return {
        "verifier": build_verifier_deployment("c", "ns", cluster)["spec"]["template"]["spec"],
        "fallback": build_fallback_deployment("c", "ns", cluster, "p", 1)["spec"]["template"]["spec"],
        "spot": build_drafter_deployment("c", "ns", cluster, "p", 1)["spec"]["template"]["spec"],
    }


@pytest.mark.parametrize("provider", sorted(SPOT_PROVIDERS))
def test_verifier_and_fallback_are_kept_off_spot(provider: str) -> None:
    selector = {**GPU, "karpenter.sh/nodepool": "gpu-spot"} if provider == "karpenter" else dict(GPU)
    pods = _pods(_spec(provider, selector))
    for role in ("verifier", "fallback"):
        for spot in SPOT_NODES[provider]:
            assert not admits(pods[role], {**GPU, **spot}), (role, spot)
        assert admits(pods[role], {**GPU, **ON_DEMAND_NODES[provider]}), role
    # the spot pool itself still goes to spot
    assert admits(pods["spot"], {**selector, **SPOT_NODES[provider][0]})


def test_the_eks_fallback_selects_on_demand_capacity_not_the_spot_nodepool() -> None:
    pods = _pods(_spec("karpenter", {**GPU, "karpenter.sh/nodepool": "gpu-spot"}))
    assert pods["fallback"]["nodeSelector"] == GPU  # the spot NodePool dropped
    assert pods["spot"]["nodeSelector"]["karpenter.sh/nodepool"] == "gpu-spot"  # the pool as written
    # on demand from a Karpenter NodePool that allows it, or from a managed node group
    assert admits(pods["fallback"], {**GPU, "karpenter.sh/capacity-type": "on-demand", "karpenter.sh/nodepool": "gpu"})
    assert admits(pods["fallback"], {**GPU, "eks.amazonaws.com/capacityType": "ON_DEMAND"})
    assert not admits(pods["fallback"], {**GPU, "karpenter.sh/capacity-type": "spot", "karpenter.sh/nodepool": "gpu"})


def test_a_users_own_node_affinity_is_kept_and_tightened() -> None:
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    out = capacity_placement.off_spot(own, None)
    assert out["podAntiAffinity"] == own["podAntiAffinity"]
    pod = {"affinity": out}
    assert admits(pod, {"zone": "a"}) and admits(pod, {"zone": "b"}) and not admits(pod, {"zone": "c"})
    assert not admits(pod, {"zone": "b", "cloud.google.com/gke-spot": "true"})  # every term tightened
    assert own == copy.deepcopy(own) and len(own["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"]) == 1  # the spec's mapping is not mutated


def test_without_spot_the_verifier_is_still_kept_off_spot_nodes() -> None:
    """A cluster with no spot pool (no spec.spot) may share a node pool list with spot pools."""
    cluster = parse_cluster_spec({"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}]})
    verifier = build_verifier_deployment("c", "ns", cluster)["spec"]["template"]["spec"]
    for nodes in SPOT_NODES.values():
        for spot in nodes:
            assert not admits(verifier, spot)
    assert admits(verifier, {})


def _required_keys(pod: dict[str, Any]) -> set[str]:
    required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return {e["key"] for term in required["nodeSelectorTerms"] for e in term.get("matchExpressions") or []}


@pytest.mark.parametrize("provider", sorted(SPOT_PROVIDERS))
def test_the_rule_names_only_the_providers_own_labels(provider: str) -> None:
    """Catches: every provider's capacity labels in every verifier's and fallback's affinity (GKE
    Autopilot refuses a key outside its allowlist, ``karpenter.sh/capacity-type`` among them)."""
    pods = _pods(_spec(provider, dict(GPU)))
    for role in ("verifier", "fallback"):
        assert _required_keys(pods[role]) == set(SPOT_PROVIDERS[provider].spot_labels), role


def test_the_router_provider_names_gke_and_no_provider_means_every_providers_labels() -> None:
    routed = parse_cluster_spec({"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}],
                                 "router": {"enabled": True, "gatewayName": "gw", "provider": "gke"}})
    verifier = build_verifier_deployment("c", "ns", routed)["spec"]["template"]["spec"]
    assert _required_keys(verifier) == set(SPOT_PROVIDERS["gke"].spot_labels)
    bare = parse_cluster_spec({"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}]})
    verifier = build_verifier_deployment("c", "ns", bare)["spec"]["template"]["spec"]
    assert _required_keys(verifier) == {k for cap in SPOT_PROVIDERS.values() for k in cap.spot_labels}


# The node label keys GKE Autopilot admits in a pod's node affinity and node selector without
# workload separation: those its admission names when it refuses another key
# (autogke-node-affinity-selector-limitation), as quoted in rancher/dashboard#10564 (2024),
# arangodb/kube-arangodb#751 (2021) and GoogleCloudPlatform/ai-on-gke#983 (2025). Only keys seen
# in those messages: the lists were cut short where quoted, so Autopilot may admit more.
AUTOPILOT_KEYS = frozenset({
    "cloud.google.com/compute-class", "cloud.google.com/machine-family", "cloud.google.com/gke-spot",
    "cloud.google.com/gke-placement-group", "cloud.google.com/gke-ephemeral-storage-local-ssd",
    "topology.kubernetes.io/region", "topology.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone", "cloud.google.com/gke-os-distribution", "kubernetes.io/os",
    "kubernetes.io/arch", "cloud.google.com/private-node", "sandbox.gke.io/runtime",
    "cloud.google.com/gke-accelerator",
})
EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"


def _node_keys(pod: dict[str, Any]) -> set[str]:
    node = (pod.get("affinity") or {}).get("nodeAffinity") or {}
    terms = [*(node.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms", []),
             *[p["preference"] for p in node.get("preferredDuringSchedulingIgnoredDuringExecution") or []]]
    keys = {e["key"] for t in terms for e in [*(t.get("matchExpressions") or []), *(t.get("matchFields") or [])]}
    return keys | set(pod.get("nodeSelector") or {})


@pytest.mark.parametrize("example", ["gke-gpu.yaml", "gke-gateway-multinode.yaml"])
def test_a_gke_render_selects_nodes_only_by_keys_autopilot_admits(example: str) -> None:
    """The GKE examples as the operator renders them (every workload, the spot pools' on-demand
    fallbacks too) select nodes by Autopilot's allowlisted keys only, and still keep the verifier
    and the fallbacks off Spot nodes. Catches: a GKE Autopilot cluster refusing the verifier."""
    doc = yaml.safe_load((EXAMPLES / example).read_text())
    name, cluster = doc["metadata"]["name"], parse_cluster_spec(doc["spec"])
    objects = build_children(name, "ns", cluster, {})
    objects += [build_fallback_deployment(name, "ns", cluster, p.name, 1)
                for p in cluster.drafter_pools if p.capacity == "spot"]
    pods = pod_specs(objects)
    assert len(pods) >= 4  # verifier, pools, a fallback, the pull Job (and the picker, workers)
    for what, pod in pods:
        assert _node_keys(pod) <= AUTOPILOT_KEYS, (what, _node_keys(pod) - AUTOPILOT_KEYS)
    spot = {"cloud.google.com/gke-spot": "true"}
    for what, pod in pods:
        if "verifier" in what or what.endswith("-ondemand"):
            assert not admits(pod, {**(pod.get("nodeSelector") or {}), **spot}), what
