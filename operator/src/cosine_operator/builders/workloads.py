"""The workloads of a cluster on single-node replicas: the ConfigMap the runtime reads, the
verifier's and each pool's Deployment (a spot pool's on-demand fallback too), their
PodDisruptionBudgets and each pool's scale target (``CoSineDrafterPool``)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import yaml
from cosine_spec.cluster_spec import ClusterSpec, DrafterPoolSpec, SpotSpec
from cosine_spec.contract import (
    CAPACITY_LABEL,
    CLUSTER_KIND,
    COMPONENT_LABEL,
    CONFIG_FILE,
    COSINE_API_KEY_ENV,
    DRAFTER_GRPC_PORT,
    DRAFTER_METRICS_PORT,
    GROUP,
    POOL_KIND,
    TLS_DIR,
    VERIFIER_HTTP_PORT,
    VERIFIER_METRICS_PORT,
    VERSION,
)
from cosine_spec.pods import PodOverrides

from cosine_operator import capacity_placement, config_hashes
from cosine_operator.builders.names import (
    WORKER_COMPONENT,
    Manifest,
    config_name,
    drafter_name,
    fallback_name,
    labels,
    pool_object_name,
    selector_labels,
    verifier_name,
)
from cosine_operator.builders.pods import (
    build_deployment,
    build_pod_spec,
    container_env,
    deployment_of,
    health_probes,
    pod_template,
    rollout_strategy,
)


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


def verifier_template(name: str, namespace: str, cluster: ClusterSpec) -> dict[str, Any]:
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
        "env": container_env(v.pod, extra_env),
        "ports": [
            {"name": "http", "containerPort": VERIFIER_HTTP_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": VERIFIER_METRICS_PORT, "protocol": "TCP"},
        ],
        **health_probes({"httpGet": {"path": "/health", "port": VERIFIER_HTTP_PORT}}, v.startup_timeout_s),
    }
    pod = capacity_placement.on_demand(v.pod, cluster)  # the verifier stays off spot nodes
    pod_spec = build_pod_spec(cluster, pod, v.image, container, name, [v.model], v.termination_grace_s, tls, shm=True)
    return pod_template(name, "verifier", None, pod_spec, VERIFIER_METRICS_PORT, config_hashes.verifier_hash(cluster),
                     v.pod)


def build_verifier_deployment(name: str, namespace: str, cluster: ClusterSpec) -> Manifest:
    """Deployment ``N-verifier``: vLLM's OpenAI server with CoSine's proposer, one ``--drafter`` per pool;
    Prometheus scrapes CoSine's series on the metrics port (vLLM's are on the http port).
    ``replicas``: ``spec.verifier.replicas``, at creation only (then whoever scales it writes them:
    an HPA on it, or ``cosinecluster_scale_verifier`` following ``spec.verifier.replicas``)."""
    v = cluster.verifier
    return deployment_of(name, namespace, verifier_name(name), "verifier", None, v.replicas,
                          rollout_strategy(v.pod, v.rollout.max_surge), verifier_template(name, namespace, cluster))


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
        "env": container_env(p.pod, []),
        "ports": [
            {"name": "grpc", "containerPort": DRAFTER_GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": DRAFTER_METRICS_PORT, "protocol": "TCP"},
        ],
        # the kubelet's gRPC probe speaks plaintext only: with TLS, the port being open (the
        # server starts once the engine is loaded) is the signal
        **health_probes({"tcpSocket": {"port": DRAFTER_GRPC_PORT}} if tls else {"grpc": {"port": DRAFTER_GRPC_PORT}},
                  p.startup_timeout_s),
    }
    if tls is not None:
        container["args"] += ["--tls-dir", TLS_DIR]
    # a model pool needs its model; a translating pool also the verifier's, for its tokenizer
    models = [] if p.model is None else [p.model]
    if models and p.translate_tokenizer:
        models.append(cluster.verifier.model)
    pod, grace_s = on_capacity(p, cluster.spot)
    pod_spec = build_pod_spec(cluster, pod, p.image, container, name, models, grace_s, tls,
                              shm=p.resolved_engine == "vllm")
    out = build_deployment(
        name,
        namespace,
        drafter_name(name, p.name),
        "drafter",
        p.name,
        replicas,
        pod_spec,
        DRAFTER_METRICS_PORT,
        config_hashes.pool_hash(cluster, p.name),
        rollout_strategy(p.pod),
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
    pod = capacity_placement.on_demand(p.pod, cluster, fallback=True)
    on_demand = replace(cluster, drafter_pools=tuple(replace(q, capacity="onDemand", pod=pod) if q.name == pool else q
                                                     for q in cluster.drafter_pools))
    out = build_drafter_deployment(name, namespace, on_demand, pool, replicas)
    out["metadata"]["name"] = fallback_name(name, p.name)
    for labels_ in (out["metadata"]["labels"], out["spec"]["selector"]["matchLabels"],
                    out["spec"]["template"]["metadata"]["labels"]):
        labels_[CAPACITY_LABEL] = "onDemand"
    return out


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
