"""``spec.router``: the Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1,
GIE v1.0), the Gateway API's HTTPRoute (gateway.networking.k8s.io/v1, Gateway API v1.3) and
llm-d's endpoint picker (what it needs: :mod:`cosine_operator.endpoint_picker`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import yaml
from cosine_spec.cluster_spec import ClusterSpec
from cosine_spec.contract import VERIFIER_HTTP_PORT
from cosine_spec.pods import RoleImage

from cosine_operator import config_hashes, endpoint_picker
from cosine_operator.builders.names import (
    ROUTER_COMPONENT,
    Manifest,
    endpoint_picker_name,
    labels,
    router_name,
    selector_labels,
)
from cosine_operator.builders.pods import build_deployment
from cosine_operator.builders.security import pod_security, restricted_container

INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
HTTPROUTE_API_VERSION = "gateway.networking.k8s.io/v1"
EPP_GRPC_PORT = endpoint_picker.GRPC_PORT
EPP_HEALTH_PORT = endpoint_picker.HEALTH_PORT
EPP_METRICS_PORT = endpoint_picker.METRICS_PORT
EPP_CONFIG_DIR = endpoint_picker.CONFIG_DIR


def build_router(name: str, namespace: str, cluster: ClusterSpec) -> list[Manifest]:
    """``spec.router.enabled``: the InferencePool ``N-router`` of the verifier pods (the leaders of a
    multi-node verifier), its endpoint picker (ServiceAccount, Role and RoleBinding as llm-d's
    charts grant them, the configuration ConfigMap, Deployment and Service ``N-epp``), the
    HTTPRoute ``N-router`` from ``spec.router.gatewayName`` to the pool and, with
    ``spec.router.provider: gke``, GKE's policies on the pool, with ``istio`` Istio's
    DestinationRule ``N-epp`` to the picker; empty when off (the operator then deletes the ones it
    made)."""
    r = cluster.router
    if not r.enabled:
        return []
    epp = endpoint_picker_name(name)
    meta = lambda n: {"name": n, "namespace": namespace, "labels": labels(name, ROUTER_COMPONENT)}  # noqa: E731
    pool = {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": meta(router_name(name)),
        "spec": {
            "selector": {"matchLabels": selector_labels(name, "verifier")},
            "targetPorts": [{"number": VERIFIER_HTTP_PORT}],
            "endpointPickerRef": {"name": epp, "port": {"number": EPP_GRPC_PORT}, "failureMode": r.failure_mode},
        },
    }
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": r.gateway_name}
    if r.gateway_namespace:
        parent["namespace"] = r.gateway_namespace
    rule: dict[str, Any] = {
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": router_name(name)}],
    }
    if r.provider != "gke":  # GKE's backend timeout is the GCPBackendPolicy's (llm-d's httproute.yaml)
        rule["timeouts"] = {"request": "0s"}  # streamed completions outlive a gateway's default
    route = {
        "apiVersion": HTTPROUTE_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": meta(router_name(name)),
        "spec": {"parentRefs": [parent], "rules": [rule]},
    }
    picker = _endpoint_picker(name, namespace, cluster, meta)
    if r.provider == "gke":
        extra = endpoint_picker.gke_policies(router_name(name), meta(router_name(name)))
    elif r.provider == "istio":
        extra = [endpoint_picker.istio_destination_rule(epp, meta(epp))]
    else:
        extra = []
    return [*picker, pool, route, *extra]


def _endpoint_picker(name: str, namespace: str, cluster: ClusterSpec,
                     meta: Callable[[str], dict[str, Any]]) -> list[Manifest]:
    """The endpoint picker ``N-epp``: its ServiceAccount, Role and RoleBinding (as llm-d's charts
    grant them), configuration ConfigMap, Service and Deployment, in that order."""
    r = cluster.router
    epp = endpoint_picker_name(name)
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(epp)}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(epp),
            "rules": endpoint_picker.role_rules(r.replicas)}
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta(epp),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": epp},
        "subjects": [{"kind": "ServiceAccount", "name": epp, "namespace": namespace}],
    }
    picker_config = endpoint_picker.config(cluster)
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(epp),
              "data": {"config.yaml": yaml.safe_dump(picker_config, sort_keys=False)}}
    container = {
        "name": "epp",
        "image": r.image,
        "imagePullPolicy": cluster.image.for_pod(RoleImage(), gpu=False)[1],  # the pull policy only
        "args": endpoint_picker.args(router_name(name), namespace, r.replicas, picker_config),
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"}],
        **endpoint_picker.probes(),
        "resources": json.loads(json.dumps(r.resources or endpoint_picker.RESOURCES)),
        "securityContext": restricted_container(),
        "volumeMounts": [{"name": "config", "mountPath": EPP_CONFIG_DIR, "readOnly": True}],
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": epp,  # it watches the InferencePool and its pods
        "securityContext": pod_security(),
        "terminationGracePeriodSeconds": endpoint_picker.grace_s(cluster.verifier.termination_grace_s),
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": epp}}],
    }
    if r.node_selector:
        pod_spec["nodeSelector"] = dict(r.node_selector)
    if r.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in r.tolerations]
    # Recreate, as llm-d's chart: only the leader is ready (health.go), so a rolling update's
    # new pods never become ready while the old leader holds the lease, and the roll never ends
    deployment = build_deployment(name, namespace, epp, ROUTER_COMPONENT, None, r.replicas, pod_spec, EPP_METRICS_PORT,
                                  config_hashes.router_hash(cluster), {"type": "Recreate"})
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(epp),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name, ROUTER_COMPONENT),
            # as llm-d's routerlib/_service.yaml declares ext_proc: Kubernetes' standard h2c value
            "ports": [{"name": "grpc", "port": EPP_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                       "appProtocol": "kubernetes.io/h2c"},
                      {"name": "metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}],
        },
    }
    return [account, role, binding, config, service, deployment]
