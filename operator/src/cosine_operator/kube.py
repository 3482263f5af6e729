"""The few Kubernetes API calls the operator makes, on one ``kubernetes_asyncio`` ApiClient.

Every call the operator makes is listed here (``CALLS``), and the chart's RBAC test checks the
rendered ClusterRole/Role grants exactly these plus what kopf itself needs.
Bodies go in and come out as plain dicts (no generated models).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from cosine_spec.contract import CLUSTER_KIND, CLUSTER_PLURAL, GROUP, POOL_KIND, POOL_PLURAL, VERSION
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from cosine_operator import endpoint_picker

Body = dict[str, Any]

# kind -> (API path prefix, plural)
_PATHS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Job": ("/apis/batch/v1", "jobs"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    # other projects' APIs (spec.router, spec.verifier.parallelism.nodes > 1), installed separately
    "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools"),
    "HTTPRoute": ("/apis/gateway.networking.k8s.io/v1", "httproutes"),
    "LeaderWorkerSet": ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "GCPBackendPolicy": ("/apis/networking.gke.io/v1", "gcpbackendpolicies"),  # spec.router.provider: gke
    "HealthCheckPolicy": ("/apis/networking.gke.io/v1", "healthcheckpolicies"),
    "DestinationRule": ("/apis/networking.istio.io/v1", "destinationrules"),  # spec.router.provider: istio
    POOL_KIND: (f"/apis/{GROUP}/{VERSION}", POOL_PLURAL),
    CLUSTER_KIND: (f"/apis/{GROUP}/{VERSION}", CLUSTER_PLURAL),
}
# Kinds of other projects' APIs: a cluster without their CRDs answers 404 (or 403) for them, and
# holds none of them.
FOREIGN_KINDS = ("InferencePool", "HTTPRoute", "LeaderWorkerSet", "GCPBackendPolicy", "HealthCheckPolicy",
                 "DestinationRule")

# (apiGroup, resource) -> verbs this module uses; kopf's own needs are in the chart's RBAC test.
CALLS: dict[tuple[str, str], set[str]] = {
    # applied (server-side apply creates a missing object: `create` as well as `patch`)
    ("", "configmaps"): {"create", "patch", "list", "delete"},
    ("", "services"): {"create", "patch", "list", "delete"},
    ("", "persistentvolumeclaims"): {"create", "patch", "list", "delete"},
    ("apps", "deployments"): {"get", "create", "patch", "list", "delete"},
    ("batch", "jobs"): {"get", "create", "patch", "list", "delete"},
    ("policy", "poddisruptionbudgets"): {"create", "patch", "list", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"create", "patch", "list", "delete"},
    ("", "pods"): {"list"},
    ("", "serviceaccounts"): {"create", "patch", "list", "delete"},
    ("rbac.authorization.k8s.io", "roles"): {"create", "patch", "list", "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"create", "patch", "list", "delete"},
    ("inference.networking.k8s.io", "inferencepools"): {"create", "patch", "list", "delete"},
    ("gateway.networking.k8s.io", "httproutes"): {"create", "patch", "list", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "create", "patch", "list", "delete"},
    ("networking.gke.io", "gcpbackendpolicies"): {"create", "patch", "list", "delete"},
    ("networking.gke.io", "healthcheckpolicies"): {"create", "patch", "list", "delete"},
    ("networking.istio.io", "destinationrules"): {"create", "patch", "list", "delete"},
    (GROUP, POOL_PLURAL): {"get", "create", "patch", "list", "delete"},
    (GROUP, f"{CLUSTER_PLURAL}/status"): {"patch"},
    (GROUP, CLUSTER_PLURAL): {"get"},
    (GROUP, f"{POOL_PLURAL}/status"): {"patch"},
}

# What the operator must hold beyond its calls to create the endpoint picker's Role: Kubernetes'
# RBAC refuses a Role that grants more than its creator holds (privilege escalation prevention),
# so every rule of the picker's Role (with several replicas, the largest) is the operator's too.
GRANTS: dict[tuple[str, str], set[str]] = {
    (group, resource): set(verbs) for group, resources, verbs in endpoint_picker.reads(replicas=2)
    for resource in resources
}

MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
# Server-side apply's field manager: the fields the operator last applied are its own, so a field
# dropped from the spec is dropped from the child (what a merge patch cannot do).
FIELD_MANAGER = "cosine-operator"
# The field manager a child's scale is handed over to after creation (Kubernetes' Server-Side Apply
# docs, "Transferring ownership": apply the field alone under a manager that never writes it again,
# then leave it out of the main configuration). It owns ``spec.replicas`` until a scaler (an HPA,
# KEDA, the pool follower, ``kubectl scale``) writes it and takes it; the operator's applies never
# carry it again, so they can neither revert a scaler nor remove the field.
SCALE_HANDOVER_MANAGER = "cosine-operator-scale-handover"


async def connect() -> client.ApiClient:
    """An ApiClient from the in-cluster service account, else ``KUBECONFIG``/``~/.kube/config``."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        # Read KUBECONFIG now: the library's default path was fixed when it was imported.
        await config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    return client.ApiClient()


def _path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = _PATHS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name is not None:
        path += f"/{name}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


async def _call(
    api: client.ApiClient,
    method: str,
    path: str,
    body: Any = None,
    content_type: str | None = None,
    query: list[tuple[str, str]] | None = None,
) -> Body:
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = content_type or "application/json"
    result = await api.call_api(
        path,
        method,
        query_params=query or [],
        header_params=headers,
        body=body,
        response_types_map={200: "object", 201: "object", 202: "object"},
        auth_settings=["BearerToken"],
        _return_http_data_only=True,
    )
    return dict(result or {})


def error_message(e: ApiException) -> str:
    """The API server's ``Status.message`` of a failed call, else its reason."""
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)
    except (ValueError, AttributeError):
        return str(e.reason)


async def get(api: client.ApiClient, kind: str, namespace: str, name: str) -> Body | None:
    """The object, or ``None`` if it does not exist."""
    try:
        return await _call(api, "GET", _path(kind, namespace, name))
    except ApiException as e:
        if e.status == 404:
            return None
        raise


async def list_owned(api: client.ApiClient, kind: str, namespace: str, cluster: str) -> list[Body]:
    """Objects of ``kind`` in ``namespace`` labelled as children of ``cluster``.

    The label selector is also checked here, so a server that ignores it still gives the right set.
    """
    query = [("labelSelector", f"cosine.dev/cluster={cluster}")]
    items = (await _call(api, "GET", _path(kind, namespace), query=query)).get("items") or []
    return [
        i for i in items if (i.get("metadata", {}).get("labels") or {}).get("cosine.dev/cluster") == cluster
    ]


async def patch(
    api: client.ApiClient,
    kind: str,
    namespace: str,
    name: str,
    body: Mapping[str, Any],
    subresource: str | None = None,
) -> Body | None:
    """JSON merge-patch as :data:`FIELD_MANAGER` (an ``Update``: it takes the fields it changes);
    ``None`` if the object is gone. A ``metadata.resourceVersion`` in ``body`` is a precondition
    (HTTP 409 if the object changed since). Raises ``ApiException`` on any other failure."""
    try:
        return await _call(api, "PATCH", _path(kind, namespace, name, subresource), dict(body), MERGE_PATCH,
                           [("fieldManager", FIELD_MANAGER)])
    except ApiException as e:
        if e.status == 404:
            return None
        raise


async def apply(api: client.ApiClient, body: Mapping[str, Any], manager: str = FIELD_MANAGER,
                force: bool = True) -> Body:
    """Server-side apply of ``body`` as ``manager``, forcing conflicts by default (the operator owns
    its children's fields): creates the object, or makes its fields the manager manages exactly
    ``body``'s (a field the last apply had and ``body`` has not is removed; fields other managers
    own, such as an HPA's replicas, stay). Returns the object. Raises ``ApiException`` (409 on a
    conflict with another manager's field when not ``force``)."""
    meta = body["metadata"]
    query = [("fieldManager", manager), ("force", "true" if force else "false")]
    path = _path(body["kind"], meta["namespace"], meta["name"])
    try:
        return await _call(api, "PATCH", path, dict(body), APPLY_PATCH, query)
    except ApiException as e:
        if not (e.status == 422 and _turned_recreate(body) and "rollingUpdate" in error_message(e)):
            raise
    # A Deployment turned Recreate still holds the rollingUpdate the server defaulted under
    # RollingUpdate: no apply owns a default, so the apply keeps it, and validation refuses the pair
    # (ValidateDeploymentStrategy: "may not be specified when strategy `type` is 'Recreate'";
    # kubernetes/kubernetes#24198). Dropped by a merge patch, the apply then holds.
    await patch(api, body["kind"], meta["namespace"], meta["name"],
                {"spec": {"strategy": {"type": "Recreate", "rollingUpdate": None}}})
    return await _call(api, "PATCH", path, dict(body), APPLY_PATCH, query)


def _turned_recreate(body: Mapping[str, Any]) -> bool:
    return body["kind"] == "Deployment" and ((body.get("spec") or {}).get("strategy") or {}).get("type") == "Recreate"


def applies(body: Mapping[str, Any], path: tuple[str, ...], manager: str = FIELD_MANAGER) -> bool:
    """Whether ``manager``'s apply owns the field at ``path`` of the live object ``body``
    (``metadata.managedFields``, FieldsV1: ``{"f:spec": {"f:replicas": {}}}``)."""
    for entry in (body.get("metadata") or {}).get("managedFields") or ():
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        node: Any = entry.get("fieldsV1") or {}
        for key in path:
            node = node.get(f"f:{key}") if isinstance(node, dict) else None
        if node is not None:
            return True
    return False


async def apply_scale_free(api: client.ApiClient, body: Mapping[str, Any]) -> Body:
    """Apply a child whose ``spec.replicas`` others write after its creation (a Deployment, a
    ``CoSineDrafterPool``): a new object is created with ``body``'s replicas; from then on the
    operator's applies leave ``spec.replicas`` out, and it stays whatever its scaler last wrote.

    An object whose replicas the operator's apply still owns (just created, or created by an
    operator before this one) first hands them over (:data:`SCALE_HANDOVER_MANAGER`, unforced: if
    a scaler wrote them meanwhile, it owns them already and the 409 says so); without that, leaving
    the field out would remove it and the Deployment would fall back to 1 replica. Returns the
    object as applied. Raises ``ApiException``."""
    meta, kind = body["metadata"], body["kind"]
    live = await get(api, kind, meta["namespace"], meta["name"])
    if live is None:
        live = await apply(api, body)
    if applies(live, ("spec", "replicas")):
        replicas = (live.get("spec") or {}).get("replicas")
        handover = {"apiVersion": body["apiVersion"], "kind": kind,
                    "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "spec": {"replicas": replicas}}
        try:
            await apply(api, handover, SCALE_HANDOVER_MANAGER, force=False)
        except ApiException as e:
            if e.status != 409:
                raise
    free = dict(body)
    free["spec"] = {k: v for k, v in (body.get("spec") or {}).items() if k != "replicas"}
    return await apply(api, free)


async def create(api: client.ApiClient, body: Mapping[str, Any]) -> Body | None:
    """Create ``body``; ``None`` if it exists already (HTTP 409). Its fields are owned by an update,
    not an apply, so later applies that leave a field out (a pool's scale) do not remove it.
    Raises ``ApiException`` on any other failure."""
    meta = body["metadata"]
    try:
        return await _call(api, "POST", _path(body["kind"], meta["namespace"]), dict(body),
                           query=[("fieldManager", FIELD_MANAGER)])
    except ApiException as e:
        if e.status == 409:
            return None
        raise


async def delete(api: client.ApiClient, kind: str, namespace: str, name: str) -> bool:
    """Delete (background propagation); ``False`` if it was already gone."""
    try:
        await _call(
            api,
            "DELETE",
            _path(kind, namespace, name),
            {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"},
        )
        return True
    except ApiException as e:
        if e.status == 404:
            return False
        raise
