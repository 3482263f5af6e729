"""One config hash per role, over the fields of the spec that role's process reads when it starts.

A role's pod template carries its hash (``cosine.dev/config-hash``), so a change to what it reads
rolls its pods and nothing else does: a pool's price (read by the operator's autoscaler alone),
``spec.spot.pendingTimeoutSeconds`` (the operator's fallback timer), the gateway Service's type
and port, the router's weights (the endpoint picker's own config) leave the verifier's template as
it is. What a process reads is what its entry point reads from the cluster's ConfigMap
(``cosine.roles``): fields already in the pod template (image, resources, node selectors,
arguments) roll the pods on their own and need not be hashed.

- verifier (``roles.verifier_command``): ``spec.verifier`` (model, dtype, engine limits,
  parallelism) but its replicas and ``rollout`` (how its pods roll), ``spec.speculation``, each
  pool's name and expertise (the proposer's routing), ``spec.drafterTLS``;
- drafter pool P and its on-demand sibling (``roles.run_drafter``): the pool as written but its
  replica bounds and prices, the verifier's model and dtype (its tokenizer, its engine's dtype),
  ``spec.speculation.minConfidence``, ``spec.spot.provider`` (the grace its notice leaves),
  ``spec.drafterTLS``;
- router: the endpoint picker's configuration and replicas (its flags).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from cosine_spec.cluster_spec import ClusterSpec

from cosine_operator import endpoint_picker

# what a pool's pods do not read: the scaler's bounds and the autoscaler's prices
_POOL_UNREAD = ("replicas", "minReplicas", "maxReplicas", "pricePerHourUsd", "spotPricePerHourUsd")


def _digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def verifier_reads(cluster: ClusterSpec) -> dict[str, Any]:
    """The part of ``spec`` (as written) the verifier's process reads at start."""
    raw = cluster.raw
    verifier = {k: v for k, v in dict(raw.get("verifier") or {}).items() if k not in ("replicas", "rollout")}
    pools = [{"name": p.name, "expertise": list(p.expertise)} for p in cluster.drafter_pools]
    return {"verifier": verifier, "speculation": raw.get("speculation"), "drafterPools": pools,
            "drafterTLS": raw.get("drafterTLS")}


def pool_reads(cluster: ClusterSpec, pool: str) -> dict[str, Any]:
    """The part of ``spec`` (as written) pool ``pool``'s drafter process reads at start."""
    raw = cluster.raw
    written: Mapping[str, Any] = next(p for p in raw.get("drafterPools") or () if p.get("name") == pool)
    return {
        "pool": {k: v for k, v in written.items() if k not in _POOL_UNREAD},
        "verifier": {"model": cluster.verifier.model, "dtype": cluster.verifier.dtype},
        "minConfidence": cluster.speculation.min_confidence,
        "spot": cluster.spot.provider if cluster.spot is not None else None,
        "drafterTLS": raw.get("drafterTLS"),
    }


def verifier_hash(cluster: ClusterSpec) -> str:
    """16 hex digits of :func:`verifier_reads` (the verifier's pods and a multi-node group's workers)."""
    return _digest(verifier_reads(cluster))


def pool_hash(cluster: ClusterSpec, pool: str) -> str:
    """16 hex digits of :func:`pool_reads` (the pool's pods and its on-demand sibling's)."""
    return _digest(pool_reads(cluster, pool))


def router_hash(cluster: ClusterSpec) -> str:
    """16 hex digits of the endpoint picker's configuration and replica count."""
    return _digest({"config": endpoint_picker.config(cluster), "replicas": cluster.router.replicas})
