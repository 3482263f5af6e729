"""Where a pod may run by capacity type: what keeps the verifier and a spot pool's on-demand
fallback off spot nodes (DESIGN §10: "the verifier stays on-demand"), per provider
(:data:`cosine_spec.spot.SPOT_PROVIDERS`).

A spot node pool is not always tainted (a GKE Standard pool only when created with
``--node-taints``; Karpenter's NodePools never by default), so a pod without a rule may land on
one. The rule is a required node affinity excluding every provider's spot labels (``NotIn``: a
node without the label qualifies, so one provider's expressions cost nothing on another's nodes),
added to each of the role's own ``nodeSelectorTerms`` (the terms are ORed, their expressions
ANDed).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from cosine_spec.cluster_spec import SpotSpec
from cosine_spec.pods import PodOverrides
from cosine_spec.spot import SPOT_PROVIDERS


def off_spot_expressions() -> list[dict[str, Any]]:
    """``NotIn`` node-selector requirements for every provider's spot labels."""
    seen: dict[str, tuple[str, ...]] = {}
    for cap in SPOT_PROVIDERS.values():
        for key, values in cap.spot_labels.items():
            seen[key] = tuple(dict.fromkeys((*seen.get(key, ()), *values)))
    return [{"key": key, "operator": "NotIn", "values": list(values)} for key, values in seen.items()]


def off_spot(affinity: Mapping[str, Any]) -> dict[str, Any]:
    """``affinity`` (a pod's, as written) with :func:`off_spot_expressions` required in every term."""
    out = copy.deepcopy(dict(affinity))
    node = out.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term["matchExpressions"] = [*term.get("matchExpressions", []), *off_spot_expressions()]
    return out


def on_demand(pod: PodOverrides, spot: SpotSpec | None) -> PodOverrides:
    """``pod`` kept off spot nodes. With ``spot`` (a spot pool's fallback), its node selector
    also loses the provider's spot label and the keys that pick the spot pool's nodes (a
    Karpenter NodePool, an EKS node group): what is left, with the ``NotIn`` rule, selects the
    provider's on-demand capacity."""
    selector = dict(pod.node_selector)
    if spot is not None:
        cap = spot.capacity
        for key in (*cap.node_selector, *cap.pool_keys):
            selector.pop(key, None)
    return replace(pod, node_selector=selector, affinity=off_spot(pod.affinity))
