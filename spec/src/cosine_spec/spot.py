"""The spot-provider table: what puts a pod on each provider's spot (preemptible) nodes, what keeps
one off them, and how long a pod has when its node is reclaimed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

CAPACITY_TYPES = ("onDemand", "spot")


@dataclass(frozen=True)
class SpotCapacity:
    """What puts a pod on a provider's spot (preemptible) nodes, and how long it has when one is
    reclaimed. ``node_selector``: the label its spot nodes carry; ``toleration``: the taint they
    carry, if any; ``notice_s``: the provider's notice before the node goes; ``pod_grace_s``: the
    part of it a pod's termination may take (a spot pool's ``terminationGracePeriodSeconds`` is
    capped to it, so a preempted drafter exits on its own terms). ``spot_labels``: every node
    label (and its values) by which the provider marks spot capacity, what the verifier and a
    fallback are kept off (``NotIn``: a node without the label qualifies). ``pool_keys``: the
    node-selector keys that pick one of the provider's pools of nodes, hence its capacity type,
    which an on-demand fallback drops from its spot pool's selector (the ``NotIn`` rule then
    leaves it any on-demand node: a Karpenter NodePool that allows on-demand, a managed node group)."""

    node_selector: Mapping[str, str]
    toleration: Mapping[str, str] | None
    notice_s: int
    pod_grace_s: int
    spot_labels: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    pool_keys: tuple[str, ...] = ()


SPOT_PROVIDERS: Mapping[str, SpotCapacity] = {
    # GKE Spot VMs: 30 s from the preemption notice, the first 15 s for non-system pods (the
    # kubelet's graceful node shutdown; GKE's "Spot VMs" concepts page). Standard pools on 1.35+
    # may extend it to 120 s: set terminationGracePeriodSeconds lower than that yourself. Spot
    # nodes are labelled cloud.google.com/gke-spot "true"; a Standard pool is tainted only when
    # created with --node-taints, so the label is the guard. Only that key: GKE Autopilot refuses
    # node affinity on keys outside its allowlist, which names gke-spot and not gke-preemptible
    # (the refusal quoted in rancher/dashboard#10564); a Standard pool of the older preemptible
    # VMs (labelled cloud.google.com/gke-preemptible) must be tainted to keep the verifier off.
    "gke": SpotCapacity({"cloud.google.com/gke-spot": "true"},
                        {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                         "effect": "NoSchedule"}, 30, 15,
                        spot_labels={"cloud.google.com/gke-spot": ("true",)}),
    # EC2 Spot under Karpenter: a 2-minute interruption notice (plus a rebalance recommendation),
    # on which Karpenter's interruption handling drains the node; its NodePools put no taint on
    # spot nodes by default. Karpenter labels karpenter.sh/capacity-type (spot, on-demand,
    # reserved); EKS managed node groups eks.amazonaws.com/capacityType (SPOT, ON_DEMAND). A
    # NodePool or node group decides which capacity types it launches: the fallback drops the spot
    # pool's karpenter.sh/nodepool (or node group), and Karpenter honours its NotIn spot rule.
    "karpenter": SpotCapacity({"karpenter.sh/capacity-type": "spot"}, None, 120, 110,
                              spot_labels={"karpenter.sh/capacity-type": ("spot",),
                                           "eks.amazonaws.com/capacityType": ("SPOT",)},
                              pool_keys=("karpenter.sh/nodepool", "eks.amazonaws.com/nodegroup")),
    # AKS spot node pools: labelled and tainted scalesetpriority=spot; Azure's Scheduled Events
    # give at least 30 s before the eviction.
    "aks": SpotCapacity({"kubernetes.azure.com/scalesetpriority": "spot"},
                        {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot",
                         "effect": "NoSchedule"}, 30, 25,
                        spot_labels={"kubernetes.azure.com/scalesetpriority": ("spot",)}),
}
