"""The model cache (``spec.modelCache``): its PersistentVolumeClaim, the Job that pulls every model
into it, and the pull container a pod without a cache runs before it starts; what a pull needs
(disk, memory, the Hugging Face token, the object stores' credentials)."""

from __future__ import annotations

import math
import re
from typing import Any

from cosine_spec.catalogue import gguf_source
from cosine_spec.cluster_spec import ClusterSpec
from cosine_spec.contract import COSINE_CACHE_ENV, MODEL_CACHE_DIR, MODEL_CREDENTIALS_DIR
from cosine_spec.pods import RUNTIME_ENV, RoleImage

from cosine_operator.builders.names import Manifest, labels, model_claim_name, model_job_name
from cosine_operator.builders.security import (
    CACHE_GIB,
    TMP_GIB,
    pod_security,
    read_only_root,
    restricted_container,
    writable_dirs,
)

_PARAMS = re.compile(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)([bm])(?![a-z])")


def model_storage_gib(model: str) -> int:
    """Disk a model's download takes, in GiB, from the parameter count in its name (``-1.5b-``,
    ``-135m-``): 2 bytes a parameter (16-bit weights, as most are published), plus a quarter and 1
    GiB for tokenizer, GGUF and headroom; 20 GiB when the name gives no count."""
    m = _PARAMS.search(model.lower().rsplit("/", 1)[-1])
    if m is None:
        return 20
    params = float(m.group(1)) * (1e9 if m.group(2) == "b" else 1e6)
    return math.ceil(params * 2 * 1.25 / 2**30) + 1


def pull_memory_gib(models: list[str]) -> int:
    """Memory a ``cosine models pull`` of ``models`` needs, in GiB: a model fetched as GGUF from
    PyPI (:data:`cosine_spec.catalogue.GGUF_ON_PYPI`, when the Hub is out of reach) is converted to
    float32 safetensors in memory, 4 bytes a parameter plus a quarter, and 1 GiB for the process;
    at least 2 GiB. Any other model is a Hub download, which streams to disk whatever its size."""
    need = 2
    for model in models:
        if gguf_source(model) != "pypi":
            continue
        m = _PARAMS.search(model.lower().rsplit("/", 1)[-1])
        if m is not None:
            params = float(m.group(1)) * (1e9 if m.group(2) == "b" else 1e6)
            need = max(need, math.ceil(params * 4 * 1.25 / 2**30) + 1)
    return need


def cluster_models(cluster: ClusterSpec) -> list[str]:
    """Every model a cluster's pods load, once each, in spec order (the verifier's first, then the
    engine drafter's, which the verifier loads beside the target)."""
    sp = cluster.verifier.speculator
    models = [cluster.verifier.model, *([sp.model] if sp is not None and sp.model else [])]
    models += [p.model for p in cluster.drafter_pools if p.model is not None]
    return list(dict.fromkeys(models))


def _hf_token_env(cluster: ClusterSpec) -> list[dict[str, Any]]:
    ref = cluster.hf_token
    if ref is None:
        return []
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


MODEL_CREDENTIALS_VOLUME = "model-credentials"


def model_credentials_volumes(cluster: ClusterSpec) -> list[dict[str, Any]]:
    """The pod volume of ``spec.modelCredentialsSecretRef``'s Secret, for a pod that runs
    :func:`pull_container` (none without one)."""
    ref = cluster.model_credentials
    if ref is None:
        return []
    return [{"name": MODEL_CREDENTIALS_VOLUME, "secret": {"secretName": ref.name}}]


# A namespace LimitRange's maxLimitRequestRatio for memory, as Kubernetes' own example sets it
# ("Configure Minimum and Maximum ... / limit-request ratio"): a limit at most twice the request.
PULL_LIMIT_REQUEST_RATIO = 2


def _pull_resources(limit_gib: int) -> dict[str, dict[str, str]]:
    """The pull's resources: its memory limit, a request within :data:`PULL_LIMIT_REQUEST_RATIO`
    of it (a LimitRange with that ratio admits the pod), no CPU limit."""
    request_mib = math.ceil(limit_gib * 1024 / PULL_LIMIT_REQUEST_RATIO)
    return {"requests": {"cpu": "250m", "memory": f"{request_mib}Mi", "ephemeral-storage": "1Gi"},
            "limits": {"memory": f"{limit_gib}Gi"}}


def pull_container(cluster: ClusterSpec, models: list[str], env: list[dict[str, Any]]) -> dict[str, Any]:
    """``cosine models pull`` of ``models`` into the ``models`` volume (the CPU image: pulling needs
    no GPU); the Hugging Face token and ``spec.modelCredentialsSecretRef``'s Secret (every key an
    environment variable, and the Secret mounted at ``MODEL_CREDENTIALS_DIR``: its pod needs
    :func:`model_credentials_volumes`), if any, reach this container only. A model already there
    is kept; a gated or unauthorised model fails it with that reason in its log."""
    image, policy = cluster.image.for_pod(RoleImage(), gpu=False)
    container: dict[str, Any] = {
        "name": "model-pull",
        "image": image,
        "imagePullPolicy": policy,
        "command": ["cosine"],
        "args": ["models", "pull", *models],
        "env": [*env, *_hf_token_env(cluster)],
        "resources": _pull_resources(pull_memory_gib(models)),
        "volumeMounts": [{"name": "models", "mountPath": MODEL_CACHE_DIR}],
        "securityContext": restricted_container(),
    }
    ref = cluster.model_credentials
    if ref is not None:
        container["envFrom"] = [{"secretRef": {"name": ref.name}}]
        container["volumeMounts"].append({"name": MODEL_CREDENTIALS_VOLUME, "mountPath": MODEL_CREDENTIALS_DIR,
                                          "readOnly": True})
    return container


def build_model_claim(name: str, namespace: str, cluster: ClusterSpec) -> Manifest | None:
    """PersistentVolumeClaim ``N-models`` when ``spec.modelCache`` names no existing claim; else
    ``None`` (no cache, or the user's claim)."""
    cache = cluster.model_cache
    if cache is None or cache.claim_name:
        return None
    spec: dict[str, Any] = {"accessModes": [cache.access_mode], "resources": {"requests": {"storage": cache.size}}}
    if cache.storage_class_name:
        spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": model_claim_name(name, cache), "namespace": namespace, "labels": labels(name, "models")},
        "spec": spec,
    }


def build_model_job(name: str, namespace: str, cluster: ClusterSpec) -> Manifest | None:
    """Job ``N-models-<hash>`` (:func:`model_job_name`): ``cosine models pull`` of every model of the
    cluster (:func:`cluster_models`) into ``spec.modelCache``'s claim, before any pod that loads
    them starts (reconcile waits for it to succeed); ``None`` without ``spec.modelCache`` or with
    ``prePopulated`` (the pods read the claim as it is). Three retries; its pods are kept for their logs.
    It runs as the verifier's ``serviceAccountName`` (when set): the workload identity bound to it
    (IRSA and EKS Pod Identity, keyed on the pod's service account by their admission webhook;
    GKE Workload Identity, by the node's metadata server) is what reads ``s3://`` and ``gs://``
    models without ``spec.modelCredentialsSecretRef``, as for a verifier pod that pulls its own."""
    cache = cluster.model_cache
    if cache is None or cache.pre_populated:
        return None
    models = cluster_models(cluster)
    pull = pull_container(cluster, models, [{"name": COSINE_CACHE_ENV, "value": MODEL_CACHE_DIR},
                                            *[{"name": k, "value": v} for k, v in RUNTIME_ENV.items()]])
    read_only_root(pull, gpu=False)
    pull["resources"]["requests"]["ephemeral-storage"] = f"{CACHE_GIB[False] + TMP_GIB}Gi"  # its emptyDirs
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,  # the identity webhooks project their own token
        "securityContext": pod_security(),
        "containers": [pull],
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": model_claim_name(name, cache)}},
                    *writable_dirs(gpu=False)[1], *model_credentials_volumes(cluster)],
    }
    account = cluster.verifier.pod.service_account_name
    if account:
        pod["serviceAccountName"] = account
    spec = {"backoffLimit": 3, "template": {"metadata": {"labels": labels(name, "models")}, "spec": pod}}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": model_job_name(name, spec), "namespace": namespace, "labels": labels(name, "models")},
        "spec": spec,
    }
