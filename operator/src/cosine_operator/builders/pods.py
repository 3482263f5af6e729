"""The pods of every role: a pod spec around a role's container (image, models, security, the
spec's verbatim overrides), its template (labels, scrape annotations, config hash), a Deployment
of it, its rollout strategy and its health probes."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from cosine_spec.cluster_spec import ClusterSpec, DrafterTLSSpec
from cosine_spec.contract import CONFIG_DIR, COSINE_CACHE_ENV, GPU_RESOURCE, MODEL_CACHE_DIR, TLS_DIR
from cosine_spec.pods import RUNTIME_ENV, PodOverrides, RoleImage

from cosine_operator.builders.names import (
    CONFIG_HASH_ANNOTATION,
    Manifest,
    config_name,
    labels,
    model_claim_name,
    selector_labels,
)
from cosine_operator.builders.security import (
    CACHE_GIB,
    TMP_GIB,
    pod_security,
    read_only_root,
    restricted_container,
    writable_dirs,
)
from cosine_operator.builders.storage import model_credentials_volumes, model_storage_gib, pull_container

# The taint GKE puts on GPU node pools and the one EKS GPU node groups are usually given.
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
TLS_VOLUME = "drafter-tls"


def _tolerations(pod: PodOverrides) -> list[dict[str, Any]]:
    tolerations = [dict(t) for t in pod.tolerations]
    if pod.requests_gpu and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
        tolerations.append(dict(GPU_TOLERATION))
    return tolerations


# A role's container requests when its spec gives no `resources`: requests only (no limit), so its
# pods are Burstable, never BestEffort (the first evicted under node pressure), and fit a small node.
DEFAULT_RESOURCES: dict[str, dict[str, dict[str, str]]] = {
    "verifier": {"requests": {"cpu": "1", "memory": "4Gi"}},
    "drafter": {"requests": {"cpu": "500m", "memory": "1Gi"}},
}


EPHEMERAL_STORAGE = "ephemeral-storage"


def with_disk(resources: dict[str, Any], gib: int) -> dict[str, Any]:
    """``resources`` requesting ``gib`` GiB of ephemeral storage (the pod's emptyDirs on disk: the
    scheduler places the pod where they fit, the kubelet evicts it past a sizeLimit), unless they
    already name ephemeral storage; everything else as written."""
    if any(EPHEMERAL_STORAGE in (resources.get(k) or {}) for k in ("requests", "limits")):
        return resources
    return {**resources, "requests": {**(resources.get("requests") or {}), EPHEMERAL_STORAGE: f"{gib}Gi"}}


def build_pod_spec(
    cluster: ClusterSpec,
    pod: PodOverrides,
    role_image: RoleImage,
    container: dict[str, Any],
    name: str,
    models: list[str],
    termination_grace_s: int,
    tls: DrafterTLSSpec | None = None,
    shm: bool = False,
) -> dict[str, Any]:
    """A pod spec around ``container``: the role's image for its device (:meth:`ImageSpec.for_pod`),
    its models from ``spec.modelCache``'s claim mounted read-only or else pulled into an
    ``emptyDir`` by an init container, the pod template fields of ``pod`` verbatim, and a security
    context Pod Security ``restricted`` admits, with a read-only root filesystem (:func:`writable_dirs`
    are where the runtime writes). ``shm``: a memory-backed ``/dev/shm`` (vLLM's engine processes
    exchange tensors through shared memory, more than a container's default 64 MiB)."""
    gpu = pod.requests_gpu
    image, policy = cluster.image.for_pod(role_image, gpu)
    cache = cluster.model_cache
    model_gib = 0 if cache else sum(model_storage_gib(m) for m in models) if models else 1
    resources = with_disk(json.loads(json.dumps(dict(pod.resources) or DEFAULT_RESOURCES[container["name"]])),
                          model_gib + CACHE_GIB[gpu] + TMP_GIB)
    container = {
        "image": image,
        "imagePullPolicy": policy,
        "resources": resources,
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "models", "mountPath": MODEL_CACHE_DIR, **({"readOnly": True} if cache else {})},
            *[dict(m) for m in pod.volume_mounts],
        ],
        "securityContext": restricted_container(),
        **container,
    }
    if cache is not None:
        models_volume: dict[str, Any] = {
            "name": "models",
            "persistentVolumeClaim": {"claimName": model_claim_name(name, cache), "readOnly": True},
        }
    else:
        models_volume = {"name": "models", "emptyDir": {"sizeLimit": f"{model_gib}Gi"}}
    read_only_root(container, gpu)
    spec: dict[str, Any] = {
        # the runtime never calls the Kubernetes API: no service-account token in its pods
        "automountServiceAccountToken": False,
        "securityContext": pod_security(),
        "terminationGracePeriodSeconds": termination_grace_s,
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": config_name(name)}},
            models_volume,
            *writable_dirs(gpu)[1],
            *[json.loads(json.dumps(dict(v))) for v in pod.volumes],
        ],
    }
    if models and cache is None:
        pull = pull_container(cluster, models, container_env(pod, []))
        read_only_root(pull, gpu)
        # the download lands in the emptyDir: the pod's ephemeral storage, reserved here
        pull["resources"]["requests"]["ephemeral-storage"] = models_volume["emptyDir"]["sizeLimit"]
        spec["initContainers"] = [pull]
        spec["volumes"] += model_credentials_volumes(cluster)
    if shm:
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
        spec["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    if tls is not None:
        container["volumeMounts"].append({"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True})
        spec["volumes"].append({"name": TLS_VOLUME, "secret": {"secretName": tls.secret_name}})
    return {**spec, **_placement(pod)}


def _placement(pod: PodOverrides) -> dict[str, Any]:
    """The pod spec's fields ``pod`` sets verbatim: scheduling, identity, image pull secrets (the
    GPU toleration added for a GPU pod)."""
    spec: dict[str, Any] = {}
    if pod.node_selector:
        spec["nodeSelector"] = dict(pod.node_selector)
    tolerations = _tolerations(pod)
    if tolerations:
        spec["tolerations"] = tolerations
    if pod.affinity:
        spec["affinity"] = json.loads(json.dumps(dict(pod.affinity)))
    if pod.topology_spread_constraints:
        spec["topologySpreadConstraints"] = json.loads(json.dumps([dict(t) for t in pod.topology_spread_constraints]))
    if pod.image_pull_secrets:
        spec["imagePullSecrets"] = [dict(x) for x in pod.image_pull_secrets]
    for key, value in (("serviceAccountName", pod.service_account_name),
                       ("priorityClassName", pod.priority_class_name),
                       ("runtimeClassName", pod.runtime_class_name)):
        if value:
            spec[key] = value
    return spec


def container_env(pod: PodOverrides, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runtime's environment: the model cache, :data:`cosine_spec.pods.RUNTIME_ENV` (its caches
    in :func:`writable_dirs`, no usage statistics), ``extra``, then the spec's ``env`` (which wins)."""
    return [{"name": COSINE_CACHE_ENV, "value": MODEL_CACHE_DIR},
            *[{"name": k, "value": v} for k, v in RUNTIME_ENV.items()], *extra, *[dict(e) for e in pod.env]]


def surge_update(max_surge: int) -> dict[str, int]:
    """A rolling update's bounds that surge ``max_surge`` replicas: from 1, none goes before its
    successor is Ready (``maxUnavailable`` 0); at 0, one goes first (both 0 is refused, by
    Deployments and LeaderWorkerSets alike)."""
    return {"maxSurge": max_surge, "maxUnavailable": 0 if max_surge else 1}


def rollout_strategy(pod: PodOverrides, max_surge: int | None = None) -> dict[str, Any]:
    """The pod's ``strategy`` as written; else with ``max_surge`` (the verifier's
    ``rollout.maxSurge``) a rolling update of :func:`surge_update`; else, for a GPU pod, a rolling
    update that surges none (a new pod takes the old one's GPU: an update needs no spare GPU); else
    Kubernetes' default."""
    if pod.strategy:
        return json.loads(json.dumps(dict(pod.strategy)))
    if max_surge is not None:
        return {"type": "RollingUpdate", "rollingUpdate": surge_update(max_surge)}
    if pod.requests_gpu:
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}


def _resolve(value: int | str, replicas: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        exact = replicas * float(value[:-1]) / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


def unavailable_replicas(strategy: dict[str, Any], replicas: int) -> int:
    """How many of ``replicas`` a roll under ``strategy`` (a Deployment's; a LeaderWorkerSet's
    ``rollingUpdateConfiguration`` as its ``rollingUpdate``) may take down before their successors
    are Ready, as the controllers resolve it: ``maxUnavailable`` (a percentage rounded down, 25% by
    default), 1 when it and ``maxSurge`` (rounded up) both come to 0; all of them for ``Recreate``."""
    if strategy.get("type") == "Recreate":
        return replicas
    bounds = strategy.get("rollingUpdate") or {}
    unavailable = _resolve(bounds.get("maxUnavailable", "25%"), replicas, round_up=False)
    surge = _resolve(bounds.get("maxSurge", "25%"), replicas, round_up=True)
    return 1 if unavailable == 0 and surge == 0 else unavailable


def pod_template(
    name: str,
    component: str,
    pool: str | None,
    pod_spec: dict[str, Any],
    metrics_port: int,
    spec_hash: str,
    pod: PodOverrides | None = None,
) -> dict[str, Any]:
    """A pod template; ``pod``'s ``podLabels`` and ``podAnnotations`` join ours (ours win on a
    clash: the selector and the scrape annotations must stay)."""
    extra_labels = dict(pod.pod_labels) if pod else {}
    extra_annotations = dict(pod.pod_annotations) if pod else {}
    return {
        "metadata": {
            "labels": {**extra_labels, **labels(name, component, pool)},
            "annotations": {
                **extra_annotations,
                CONFIG_HASH_ANNOTATION: spec_hash,
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(metrics_port),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }


def build_deployment(
    name: str,
    namespace: str,
    deployment: str,
    component: str,
    pool: str | None,
    replicas: int,
    pod_spec: dict[str, Any],
    metrics_port: int,
    spec_hash: str,
    strategy: dict[str, Any],
    pod: PodOverrides | None = None,
) -> Manifest:
    """A Deployment of :func:`pod_template`'s pods."""
    return deployment_of(name, namespace, deployment, component, pool, replicas, strategy,
                          pod_template(name, component, pool, pod_spec, metrics_port, spec_hash, pod))


def deployment_of(name: str, namespace: str, deployment: str, component: str, pool: str | None, replicas: int,
                   strategy: dict[str, Any], template: dict[str, Any]) -> Manifest:
    """Deployment ``deployment`` of a component's pods (``template``), selected by its selector labels."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment, "namespace": namespace, "labels": labels(name, component, pool)},
        "spec": {
            "replicas": replicas,
            "strategy": strategy,
            "selector": {"matchLabels": selector_labels(name, component, pool)},
            "template": template,
        },
    }


def health_probes(check: dict[str, Any], startup_timeout_s: int) -> dict[str, Any]:
    """Startup (the model load: up to ``startup_timeout_s``), readiness (taken out of the Service
    after 15 s failing) and liveness (restarted after 60 s failing, once started) on one check."""
    period = 10
    # 5 s per check, not the kubelet's 1 s: a loaded server (vLLM's /health waits behind a busy
    # event loop; a compute-bound CPU pod) answers late, and a late answer must not take it out
    timeout = {"timeoutSeconds": 5}
    return {
        "startupProbe": {**copy.deepcopy(check), **timeout, "periodSeconds": period,
                         "failureThreshold": math.ceil(startup_timeout_s / period)},
        "readinessProbe": {**copy.deepcopy(check), **timeout, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**copy.deepcopy(check), **timeout, "periodSeconds": period, "failureThreshold": 6},
    }
