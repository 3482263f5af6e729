"""The verifier and a spot pool's on-demand fallback stay off spot nodes, per provider. Catches:
a GKE Standard spot pool without a taint taking the only verifier; the EKS fallback keeping its
spot pool's Karpenter NodePool (``eks-gpu.yaml``: ``karpenter.sh/nodepool: gpu-spot``) and so
landing on spot again; a user's own node affinity lost or loosened by the rule."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from cosine_spec.cluster_spec import parse_cluster_spec
from cosine_spec.spot import SPOT_PROVIDERS
from node_affinity import admits

from cosine_operator import capacity_placement
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
    "gke": [{"cloud.google.com/gke-spot": "true"}, {"cloud.google.com/gke-preemptible": "true"}],
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
    out = capacity_placement.off_spot(own)
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
