"""How the cluster's pods are reached: the verifier's, the gateway's and each pool's Service, and
the NetworkPolicies that admit only what each port is for (the metrics ports to the metrics
sources and the operator, a pool's gRPC to the cluster's verifiers)."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from cosine_spec.cluster_spec import ClusterSpec
from cosine_spec.contract import DRAFTER_GRPC_PORT, DRAFTER_METRICS_PORT, VERIFIER_HTTP_PORT, VERIFIER_METRICS_PORT

from cosine_operator import endpoint_picker
from cosine_operator.builders.names import (
    ROUTER_COMPONENT,
    WORKER_COMPONENT,
    Manifest,
    drafter_name,
    endpoint_picker_name,
    gateway_name,
    labels,
    selector_labels,
    verifier_name,
)
from cosine_operator.builders.router import EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by Kubernetes on every namespace


def build_verifier_service(name: str, namespace: str) -> Manifest:
    """Service ``N-verifier``: the in-cluster http port (8000)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": verifier_name(name), "namespace": namespace, "labels": labels(name, "verifier")},
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name, "verifier"),
            "ports": [
                {"name": "http", "port": VERIFIER_HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def build_gateway_service(name: str, namespace: str, cluster: ClusterSpec) -> Manifest:
    """Service ``N-gateway``: the OpenAI API, ``spec.gateway.port`` → the verifier's 8000, with the
    gateway's annotations, source ranges and load-balancer class as written."""
    gw = cluster.gateway
    out: Manifest = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": gateway_name(name), "namespace": namespace, "labels": labels(name, "gateway")},
        "spec": {
            "type": gw.service_type,
            "selector": selector_labels(name, "verifier"),
            "ports": [{"name": "http", "port": gw.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    if gw.annotations:
        out["metadata"]["annotations"] = dict(gw.annotations)
    if gw.load_balancer_source_ranges:
        out["spec"]["loadBalancerSourceRanges"] = list(gw.load_balancer_source_ranges)
    if gw.load_balancer_class:
        out["spec"]["loadBalancerClass"] = gw.load_balancer_class
    return out


def build_drafter_service(name: str, namespace: str, pool: str) -> Manifest:
    """Headless Service ``N-drafter-P``: one DNS record per pod for the verifier's gRPC balancing."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": drafter_name(name, pool),
            "namespace": namespace,
            "labels": labels(name, "drafter", pool),
        },
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(name, "drafter", pool),
            "ports": [
                {"name": "grpc", "port": DRAFTER_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
                {
                    "name": "metrics",
                    "port": DRAFTER_METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }


def operator_peer(namespace: str, pod_labels: Mapping[str, str]) -> dict[str, Any] | None:
    """The NetworkPolicy peer of the operator's own pods (its autoscaler scrapes the pods'
    metrics ports): its namespace by name and its pod labels; ``None`` if either is unknown."""
    if not namespace or not pod_labels:
        return None
    return {
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}},
        "podSelector": {"matchLabels": dict(pod_labels)},
    }


def metrics_sources(cluster: ClusterSpec, operator: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Who may reach the metrics ports: ``spec.networkPolicy.metricsFrom`` as written, else every
    pod of the cluster's namespace; plus the operator's pods (``operator``, see :func:`operator_peer`)."""
    given = cluster.network_policy.metrics_from
    peers = json.loads(json.dumps(list(given))) if given else [{"podSelector": {}}]
    if operator is not None:
        peers.append(json.loads(json.dumps(dict(operator))))
    return peers


def _network_policy(
    name: str, namespace: str, policy: str, component: str, pool: str | None, ingress: list[dict[str, Any]]
) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": policy, "namespace": namespace, "labels": labels(name, component, pool)},
        "spec": {
            "podSelector": {"matchLabels": selector_labels(name, component, pool)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _tcp(port: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port}]


def build_network_policies(
    name: str, namespace: str, cluster: ClusterSpec, operator: Mapping[str, Any] | None = None
) -> list[Manifest]:
    """NetworkPolicies (ingress only; egress stays open: model downloads, the verifier's calls):

    * ``N-verifier`` on the verifier pods: the http port (the OpenAI API, also behind the gateway
      Service, possibly a LoadBalancer) from anywhere; CoSine's metrics port from the metrics
      sources (:func:`metrics_sources`); nothing else;
    * per pool ``N-drafter-P`` on the pool's pods: gRPC only from this cluster's verifier pods,
      the metrics port from the metrics sources; nothing else;
    * with ``spec.router``, ``N-epp`` on the endpoint picker: ext_proc from ``gatewayFrom``, the
      metrics port from the metrics sources and, with ``provider: gke``, its gRPC health port
      from GKE's health checkers.

    Empty when ``spec.networkPolicy.enabled`` is false. Traffic from a pod's own node (kubelet
    probes) is always allowed by Kubernetes."""
    if not cluster.network_policy.enabled:
        return []
    sources = metrics_sources(cluster, operator)
    verifier = [
        {"ports": _tcp(VERIFIER_HTTP_PORT)},  # no `from`: every source
        {"from": sources, "ports": _tcp(VERIFIER_METRICS_PORT)},
    ]
    router = cluster.router.enabled
    if router:  # the endpoint picker reads the verifiers' metrics (vLLM's on http, CoSine's here)
        verifier[1]["from"].append({"podSelector": {"matchLabels": selector_labels(name, ROUTER_COMPONENT)}})
    out = [_network_policy(name, namespace, verifier_name(name), "verifier", None, verifier)]
    if cluster.verifier.nodes > 1:
        # a group's pods talk on ports vLLM and NCCL choose (torch.distributed's store, the
        # collectives): every port between the cluster's leaders and workers, nothing else
        group = [{"podSelector": {"matchLabels": selector_labels(name, c)}} for c in ("verifier", WORKER_COMPONENT)]
        out[0]["spec"]["ingress"].append({"from": group})
        out.append(_network_policy(name, namespace, f"{verifier_name(name)}-worker", WORKER_COMPONENT, None,
                                   [{"from": copy.deepcopy(group)}]))
    if router:
        gateway = [dict(p) for p in cluster.router.gateway_from]
        picker = [
            {**({"from": json.loads(json.dumps(gateway))} if gateway else {}), "ports": _tcp(EPP_GRPC_PORT)},
            {"from": copy.deepcopy(sources), "ports": _tcp(EPP_METRICS_PORT)},
        ]
        if cluster.router.provider == "gke":  # GKE's load balancer health-checks the picker on gRPC 9003
            picker.append({"from": [{"ipBlock": {"cidr": c}} for c in endpoint_picker.GKE_HEALTH_CHECK_RANGES],
                           "ports": _tcp(EPP_HEALTH_PORT)})
        out.append(_network_policy(name, namespace, endpoint_picker_name(name), ROUTER_COMPONENT, None, picker))
    for pool in cluster.drafter_pools:
        drafter = [
            {
                "from": [{"podSelector": {"matchLabels": selector_labels(name, "verifier")}}],
                "ports": _tcp(DRAFTER_GRPC_PORT),
            },
            {"from": copy.deepcopy(sources), "ports": _tcp(DRAFTER_METRICS_PORT)},
        ]
        out.append(_network_policy(name, namespace, drafter_name(name, pool.name), "drafter", pool.name, drafter))
    return out
