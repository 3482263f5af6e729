"""Where a pod may run by capacity type: what keeps the verifier and a spot pool's on-demand
fallback off spot nodes (DESIGN §10: "the verifier stays on-demand"), per provider
(:data:`cosine_spec.spot.SPOT_PROVIDERS`).

A spot node pool is not always tainted (a GKE Standard pool only when created with
``--node-taints``; Karpenter's NodePools never by default), so a pod without a rule may land on
one. The rule is a required node affinity excluding the spot labels of the cluster's provider
(:func:`provider_of`: ``spec.spot.provider``, else ``gke`` from ``spec.router.provider``; ``NotIn``:
a node without the label qualifies), added to each of the role's own ``nodeSelectorTerms`` (the
terms are ORed, their expressions ANDed). Only that provider's labels: GKE Autopilot refuses a pod
whose node affinity names a key outside its allowlist (``autogke-node-affinity-selector-limitation``;
the refusal and the list are quoted in rancher/dashboard#10564 and arangodb/kube-arangodb#751),
and another provider's keys (``karpenter.sh/capacity-type`` ...) are outside it. A cluster that
names no provider gets every provider's labels.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from cosine_spec.cluster_spec import ClusterSpec
from cosine_spec.pods import PodOverrides
from cosine_spec.spot import SPOT_PROVIDERS


def provider_of(cluster: ClusterSpec) -> str | None:
    """The spot provider whose nodes the cluster runs on, as its spec says: ``spec.spot.provider``,
    else ``gke`` when ``spec.router.provider`` is ``gke``; ``None`` when the spec names none."""
    if cluster.spot is not None:
        return cluster.spot.provider
    return "gke" if cluster.router.provider == "gke" else None


def off_spot_expressions(provider: str | None) -> list[dict[str, Any]]:
    """``NotIn`` node-selector requirements for ``provider``'s spot labels (``None``: every provider's)."""
    seen: dict[str, tuple[str, ...]] = {}
    caps = SPOT_PROVIDERS.values() if provider is None else (SPOT_PROVIDERS[provider],)
    for cap in caps:
        for key, values in cap.spot_labels.items():
            seen[key] = tuple(dict.fromkeys((*seen.get(key, ()), *values)))
    return [{"key": key, "operator": "NotIn", "values": list(values)} for key, values in seen.items()]


def off_spot(affinity: Mapping[str, Any], provider: str | None) -> dict[str, Any]:
    """``affinity`` (a pod's, as written) with :func:`off_spot_expressions` of ``provider`` required
    in every term."""
    out = copy.deepcopy(dict(affinity))
    node = out.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term["matchExpressions"] = [*term.get("matchExpressions", []), *off_spot_expressions(provider)]
    return out


def on_demand(pod: PodOverrides, cluster: ClusterSpec, fallback: bool = False) -> PodOverrides:
    """``pod`` kept off the spot nodes of ``cluster``'s provider (:func:`provider_of`). A spot
    pool's ``fallback``'s node selector also loses the provider's spot label and the keys that
    pick the spot pool's nodes (a Karpenter NodePool, an EKS node group): what is left, with the
    ``NotIn`` rule, selects the provider's on-demand capacity."""
    selector = dict(pod.node_selector)
    if fallback and cluster.spot is not None:
        cap = cluster.spot.capacity
        for key in (*cap.node_selector, *cap.pool_keys):
            selector.pop(key, None)
    return replace(pod, node_selector=selector, affinity=off_spot(pod.affinity, provider_of(cluster)))
