"""The children's names, labels and selectors, and the type of a manifest: what every family and
the handlers agree on to find a child again."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from cosine_spec.cluster_spec import ModelCacheSpec
from cosine_spec.contract import CLUSTER_LABEL, COMPONENT_LABEL, POOL_LABEL

CONFIG_HASH_ANNOTATION = "cosine.dev/config-hash"
MANAGED_BY = "cosine-operator"
# the components beside "verifier", "drafter", "gateway", "config" and "models": a multi-node
# verifier's workers (a LeaderWorkerSet's) and spec.router's objects
WORKER_COMPONENT = "verifier-worker"
ROUTER_COMPONENT = "router"

Manifest = dict[str, Any]


def config_name(cluster: str) -> str:
    """The ConfigMap's name, ``N-config``."""
    return f"{cluster}-config"


def verifier_name(cluster: str) -> str:
    """The verifier Deployment's and Service's name, ``N-verifier``."""
    return f"{cluster}-verifier"


def gateway_name(cluster: str) -> str:
    """The gateway Service's name, ``N-gateway``."""
    return f"{cluster}-gateway"


def drafter_name(cluster: str, pool: str) -> str:
    """Pool ``P``'s Deployment and headless Service name, ``N-drafter-P``."""
    return f"{cluster}-drafter-{pool}"


def fallback_name(cluster: str, pool: str) -> str:
    """A spot pool's on-demand sibling Deployment, ``N-drafter-P-ondemand``."""
    return f"{drafter_name(cluster, pool)}-ondemand"


def model_claim_name(cluster: str, cache: ModelCacheSpec) -> str:
    """The model cache's PersistentVolumeClaim: ``spec.modelCache.claimName``, else ``N-models``
    (created by the operator)."""
    return cache.claim_name or f"{cluster}-models"


def model_job_name(cluster: str, job_spec: Mapping[str, Any]) -> str:
    """The model pull Job's name, ``N-models-<hash>``, the hash of the Job's whole ``spec``: a Job's
    pod template is immutable (the API server answers 422 to a changed one), so whatever changes it
    (the model list, the image or the release's default tag, the token's Secret) makes a new Job,
    never an update of the old one."""
    digest = hashlib.sha256(json.dumps(job_spec, sort_keys=True).encode()).hexdigest()[:8]
    return f"{cluster}-models-{digest}"


def pool_object_name(cluster: str, pool: str) -> str:
    """Pool ``P``'s ``CoSineDrafterPool`` name, ``N-P``."""
    return f"{cluster}-{pool}"


def labels(cluster: str, component: str, pool: str | None = None) -> dict[str, str]:
    """Recommended labels plus ours; ``selector_labels`` is the immutable subset."""
    out = {
        "app.kubernetes.io/name": "cosine",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(cluster, component, pool),
    }
    return out


def selector_labels(cluster: str, component: str, pool: str | None = None) -> dict[str, str]:
    """Labels that select a component's pods (instance, cluster, component and, for a pool, pool);
    immutable once a Deployment exists."""
    out = {"app.kubernetes.io/instance": cluster, CLUSTER_LABEL: cluster, COMPONENT_LABEL: component}
    if pool is not None:
        out[POOL_LABEL] = pool
    return out


def pool_selector(cluster: str, pool: str) -> str:
    """The label selector of a pool's pods as a string (``status.selector``, for HPA)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(cluster, "drafter", pool).items())


def verifier_selector(cluster: str) -> str:
    """The label selector of the verifier's pods as a string (``status.verifier.selector``, for HPA)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(cluster, "verifier").items())


def router_name(cluster: str) -> str:
    """The InferencePool and HTTPRoute of a cluster with ``spec.router``: ``N-router``."""
    return f"{cluster}-router"


def endpoint_picker_name(cluster: str) -> str:
    """The endpoint picker's Deployment, Service, ServiceAccount, Role, RoleBinding and ConfigMap: ``N-epp``."""
    return f"{cluster}-epp"
