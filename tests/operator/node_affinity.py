"""Whether a pod spec's ``nodeSelector`` and required node affinity admit a node with given labels,
as the scheduler's NodeAffinity plugin decides (Kubernetes' "Assigning Pods to Nodes": the
selector's labels must all match; ``nodeSelectorTerms`` are ORed, a term's ``matchExpressions``
ANDed; ``NotIn`` and ``DoesNotExist`` hold on a node without the label). Tolerations and taints
are not weighed here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _holds(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    raise ValueError(f"operator {op} not modelled")


def admits(pod: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether ``pod`` (a pod spec) may be scheduled onto a node labelled ``labels``."""
    if any(labels.get(k) != v for k, v in (pod.get("nodeSelector") or {}).items()):
        return False
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    return any(all(_holds(e, labels) for e in term.get("matchExpressions") or [])
               for term in required["nodeSelectorTerms"])
