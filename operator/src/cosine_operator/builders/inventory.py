"""The one inventory of a cluster's children: :func:`build_children` says what a spec implies."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cosine_spec.cluster_spec import ClusterSpec

from cosine_operator.builders.multinode import build_verifier
from cosine_operator.builders.names import Manifest
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
