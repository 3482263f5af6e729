"""What ``spec.router`` asks of llm-d's endpoint picker (EPP), read from its source at the tag the
operator pins (:data:`cosine_spec.cluster_spec.ENDPOINT_PICKER_IMAGE`, llm-d/llm-d-router v0.10.0):

- the configuration (``apix/config/v1alpha1/endpointpickerconfig_types.go``; group
  ``llm-d.ai``, ``zz_generated.register.go``; the strict decoder of
  ``pkg/epp/config/loader/configloader.go``), with plugin types from ``registerInTreePlugins`` in
  ``cmd/epp/runner/runner.go`` and each plugin's parameters from its factory;
- its flags (``pkg/epp/server/options.go``): alpha plugins load only with
  ``--allow-experimental-plugins`` (``ValidatePluginStability``), several replicas need
  ``--ha-enable-leader-election``; tracing (falling back to a console exporter: spans in its log)
  and pprof default to on; ext_proc is TLS with a self-signed certificate (``SecureServing``);
- its shutdown (``runWithGracefulShutdown`` in ``cmd/epp/runner/runner.go``): on SIGTERM it turns
  NotServing and hands its lease over, keeps serving ext_proc for ``DefaultDrainTimeout`` (30 s),
  then stops gracefully, waiting for the streams in flight;
- its gRPC health services (``cmd/epp/runner/health.go``): ``liveness`` passes on every live
  replica, ``readiness`` only on the leader;
- what llm-d's charts give it (``config/charts/routerlib``, ``config/charts/llm-d-router-gateway``):
  the Role, the leader-election Role, the ``Recreate`` strategy, a 130 s grace, ``--tracing=false``,
  ``failureMode: FailOpen``, on GKE a ``GCPBackendPolicy`` (``timeoutSec: 300``) and a
  ``HealthCheckPolicy`` on the pool, on Istio a ``DestinationRule`` (``istio.yaml``).

Pure: a spec goes in, dicts come out; :func:`cosine_operator.builders.router.build_router` assembles them.
"""

from __future__ import annotations

from typing import Any

from cosine_spec import metric_names
from cosine_spec.cluster_spec import ClusterSpec
from cosine_spec.contract import VERIFIER_HTTP_PORT

CONFIG_API_VERSION = "llm-d.ai/v1alpha1"  # the deprecated inference.networking.x-k8s.io/v1alpha1 still loads
GRPC_PORT = 9002  # ext_proc, which the gateway calls per request (GIE's default)
HEALTH_PORT = 9003  # gRPC health; GKE's load balancer checks the picker here
METRICS_PORT = 9090
CONFIG_DIR = "/etc/epp"
# The plugin types the operator writes, with their stability at the pinned tag (runner.go).
STABILITY = {
    "queue-scorer": "Beta",
    "kv-cache-utilization-scorer": "Beta",
    "prefix-cache-scorer": "Beta",
    "session-affinity-scorer": "Alpha",
    "metrics-data-source": "Beta",
    "core-metrics-extractor": "Beta",
    "endpoint-attribute-scorer": "Alpha",
    "max-score-picker": "Beta",
    "single-profile-handler": "Beta",
}
# the gauge suffix affinity scores on (cosine.metrics: served on the verifier's http port, where
# the picker's metrics data source scrapes vLLM's series)
SUFFIX_HIT_RATE_METRIC = metric_names.SUFFIX_TREE_HIT_RATE
SUFFIX_ATTRIBUTE = "cosine.suffix_tree_hit_rate"
# The core metrics extractor's built-in vLLM mapping (extractor/metrics/factories.go,
# defaultEngineConfigs), restated because an engine config replaces the built-in one of its name;
# ours has its own name and is the default engine, so the verifier pods need no engine label.
_ENGINE = "cosine-vllm"
_VLLM_SPECS = {
    "queuedRequestsSpec": "vllm:num_requests_waiting",
    "runningRequestsSpec": "vllm:num_requests_running",
    "kvUsageSpec": "vllm:kv_cache_usage_perc",
    "loraSpec": "vllm:lora_requests_info",
    "cacheInfoSpec": "vllm:cache_config_info",
}
# What a picker container asks when spec.router.endpointPickerResources is empty. llm-d's chart
# (routerlib/values.yaml) requests 8 CPU and 8 GiB, more than an 8-vCPU node has allocatable (its
# kubelet and system reserve come off the 8), so the picker stayed Pending there. 2 CPU and 4 GiB
# fit beside the node's DaemonSets; as in llm-d's chart, "CPU limits unset for burst capacity,
# memory capped at 16Gi".
RESOURCES = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "16Gi"}}
# The picker's drain window after SIGTERM (options.go, DefaultDrainTimeout), and llm-d's grace
# (routerlib/_deployment.yaml: "should mirror the longest grace period of the pods within the pool")
DRAIN_TIMEOUT_S = 30
LLM_D_GRACE_S = 130
# GKE's load-balancer health checkers (GKE's "Configure Gateway resources using Policies" and
# Cloud Load Balancing's "Health checks overview": probes come from these ranges)
GKE_HEALTH_CHECK_RANGES = ("35.191.0.0/16", "130.211.0.0/22")
GKE_POLICY_API_VERSION = "networking.gke.io/v1"
GKE_BACKEND_TIMEOUT_S = 300  # llm-d-router-gateway's gke.yaml
ISTIO_API_VERSION = "networking.istio.io/v1"  # GIE v1.0.0's destination-rule.yaml; Istio 1.22 and later


def config(cluster: ClusterSpec) -> dict[str, Any]:
    """The ``EndpointPickerConfig``: one scheduling profile summing the weighted scorers of
    ``spec.router.weights`` (a weight of 0 leaves its scorer out), the highest score picked.
    Suffix affinity is the picker's custom-metric path: the core metrics extractor maps
    ``cosine_suffix_tree_hit_rate`` onto an endpoint attribute, which ``endpoint-attribute-scorer``
    (alpha) scores, higher better, on the fixed range [0, 1]."""
    w = cluster.router.weights
    plugins: list[dict[str, Any]] = []
    profile: list[dict[str, Any]] = []
    for plugin, weight in (("queue-scorer", w.queue), ("kv-cache-utilization-scorer", w.kv_cache_utilization),
                           ("prefix-cache-scorer", w.prefix_cache), ("session-affinity-scorer", w.session_affinity)):
        if weight > 0:
            plugins.append({"type": plugin})
            profile.append({"pluginRef": plugin, "weight": weight})
    out: dict[str, Any] = {"apiVersion": CONFIG_API_VERSION, "kind": "EndpointPickerConfig"}
    if w.suffix_affinity > 0:
        plugins += [
            {"type": "metrics-data-source"},
            {"type": "core-metrics-extractor",
             "parameters": {"defaultEngine": _ENGINE, "engineConfigs": [{
                 "name": _ENGINE, **_VLLM_SPECS,
                 "customMetrics": [{"attributeKey": SUFFIX_ATTRIBUTE, "metricSpec": SUFFIX_HIT_RATE_METRIC}]}]}},
            {"name": "suffix-affinity-scorer", "type": "endpoint-attribute-scorer",
             "parameters": {"attributeKey": SUFFIX_ATTRIBUTE,
                            "algorithm": {"type": "linear_higher_is_better",
                                          "normalization": {"fixedRange": {"min": 0, "max": 1}}}}},
        ]
        profile.append({"pluginRef": "suffix-affinity-scorer", "weight": w.suffix_affinity})
        out["dataLayer"] = {"sources": [{"pluginRef": "metrics-data-source",
                                         "extractors": [{"pluginRef": "core-metrics-extractor"}]}]}
    plugins += [{"type": "max-score-picker"}, {"type": "single-profile-handler"}]
    profile.append({"pluginRef": "max-score-picker"})
    out["plugins"] = plugins
    out["schedulingProfiles"] = [{"name": "default", "plugins": profile}]
    return out


def needs_experimental(picker_config: dict[str, Any]) -> bool:
    """Whether ``picker_config`` holds an alpha plugin, which the picker refuses at start without
    ``--allow-experimental-plugins``."""
    return any(STABILITY[p["type"]] == "Alpha" for p in picker_config["plugins"])


def args(pool: str, namespace: str, replicas: int, picker_config: dict[str, Any]) -> list[str]:
    """The picker's command line: the pool it serves, its ports, its config file; leader election
    above one replica (only the leader is ready, so the gateway calls one); the alpha flag only
    when the config needs it. Tracing off, as llm-d's chart passes it (on, with no OTLP endpoint,
    it prints spans to the log), and pprof off. ``/metrics`` without its token review (the
    picker's default): the NetworkPolicy admits only ``spec.networkPolicy.metricsFrom`` and the
    operator, as on every CoSine metrics port, and a TokenReview grant would need a cluster-scoped
    binding that a namespaced child cannot own. The same port serves the plugin-state handler
    (``/debug/plugins/state``), which v0.10.0 registers with no flag to turn it off
    (``cmd/epp/runner/runner.go``), behind the same filter as ``/metrics``: that NetworkPolicy
    is its only fence."""
    out = ["--pool-name", pool, "--pool-namespace", namespace, "--pool-group", "inference.networking.k8s.io",
           "--grpc-port", str(GRPC_PORT), "--grpc-health-port", str(HEALTH_PORT),
           "--metrics-port", str(METRICS_PORT), "--metrics-endpoint-auth=false",
           "--tracing=false", "--enable-pprof=false",
           "--config-file", f"{CONFIG_DIR}/config.yaml"]
    if replicas > 1:
        out.append("--ha-enable-leader-election")
    if needs_experimental(picker_config):
        out.append("--allow-experimental-plugins")
    return out


def grace_s(verifier_grace_s: int) -> int:
    """The picker pod's ``terminationGracePeriodSeconds``: its drain window, then as long for the
    streams still in flight as a verifier gives its own requests (``verifier_grace_s``), and never
    less than llm-d's 130 s. Kubernetes' default, 30 s, killed it as its drain ended, cutting
    every stream the gateway still held open through it."""
    return max(LLM_D_GRACE_S, DRAIN_TIMEOUT_S + verifier_grace_s)


def probes() -> dict[str, Any]:
    """Liveness on ``liveness`` (every live replica, so a standby is not restarted), readiness on
    ``readiness`` (the leader, once its pool has synced), as llm-d's chart does with several
    replicas; with one, both pass once it is live."""
    return {
        "livenessProbe": {"grpc": {"port": HEALTH_PORT, "service": "liveness"},
                          "initialDelaySeconds": 5, "periodSeconds": 10},
        "readinessProbe": {"grpc": {"port": HEALTH_PORT, "service": "readiness"}, "periodSeconds": 2},
    }


def role_rules(replicas: int) -> list[dict[str, Any]]:
    """The picker's Role, as llm-d-router-gateway's ``rbac.yaml`` and routerlib's ``_rbac.yaml``
    and ``_leader-election-rbac.yaml`` grant it: its pool and pods; InferenceObjectives and
    InferenceModelRewrites in both groups (it finds their CRDs through discovery and watches
    them); leases and events when it elects a leader."""
    return [{"apiGroups": [group], "resources": list(resources), "verbs": sorted(verbs)}
            for group, resources, verbs in reads(replicas)]


def reads(replicas: int) -> list[tuple[str, tuple[str, ...], frozenset[str]]]:
    """(group, resources, verbs) of :func:`role_rules`: what the operator must hold to grant."""
    get = frozenset({"get", "list", "watch"})
    out = [
        ("", ("pods",), get),
        ("inference.networking.k8s.io", ("inferencepools",), get),
        ("inference.networking.x-k8s.io", ("inferenceobjectives", "inferencemodelrewrites"), get),
        ("llm-d.ai", ("inferenceobjectives", "inferencemodelrewrites"), get),
    ]
    if replicas > 1:
        out += [("coordination.k8s.io", ("leases",),
                 frozenset({"get", "list", "watch", "create", "update", "patch", "delete"})),
                ("", ("events",), frozenset({"create", "patch"}))]
    return out


def gke_policies(pool: str, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """GKE's policies on the InferencePool, as llm-d-router-gateway's ``gke.yaml``: the backend
    service's timeout (the load balancer's default, 30 s, cuts long completions) and a health
    check on vLLM's ``/health`` (2 s, for a fast switch-over). GKE checks the picker itself on
    gRPC 9003 by default, so it needs no policy of its own (that file: "only needed for other
    ports")."""
    target = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool}
    return [
        {"apiVersion": GKE_POLICY_API_VERSION, "kind": "GCPBackendPolicy", "metadata": meta,
         "spec": {"targetRef": target,
                  "default": {"timeoutSec": GKE_BACKEND_TIMEOUT_S, "logging": {"enabled": True}}}},
        {"apiVersion": GKE_POLICY_API_VERSION, "kind": "HealthCheckPolicy", "metadata": meta,
         "spec": {"targetRef": target,
                  "default": {"timeoutSec": 2, "checkIntervalSec": 2,
                              "config": {"type": "HTTP",
                                         "httpHealthCheck": {"requestPath": "/health",
                                                             "port": VERIFIER_HTTP_PORT}}}}},
    ]



def istio_destination_rule(service: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The DestinationRule through which Istio's gateway reaches the picker: TLS, its self-signed
    certificate unverified, as GIE v1.0.0 ships it (``config/manifests/gateway/istio/
    destination-rule.yaml``) and llm-d-router-gateway's ``istio.yaml`` writes it. Istio 1.28's
    gateway calls the picker in plaintext otherwise (``pilot/pkg/config/kube/gateway``), which the
    picker's TLS listener refuses. ``host`` is the Service's short name, which Istio resolves in
    the rule's namespace (the Service's), whatever the cluster's DNS domain."""
    return {"apiVersion": ISTIO_API_VERSION, "kind": "DestinationRule", "metadata": meta,
            "spec": {"host": service, "trafficPolicy": {"tls": {"mode": "SIMPLE", "insecureSkipVerify": True}}}}
