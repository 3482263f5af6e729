"""Pure builders of a ``CoSineCluster``'s children: plain manifest dicts, no API calls.

For a cluster ``N`` in namespace ``NS`` (the runtime contract):

* ConfigMap ``N-config``, key ``cluster.yaml``: the CoSineCluster (apiVersion, kind, metadata.name,
  spec) the runtime reads from ``/etc/cosine/cluster.yaml``;
* Deployment + Service ``N-verifier`` (http 8000: vLLM's OpenAI server, /health, /metrics; metrics 9091:
  CoSine's series) and the gateway Service ``N-gateway`` (``spec.gateway.serviceType``, ``port`` → 8000);
* per drafter pool ``P``: Deployment ``N-drafter-P``, headless Service ``N-drafter-P`` (grpc 50052,
  metrics 9090) and the scale target ``CoSineDrafterPool`` ``N-P``. The pool's ``spec.replicas``
  (its ``scale`` subresource: the operator's autoscaler, HPA/KEDA or ``kubectl scale`` write it) is
  the one value the Deployment's replicas follow. Every builder gives ``replicas`` for creation
  only: the operator applies an existing Deployment or pool without them
  (``kube.apply_scale_free``), so it never changes a scale after creation.
* NetworkPolicies (``spec.networkPolicy.enabled``): ``N-verifier`` (http from anywhere, metrics from
  the metrics sources) and per pool ``N-drafter-P`` (gRPC from the cluster's verifier pods only,
  metrics from the metrics sources): :func:`build_network_policies`;
* with ``spec.drafterTLS``, its Secret mounted read-only at ``TLS_DIR`` in drafter and verifier pods.

Every builder takes the spec parsed once (:class:`~cosine_spec.cluster_spec.ClusterSpec`).
Owner references are not set here; the handlers ``kopf.adopt()`` every child.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import yaml
from cosine_spec.catalogue import gguf_source
from cosine_spec.cluster_spec import ClusterSpec, DrafterPoolSpec, DrafterTLSSpec, ModelCacheSpec, SpotSpec
from cosine_spec.contract import (
    CAPACITY_LABEL,
    CLUSTER_KIND,
    CLUSTER_LABEL,
    COMPONENT_LABEL,
    CONFIG_DIR,
    CONFIG_FILE,
    COSINE_API_KEY_ENV,
    COSINE_CACHE_ENV,
    DRAFTER_GRPC_PORT,
    DRAFTER_METRICS_PORT,
    GPU_RESOURCE,
    GROUP,
    LWS_LEADER_ADDRESS,
    MODEL_CACHE_DIR,
    MODEL_CREDENTIALS_DIR,
    POOL_KIND,
    POOL_LABEL,
    TLS_DIR,
    VERIFIER_HTTP_PORT,
    VERIFIER_METRICS_PORT,
    VERSION,
)
from cosine_spec.pods import PodOverrides, RoleImage

from cosine_operator import capacity_placement, config_hashes, endpoint_picker

# The taint GKE puts on GPU node pools and the one EKS GPU node groups are usually given.
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
CONFIG_HASH_ANNOTATION = "cosine.dev/config-hash"
MANAGED_BY = "cosine-operator"
RUN_AS_USER = 10001  # the image's non-root user (Dockerfile)
TLS_VOLUME = "drafter-tls"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by Kubernetes on every namespace

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


def runtime_document(name: str, cluster: ClusterSpec) -> dict[str, Any]:
    """The CoSineCluster as the runtime reads it: apiVersion, kind, metadata.name, spec (as written)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": CLUSTER_KIND,
        "metadata": {"name": name},
        "spec": copy.deepcopy(dict(cluster.raw)),
    }


def build_config_map(name: str, namespace: str, cluster: ClusterSpec) -> Manifest:
    """ConfigMap ``N-config`` with ``cluster.yaml``."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_name(name), "namespace": namespace, "labels": labels(name, "config")},
        "data": {"cluster.yaml": yaml.safe_dump(runtime_document(name, cluster), sort_keys=False)},
    }


def on_capacity(pool: DrafterPoolSpec, spot: SpotSpec | None) -> tuple[PodOverrides, int]:
    """(pod overrides, termination grace in s) of ``pool``'s pods on its capacity: on spot, the
    provider's node selector and toleration are added to the pool's own (a key the pool sets
    itself wins) and the grace is capped to what the provider's notice leaves a pod
    (:data:`cosine_spec.spot.SPOT_PROVIDERS`); on demand, the pool's as written."""
    if pool.capacity != "spot" or spot is None:
        return pool.pod, pool.grace_s(spot)
    cap = spot.capacity
    tolerations = tuple(pool.pod.tolerations)
    if cap.toleration is not None and not any(t.get("key") == cap.toleration["key"] for t in tolerations):
        tolerations += (dict(cap.toleration),)
    pod = replace(pool.pod, node_selector={**cap.node_selector, **pool.pod.node_selector}, tolerations=tolerations)
    return pod, pool.grace_s(spot)


def _tolerations(pod: PodOverrides) -> list[dict[str, Any]]:
    tolerations = [dict(t) for t in pod.tolerations]
    if pod.requests_gpu and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
        tolerations.append(dict(GPU_TOLERATION))
    return tolerations


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


def _restricted_container() -> dict[str, Any]:
    """A container security context Pod Security ``restricted`` admits (the pod's sets the rest)."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _hf_token_env(cluster: ClusterSpec) -> list[dict[str, Any]]:
    ref = cluster.hf_token
    if ref is None:
        return []
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


MODEL_CREDENTIALS_VOLUME = "model-credentials"


def _model_credentials_volumes(cluster: ClusterSpec) -> list[dict[str, Any]]:
    """The pod volume of ``spec.modelCredentialsSecretRef``'s Secret, for a pod that runs
    :func:`_pull_container` (none without one)."""
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


def _pull_container(cluster: ClusterSpec, models: list[str], env: list[dict[str, Any]]) -> dict[str, Any]:
    """``cosine models pull`` of ``models`` into the ``models`` volume (the CPU image: pulling needs
    no GPU); the Hugging Face token and ``spec.modelCredentialsSecretRef``'s Secret (every key an
    environment variable, and the Secret mounted at ``MODEL_CREDENTIALS_DIR``: its pod needs
    :func:`_model_credentials_volumes`), if any, reach this container only. A model already there
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
        "securityContext": _restricted_container(),
    }
    ref = cluster.model_credentials
    if ref is not None:
        container["envFrom"] = [{"secretRef": {"name": ref.name}}]
        container["volumeMounts"].append({"name": MODEL_CREDENTIALS_VOLUME, "mountPath": MODEL_CREDENTIALS_DIR,
                                          "readOnly": True})
    return container


# A role's container requests when its spec gives no `resources`: requests only (no limit), so its
# pods are Burstable, never BestEffort (the first evicted under node pressure), and fit a small node.
DEFAULT_RESOURCES: dict[str, dict[str, dict[str, str]]] = {
    "verifier": {"requests": {"cpu": "1", "memory": "4Gi"}},
    "drafter": {"requests": {"cpu": "500m", "memory": "1Gi"}},
}


def _pod_spec(
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
    context Pod Security ``restricted`` admits. ``shm``: a memory-backed ``/dev/shm`` (vLLM's
    engine processes exchange tensors through shared memory, more than a container's default 64 MiB)."""
    image, policy = cluster.image.for_pod(role_image, pod.requests_gpu)
    cache = cluster.model_cache
    resources = dict(pod.resources) or DEFAULT_RESOURCES[container["name"]]
    container = {
        "image": image,
        "imagePullPolicy": policy,
        "resources": json.loads(json.dumps(resources)),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "models", "mountPath": MODEL_CACHE_DIR, **({"readOnly": True} if cache else {})},
            *[dict(m) for m in pod.volume_mounts],
        ],
        "securityContext": _restricted_container(),
        **container,
    }
    if cache is not None:
        models_volume: dict[str, Any] = {
            "name": "models",
            "persistentVolumeClaim": {"claimName": model_claim_name(name, cache), "readOnly": True},
        }
    else:
        gib = sum(model_storage_gib(m) for m in models) if models else 1
        models_volume = {"name": "models", "emptyDir": {"sizeLimit": f"{gib}Gi"}}
    spec: dict[str, Any] = {
        # the runtime never calls the Kubernetes API: no service-account token in its pods
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(),
        "terminationGracePeriodSeconds": termination_grace_s,
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": config_name(name)}},
            models_volume,
            *[json.loads(json.dumps(dict(v))) for v in pod.volumes],
        ],
    }
    if models and cache is None:
        pull = _pull_container(cluster, models, _env(pod, []))
        # the download lands in the emptyDir: the pod's ephemeral storage, reserved here
        pull["resources"]["requests"]["ephemeral-storage"] = models_volume["emptyDir"]["sizeLimit"]
        spec["initContainers"] = [pull]
        spec["volumes"] += _model_credentials_volumes(cluster)
    if shm:
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
        spec["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    if tls is not None:
        container["volumeMounts"].append({"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True})
        spec["volumes"].append({"name": TLS_VOLUME, "secret": {"secretName": tls.secret_name}})
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


def _env(pod: PodOverrides, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"name": COSINE_CACHE_ENV, "value": MODEL_CACHE_DIR}, *extra, *[dict(e) for e in pod.env]]


def _strategy(pod: PodOverrides) -> dict[str, Any]:
    """The pod's ``strategy`` as written; else, for a GPU pod, a rolling update that surges none
    (a new pod takes the old one's GPU: an update needs no spare GPU); else Kubernetes' default."""
    if pod.strategy:
        return json.loads(json.dumps(dict(pod.strategy)))
    if pod.requests_gpu:
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}


def _template(
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


def _deployment(
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
    """A Deployment of :func:`_template`'s pods."""
    return _deployment_of(name, namespace, deployment, component, pool, replicas, strategy,
                          _template(name, component, pool, pod_spec, metrics_port, spec_hash, pod))


def _deployment_of(name: str, namespace: str, deployment: str, component: str, pool: str | None, replicas: int,
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


def _probes(check: dict[str, Any], startup_timeout_s: int) -> dict[str, Any]:
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


def _verifier_template(name: str, namespace: str, cluster: ClusterSpec) -> dict[str, Any]:
    """The verifier's pod template (labels, scrape annotations, spec): a Deployment's pods, or a
    LeaderWorkerSet group's leader."""
    v = cluster.verifier
    args = [
        "verifier",
        "--cluster",
        CONFIG_FILE,
        "--http-port",
        str(VERIFIER_HTTP_PORT),
        "--metrics-port",
        str(VERIFIER_METRICS_PORT),
        "--host",
        "0.0.0.0",  # the runtime binds loopback unless told otherwise
    ]
    for pool in cluster.drafter_pools:
        target = f"dns:///{drafter_name(name, pool.name)}.{namespace}.svc:{DRAFTER_GRPC_PORT}"
        args += ["--drafter", f"{pool.name}={target}"]
    tls = cluster.drafter_tls
    if tls is not None:
        args += ["--drafter-tls-dir", TLS_DIR]
        if tls.server_name:
            args += ["--drafter-tls-server-name", tls.server_name]
    extra_env: list[dict[str, Any]] = []
    gw = cluster.gateway
    if gw.api_key_secret is not None:
        ref = {"name": gw.api_key_secret.name, "key": gw.api_key_secret.key}
        extra_env.append({"name": COSINE_API_KEY_ENV, "valueFrom": {"secretKeyRef": ref}})
    container = {
        "name": "verifier",
        "command": ["cosine"],
        "args": args,
        # a deleted pod leaves the Services' endpoints at once, load balancers later: keep serving
        # meanwhile, then SIGTERM: vLLM drains in-flight requests (VerifierSpec.shutdown_timeout_s)
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(v.pre_stop_s)]}}},
        "env": _env(v.pod, extra_env),
        "ports": [
            {"name": "http", "containerPort": VERIFIER_HTTP_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": VERIFIER_METRICS_PORT, "protocol": "TCP"},
        ],
        **_probes({"httpGet": {"path": "/health", "port": VERIFIER_HTTP_PORT}}, v.startup_timeout_s),
    }
    pod = capacity_placement.on_demand(v.pod, None)  # the verifier stays off spot nodes
    pod_spec = _pod_spec(cluster, pod, v.image, container, name, [v.model], v.termination_grace_s, tls, shm=True)
    return _template(name, "verifier", None, pod_spec, VERIFIER_METRICS_PORT, config_hashes.verifier_hash(cluster),
                     v.pod)


def build_verifier_deployment(name: str, namespace: str, cluster: ClusterSpec) -> Manifest:
    """Deployment ``N-verifier``: vLLM's OpenAI server with CoSine's proposer, one ``--drafter`` per pool;
    Prometheus scrapes CoSine's series on the metrics port (vLLM's are on the http port).
    ``replicas``: ``spec.verifier.replicas``, at creation only (then whoever scales it writes them:
    an HPA on it, or ``cosinecluster_scale_verifier`` following ``spec.verifier.replicas``)."""
    v = cluster.verifier
    return _deployment_of(name, namespace, verifier_name(name), "verifier", None, v.replicas, _strategy(v.pod),
                          _verifier_template(name, namespace, cluster))


# LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, LWS v0.7): the env it gives every container of a group
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
WORKER_COMPONENT = "verifier-worker"


def _leader_wait_command(grace_s: int) -> list[str]:
    """A worker's preStop: wait (at most ``grace_s`` - 5 s) until its leader's API port refuses
    connections, i.e. the leader has drained its requests; a group's pods get SIGTERM together,
    and a worker that exits first would fail the leader's in-flight requests."""
    leader = f"(os.environ['{LWS_LEADER_ADDRESS}'],{VERIFIER_HTTP_PORT})"
    script = ("import os,socket,time\n"
              f"end=time.monotonic()+{max(0, grace_s - 5)}\n"
              "while time.monotonic()<end:\n"
              f"    try: socket.create_connection({leader},1).close()\n"
              "    except OSError: break\n"
              "    time.sleep(1)\n")
    return ["python3", "-c", script]


def build_verifier_group(name: str, namespace: str, cluster: ClusterSpec) -> Manifest:
    """LeaderWorkerSet ``N-verifier`` (``spec.verifier.parallelism.nodes`` > 1): ``spec.verifier.replicas``
    groups (at creation only, as the Deployment's) of ``nodes`` pods running vLLM's multi-node mode
    without Ray. The leader is the verifier pod (the API, CoSine's proposer in its engine core, the
    labels the Services, the InferencePool and the drafters' NetworkPolicy select); each worker runs
    the engine alone (``cosine verifier-worker``: ``vllm serve --headless``, its node rank from
    ``LWS_WORKER_INDEX``, the leader from ``LWS_LEADER_ADDRESS``) and carries the component
    ``verifier-worker`` instead. ``RecreateGroupOnPodRestart``: a worker's loss restarts its group
    (vLLM's ranks cannot rejoin a running world). Groups roll one at a time, surging none (a group
    holds whole GPU nodes)."""
    v = cluster.verifier
    leader = _verifier_template(name, namespace, cluster)
    worker_container = {
        "name": "verifier",  # the verifier's resources and image defaults
        "command": ["cosine"],
        "args": ["verifier-worker", "--cluster", CONFIG_FILE],
        "env": _env(v.pod, []),
        "lifecycle": {"preStop": {"exec": {"command": _leader_wait_command(v.termination_grace_s)}}},
    }
    worker_spec = _pod_spec(cluster, capacity_placement.on_demand(v.pod, None), v.image, worker_container, name,
                            [v.model], v.termination_grace_s, None, shm=True)
    worker = _template(name, WORKER_COMPONENT, None, worker_spec, VERIFIER_METRICS_PORT,
                       config_hashes.verifier_hash(cluster), v.pod)
    for key in ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path"):
        worker["metadata"]["annotations"].pop(key)  # a headless engine serves no metrics
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": verifier_name(name), "namespace": namespace, "labels": labels(name, "verifier")},
        "spec": {
            "replicas": v.replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
            "leaderWorkerTemplate": {
                "size": v.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def build_verifier(name: str, namespace: str, cluster: ClusterSpec) -> Manifest:
    """The verifier's workload: a Deployment, or a LeaderWorkerSet when a replica spans nodes."""
    if cluster.verifier.nodes > 1:
        return build_verifier_group(name, namespace, cluster)
    return build_verifier_deployment(name, namespace, cluster)


def build_drafter_deployment(
    name: str, namespace: str, cluster: ClusterSpec, pool: str, replicas: int
) -> Manifest:
    """Deployment ``N-drafter-P`` created with ``replicas`` pods (the scale target's value, not the
    spec's); afterwards its replicas follow the pool's ``CoSineDrafterPool``. ``KeyError`` if the
    cluster has no pool ``pool``."""
    p = cluster.pool(pool)
    tls = cluster.drafter_tls
    container = {
        "name": "drafter",
        "command": ["cosine"],
        "args": [
            "drafter",
            "--cluster",
            CONFIG_FILE,
            "--pool",
            p.name,
            "--grpc-port",
            str(DRAFTER_GRPC_PORT),
            "--metrics-port",
            str(DRAFTER_METRICS_PORT),
            "--host",
            "0.0.0.0",
        ],
        "env": _env(p.pod, []),
        "ports": [
            {"name": "grpc", "containerPort": DRAFTER_GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": DRAFTER_METRICS_PORT, "protocol": "TCP"},
        ],
        # the kubelet's gRPC probe speaks plaintext only: with TLS, the port being open (the
        # server starts once the engine is loaded) is the signal
        **_probes({"tcpSocket": {"port": DRAFTER_GRPC_PORT}} if tls else {"grpc": {"port": DRAFTER_GRPC_PORT}},
                  p.startup_timeout_s),
    }
    if tls is not None:
        container["args"] += ["--tls-dir", TLS_DIR]
    # a model pool needs its model; a translating pool also the verifier's, for its tokenizer
    models = [] if p.model is None else [p.model]
    if models and p.translate_tokenizer:
        models.append(cluster.verifier.model)
    pod, grace_s = on_capacity(p, cluster.spot)
    pod_spec = _pod_spec(cluster, pod, p.image, container, name, models, grace_s, tls, shm=p.resolved_engine == "vllm")
    out = _deployment(
        name,
        namespace,
        drafter_name(name, p.name),
        "drafter",
        p.name,
        replicas,
        pod_spec,
        DRAFTER_METRICS_PORT,
        config_hashes.pool_hash(cluster, p.name),
        _strategy(p.pod),
        p.pod,
    )
    if p.capacity == "spot" and cluster.spot is not None:  # its pods told from the fallback's
        out["spec"]["template"]["metadata"]["labels"][CAPACITY_LABEL] = "spot"
    return out


def build_fallback_deployment(
    name: str, namespace: str, cluster: ClusterSpec, pool: str, replicas: int
) -> Manifest:
    """A spot pool's on-demand sibling, ``N-drafter-P-ondemand``: the pool's pods as on demand
    (no spot selector, toleration or grace cap; kept off spot nodes and, where the provider has
    one, selecting on-demand capacity: :func:`capacity_placement.on_demand`), ``replicas`` of them, labelled
    ``CAPACITY_LABEL: onDemand`` in its selector, so it never counts the spot pods; they share the
    pool's Service and metrics. Sized by :func:`cosine_spec.capacity.on_demand_fallback`; the
    operator owns its replicas (no scaler writes them). ``KeyError`` if the cluster has no pool
    ``pool``."""
    p = cluster.pool(pool)
    pod = capacity_placement.on_demand(p.pod, cluster.spot)
    on_demand = replace(cluster, drafter_pools=tuple(replace(q, capacity="onDemand", pod=pod) if q.name == pool else q
                                                     for q in cluster.drafter_pools))
    out = build_drafter_deployment(name, namespace, on_demand, pool, replicas)
    out["metadata"]["name"] = fallback_name(name, p.name)
    for labels_ in (out["metadata"]["labels"], out["spec"]["selector"]["matchLabels"],
                    out["spec"]["template"]["metadata"]["labels"]):
        labels_[CAPACITY_LABEL] = "onDemand"
    return out


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
    ``prePopulated`` (the pods read the claim as it is). Three retries; its pods are kept for their logs."""
    cache = cluster.model_cache
    if cache is None or cache.pre_populated:
        return None
    models = cluster_models(cluster)
    pull = _pull_container(cluster, models, [{"name": COSINE_CACHE_ENV, "value": MODEL_CACHE_DIR}])
    spec = {
        "backoffLimit": 3,
        "template": {
            "metadata": {"labels": labels(name, "models")},
            "spec": {
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,
                "securityContext": _pod_security(),
                "containers": [pull],
                "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": model_claim_name(name, cache)}},
                            *_model_credentials_volumes(cluster)],
            },
        },
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": model_job_name(name, spec), "namespace": namespace, "labels": labels(name, "models")},
        "spec": spec,
    }


def build_disruption_budgets(name: str, namespace: str, cluster: ClusterSpec) -> list[Manifest]:
    """PodDisruptionBudgets ``N-verifier`` and per pool ``N-drafter-P``: a node drain or upgrade
    evicts one pod of each at a time (a lone verifier still goes: it is evicted, not blocked)."""
    roles = [(verifier_name(name), "verifier", None)] + [
        (drafter_name(name, p.name), "drafter", p.name) for p in cluster.drafter_pools
    ]
    out = [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": pdb, "namespace": namespace, "labels": labels(name, component, pool)},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name, component, pool)}},
        }
        for pdb, component, pool in roles
    ]
    if cluster.verifier.nodes > 1:  # one pod of any group: evicting it restarts its group, whose
        # pods then count as unavailable until it is back, so a drain takes one group at a time
        group = {k: v for k, v in selector_labels(name, "verifier").items() if k != COMPONENT_LABEL}
        out[0]["spec"]["selector"] = {"matchLabels": group, "matchExpressions": [
            {"key": COMPONENT_LABEL, "operator": "In", "values": ["verifier", WORKER_COMPONENT]}]}
    return out


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


def build_pool_scaler(
    name: str, namespace: str, cluster: ClusterSpec, pool: str, replicas: int
) -> Manifest:
    """``CoSineDrafterPool`` ``N-P``: the pool's scale target, created with ``replicas``; its
    ``spec.replicas`` drives the Deployment. ``KeyError`` if the cluster has no pool ``pool``."""
    p = cluster.pool(pool)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": POOL_KIND,
        "metadata": {
            "name": pool_object_name(name, pool),
            "namespace": namespace,
            "labels": labels(name, "drafter", pool),
        },
        "spec": {
            "clusterName": name,
            "pool": pool,
            "replicas": replicas,
            "minReplicas": p.min_replicas,
            "maxReplicas": p.max_replicas,
        },
    }


def pool_selector(cluster: str, pool: str) -> str:
    """The label selector of a pool's pods as a string (``status.selector``, for HPA)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(cluster, "drafter", pool).items())


def verifier_selector(cluster: str) -> str:
    """The label selector of the verifier's pods as a string (``status.verifier.selector``, for HPA)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(cluster, "verifier").items())


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


# ---------------------------------------------------------------- router (spec.router)
# The Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1, GIE v1.0),
# the Gateway API's HTTPRoute (gateway.networking.k8s.io/v1, Gateway API v1.3) and llm-d's endpoint
# picker (what it needs: :mod:`cosine_operator.endpoint_picker`).
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
HTTPROUTE_API_VERSION = "gateway.networking.k8s.io/v1"
ROUTER_COMPONENT = "router"
EPP_GRPC_PORT = endpoint_picker.GRPC_PORT
EPP_HEALTH_PORT = endpoint_picker.HEALTH_PORT
EPP_METRICS_PORT = endpoint_picker.METRICS_PORT
EPP_CONFIG_DIR = endpoint_picker.CONFIG_DIR


def router_name(cluster: str) -> str:
    """The InferencePool and HTTPRoute of a cluster with ``spec.router``: ``N-router``."""
    return f"{cluster}-router"


def endpoint_picker_name(cluster: str) -> str:
    """The endpoint picker's Deployment, Service, ServiceAccount, Role, RoleBinding and ConfigMap: ``N-epp``."""
    return f"{cluster}-epp"


def build_router(name: str, namespace: str, cluster: ClusterSpec) -> list[Manifest]:
    """``spec.router.enabled``: the InferencePool ``N-router`` of the verifier pods (the leaders of a
    multi-node verifier), its endpoint picker (ServiceAccount, Role and RoleBinding as llm-d's
    charts grant them, the configuration ConfigMap, Deployment and Service ``N-epp``), the
    HTTPRoute ``N-router`` from ``spec.router.gatewayName`` to the pool and, with
    ``spec.router.provider: gke``, GKE's policies on the pool; empty when off (the operator then
    deletes the ones it made)."""
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
        "imagePullPolicy": cluster.image.pull_policy,
        "args": endpoint_picker.args(router_name(name), namespace, r.replicas, picker_config),
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"}],
        **endpoint_picker.probes(),
        "resources": json.loads(json.dumps(endpoint_picker.RESOURCES)),
        "securityContext": _restricted_container(),
        "volumeMounts": [{"name": "config", "mountPath": EPP_CONFIG_DIR, "readOnly": True}],
    }
    pod_spec = {
        "serviceAccountName": epp,  # it watches the InferencePool and its pods
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": epp}}],
    }
    deployment = _deployment(name, namespace, epp, ROUTER_COMPONENT, None, r.replicas, pod_spec, EPP_METRICS_PORT,
                             config_hashes.router_hash(cluster), {"type": "RollingUpdate"})
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
    gke = endpoint_picker.gke_policies(router_name(name), meta(router_name(name))) if r.provider == "gke" else []
    return [account, role, binding, config, service, deployment, pool, route, *gke]
