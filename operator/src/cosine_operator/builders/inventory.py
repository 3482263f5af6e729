"""The one inventory of a cluster's children: :func:`build_children` says what a spec implies, and
:func:`leftovers` what the cluster owns beyond it (owned minus desired: the children the handlers
delete, whichever part of the spec stopped implying them)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cosine_spec.cluster_spec import ClusterSpec
from cosine_spec.contract import POOL_KIND

from cosine_operator.builders.multinode import build_verifier
from cosine_operator.builders.names import Manifest, fallback_name
from cosine_operator.builders.networking import (
    build_drafter_service,
    build_gateway_service,
    build_network_policies,
    build_verifier_service,
)
from cosine_operator.builders.router import build_router
from cosine_operator.builders.storage import build_model_claim, build_model_job
from cosine_operator.builders.workloads import (
    build_config_map,
    build_disruption_budgets,
    build_drafter_deployment,
    build_pool_scaler,
)

# Every kind :func:`build_children` makes (a test holds it to every example's children), in the
# order leftovers are deleted: a pool's scale target before its Deployment, workloads before the
# Services, policies and configuration they use.
CHILD_KINDS = (POOL_KIND, "Deployment", "LeaderWorkerSet", "Job", "PersistentVolumeClaim", "Service",
               "PodDisruptionBudget", "NetworkPolicy", "ConfigMap", "HTTPRoute", "InferencePool", "GCPBackendPolicy",
               "HealthCheckPolicy", "DestinationRule", "RoleBinding", "Role", "ServiceAccount")


def build_children(
    name: str,
    namespace: str,
    cluster: ClusterSpec,
    pool_replicas: Mapping[str, int],
    operator: Mapping[str, Any] | None = None,
) -> list[Manifest]:
    """Every child, in creation order (the NetworkPolicies first, so no pod starts unprotected; a
    pool's Deployment before its scale target, so the scale target always has a Deployment to
    resize); ``pool_replicas`` gives each pool's replicas at creation (default: the spec's, within
    its bounds); ``operator``: the operator's pods as a NetworkPolicy peer (:func:`operator_peer`).
    Replicas are for creation only (see the module docstring)."""
    claim, job = build_model_claim(name, namespace, cluster), build_model_job(name, namespace, cluster)
    children = [
        *build_network_policies(name, namespace, cluster, operator),
        *([claim] if claim else []),
        *([job] if job else []),
        build_config_map(name, namespace, cluster),
        build_verifier_service(name, namespace),
        build_gateway_service(name, namespace, cluster),
        *build_disruption_budgets(name, namespace, cluster),
    ]
    for pool in cluster.drafter_pools:
        replicas = pool_replicas.get(pool.name, pool.clamp(pool.replicas))
        children += [
            build_drafter_service(name, namespace, pool.name),
            build_drafter_deployment(name, namespace, cluster, pool.name, replicas),
            build_pool_scaler(name, namespace, cluster, pool.name, replicas),
        ]
    children.append(build_verifier(name, namespace, cluster))
    children += build_router(name, namespace, cluster)
    return children


def pass_made(name: str, cluster: ClusterSpec) -> set[tuple[str, str]]:
    """``(kind, name)`` of the children a pass may make from what it observes rather than from the
    spec alone: each spot pool's on-demand fallback (sized from its pods: the handlers'
    ``_spot_fallbacks``, which also deletes one no longer needed)."""
    if cluster.spot is None:
        return set()
    return {("Deployment", fallback_name(name, p.name)) for p in cluster.drafter_pools if p.capacity == "spot"}


def leftovers(
    name: str, cluster: ClusterSpec, desired: Iterable[Manifest], owned: Iterable[tuple[str, Manifest]]
) -> list[tuple[str, Manifest]]:
    """The ``(kind, object)`` pairs of ``owned`` (the objects of each of :data:`CHILD_KINDS`
    labelled as this cluster's children, as listed: a list's items carry no ``kind``) that neither
    ``desired`` (:func:`build_children`'s children) nor :func:`pass_made` names, in ``owned``'s
    order: a removed pool's children, a replaced model Job, the verifier's other kind once
    ``parallelism.nodes`` crosses 1, the router's and GKE's objects once off, the NetworkPolicies
    once disabled."""
    keep = {(c["kind"], c["metadata"]["name"]) for c in desired} | pass_made(name, cluster)
    return [(kind, obj) for kind, obj in owned if (kind, obj["metadata"]["name"]) not in keep]
