"""The endpoint picker's configuration, flags and RBAC against llm-d-router v0.10.0, the tag the
operator pins: a schema and a plugin registry written from its source
(data/llm-d-router/, each naming the files read), since its own loader is Go that no registry
here serves. Catches: the deprecated config group, a plugin type the tag does not register, an
alpha plugin without ``--allow-experimental-plugins`` (the picker refuses to start), an unknown
key (its strict decoder refuses it, as the old ``data:`` key), an unregistered feature gate, a
reference to an undefined plugin, several replicas without leader election."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from cosine_spec.cluster_spec import ENDPOINT_PICKER_IMAGE, parse_cluster_spec

from cosine_operator import endpoint_picker
from cosine_operator.builders.router import build_router

DATA = Path(__file__).resolve().parent / "data" / "llm-d-router"
SCHEMA = json.loads((DATA / "endpoint-picker-config-v0.10.0.schema.json").read_text())
REGISTRY = json.loads((DATA / "plugins-v0.10.0.json").read_text())
CHART = json.loads((DATA / "chart-values-v0.10.0.json").read_text())  # llm-d's chart, same settings
WEIGHTS = ("prefixCache", "sessionAffinity", "suffixAffinity", "queue", "kvCacheUtilization")
SPEC: dict[str, Any] = {
    "verifier": {"model": "qwen2.5-coder-1.5b-instruct"},
    "drafterPools": [{"name": "ngram", "kind": "ngram"}],
    "router": {"enabled": True, "gatewayName": "gw"},
}


def _router(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    objs = build_router("demo", "ns", parse_cluster_spec(spec))
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def _with(**router: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["router"].update(router)
    return spec


def _check_like_the_picker(config: dict[str, Any], args: list[str]) -> None:
    """What v0.10.0 checks before it serves: the strict decode (the schema), validatePlugins
    (registered types, unique names), validateSchedulingProfiles and the data layer's references
    (defined plugins), ValidatePluginStability (alpha needs the flag)."""
    jsonschema.validate(config, SCHEMA)
    names = [p.get("name") or p["type"] for p in config["plugins"]]
    assert len(names) == len(set(names)), names
    for plugin in config["plugins"]:
        assert plugin["type"] in REGISTRY["plugins"], f"{plugin['type']} is not registered at v0.10.0"
        if REGISTRY["plugins"][plugin["type"]] == "Alpha":
            assert "--allow-experimental-plugins" in args, f"{plugin['type']} is alpha"
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    for source in (config.get("dataLayer") or {}).get("sources", []):
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    assert set(refs) <= set(names), set(refs) - set(names)


def _config_and_args(spec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    objs = _router(spec)
    config = yaml.safe_load(objs[("ConfigMap", "demo-epp")]["data"]["config.yaml"])
    args = objs[("Deployment", "demo-epp")]["spec"]["template"]["spec"]["containers"][0]["args"]
    return config, args


@pytest.mark.parametrize("weights", [{}, *({w: 2.0} for w in WEIGHTS),
                                     {"sessionAffinity": 0}, {w: 1.5 for w in WEIGHTS}],
                         ids=["defaults", *(f"{w}-on" for w in WEIGHTS), "session-off", "all-on"])
def test_the_picker_would_load_its_config(weights: dict[str, float]) -> None:
    config, args = _config_and_args(_with(weights=weights))
    _check_like_the_picker(config, args)
    assert config["apiVersion"] == "llm-d.ai/v1alpha1"


def test_the_schema_refuses_what_the_picker_refuses() -> None:
    """The schema is no rubber stamp: the old operator's suffix-affinity config fails it."""
    config, _ = _config_and_args(_with(weights={"suffixAffinity": 1}))
    old = {**config, "apiVersion": "inference.networking.x-k8s.io/v1alpha1"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(old, SCHEMA)
    with pytest.raises(jsonschema.ValidationError):  # the key v0.10.0's strict decoder refuses
        jsonschema.validate({**config, "data": config["dataLayer"]}, SCHEMA)
    with pytest.raises(jsonschema.ValidationError):  # a gate v0.10.0 does not register
        jsonschema.validate({**config, "featureGates": ["dataLayer"]}, SCHEMA)
    for gone in ("prometheus-metric", "metric-scorer"):  # types no llm-d or GIE tag checked has
        assert gone not in REGISTRY["plugins"]


def test_only_an_alpha_plugin_turns_on_experimental_plugins() -> None:
    assert REGISTRY["plugins"]["session-affinity-scorer"] == "Alpha"
    _, args = _config_and_args(_with(weights={"sessionAffinity": 1}))
    assert "--allow-experimental-plugins" in args
    _, args = _config_and_args(SPEC)
    assert "--allow-experimental-plugins" not in args
    for plugin, stability in endpoint_picker.STABILITY.items():  # the module's table is the tag's
        assert REGISTRY["plugins"][plugin] == stability


def test_suffix_affinity_scores_the_verifiers_gauge() -> None:
    config, _ = _config_and_args(_with(weights={"suffixAffinity": 2}))
    plugins = {p.get("name") or p["type"]: p for p in config["plugins"]}
    scorer = plugins["suffix-affinity-scorer"]["parameters"]
    assert scorer["algorithm"]["type"] == "linear_higher_is_better"
    (engine,) = plugins["core-metrics-extractor"]["parameters"]["engineConfigs"]
    from cosine_spec import metric_names
    assert engine["customMetrics"] == [{"attributeKey": scorer["attributeKey"],
                                        "metricSpec": metric_names.SUFFIX_TREE_HIT_RATE}]
    # the built-in vLLM mapping kept, so the queue and KV-cache scorers still read their series
    assert engine["queuedRequestsSpec"] == "vllm:num_requests_waiting"
    assert plugins["core-metrics-extractor"]["parameters"]["defaultEngine"] == engine["name"]
    weights = {p["pluginRef"]: p.get("weight") for p in config["schedulingProfiles"][0]["plugins"]}
    assert weights["suffix-affinity-scorer"] == 2.0


def test_leader_election_above_one_replica() -> None:
    one = _router(SPEC)
    two = _router(_with(endpointPickerReplicas=2))
    container = one[("Deployment", "demo-epp")]["spec"]["template"]["spec"]["containers"][0]
    assert "--ha-enable-leader-election" not in container["args"]
    # a standby must stay live (not restarted) while only the leader is ready (health.go)
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    args = two[("Deployment", "demo-epp")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--ha-enable-leader-election" in args
    rules = {(g, r): set(rule["verbs"]) for rule in two[("Role", "demo-epp")]["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"create", "update", "get"} <= rules[("coordination.k8s.io", "leases")]
    assert ("coordination.k8s.io", "leases") not in {
        (g, r) for rule in one[("Role", "demo-epp")]["rules"] for g in rule["apiGroups"] for r in rule["resources"]}


def test_its_flags_exist_at_the_tag() -> None:
    """Every flag the operator passes is one v0.10.0 defines (pkg/epp/server/options.go, AddFlags)."""
    defined = {"--pool-name", "--pool-namespace", "--pool-group", "--grpc-port", "--grpc-health-port",
               "--metrics-port", "--metrics-endpoint-auth", "--config-file", "--ha-enable-leader-election",
               "--allow-experimental-plugins", "--tracing", "--enable-pprof"}
    _, args = _config_and_args(_with(endpointPickerReplicas=3, weights={"suffixAffinity": 1, "sessionAffinity": 1}))
    assert {a.split("=")[0] for a in args if a.startswith("--")} <= defined
    assert ENDPOINT_PICKER_IMAGE.endswith(":" + REGISTRY["tag"])  # the schema's tag is the one pinned


def test_the_pickers_service_speaks_as_llm_ds() -> None:
    """llm-d's routerlib/_service.yaml: ext_proc's port declared ``kubernetes.io/h2c``
    (Kubernetes' standard appProtocol values, KEP-3726), not a bare ``http2``."""
    service = _router(SPEC)[("Service", "demo-epp")]["spec"]
    (grpc,) = [p for p in service["ports"] if p["port"] == 9002]
    assert grpc["appProtocol"] == "kubernetes.io/h2c"


def test_on_gke_the_pool_gets_llm_ds_policies_and_the_route_no_timeout() -> None:
    """llm-d-router-gateway's gke.yaml and httproute.yaml: a 300 s GCPBackendPolicy and a fast
    HealthCheckPolicy on the InferencePool, the HTTPRoute's timeout left to the former. Catches
    GKE's 30 s default backend timeout cutting long completions."""
    objs = _router(_with(provider="gke"))
    target = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "demo-router"}
    backend = objs[("GCPBackendPolicy", "demo-router")]["spec"]
    assert backend["targetRef"] == target and backend["default"]["timeoutSec"] == 300
    check = objs[("HealthCheckPolicy", "demo-router")]["spec"]
    assert check["targetRef"] == target
    assert check["default"]["config"] == {"type": "HTTP", "httpHealthCheck": {"requestPath": "/health", "port": 8000}}
    assert "timeouts" not in objs[("HTTPRoute", "demo-router")]["spec"]["rules"][0]
    plain = _router(SPEC)
    assert not {kind for kind, _ in plain} & {"GCPBackendPolicy", "HealthCheckPolicy"}
    assert plain[("HTTPRoute", "demo-router")]["spec"]["rules"][0]["timeouts"] == {"request": "0s"}


def _picker_pod(spec: dict[str, Any]) -> dict[str, Any]:
    return _router(spec)[("Deployment", "demo-epp")]["spec"]["template"]["spec"]


def _cpu_cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


# An 8-vCPU node's allocatable CPU after the kubelet's reserve (GKE's table: 6% of the first core,
# 1% of the next, 0.5% of the next two, 0.25% above: 7.91 cores), less what DaemonSets take there
# (logging, metrics, CNI, CSI: about a core on GKE and EKS).
EIGHT_VCPU_ROOM_CORES = 7.91 - 1.0


def test_the_picker_fits_an_8_vcpu_node_and_can_be_placed() -> None:
    """llm-d's 8 CPU request is more than an 8-vCPU node has allocatable: the picker stayed
    Pending on common nodes. The default fits one, keeping llm-d's other choices (CPU unlimited for
    bursts, memory capped at 16 GiB); ``endpointPickerResources``, ``endpointPickerNodeSelector``
    and ``endpointPickerTolerations`` place it as ``router.epp.resources``/``tolerations`` do in
    llm-d's chart."""
    llm_d = CHART["deployment"]["resources"]
    assert _cpu_cores(llm_d["requests"]["cpu"]) > EIGHT_VCPU_ROOM_CORES  # why the default differs
    default = _picker_pod(SPEC)
    resources = default["containers"][0]["resources"]
    assert _cpu_cores(resources["requests"]["cpu"]) <= EIGHT_VCPU_ROOM_CORES / 2
    assert "cpu" not in resources["limits"] and resources["limits"] == llm_d["limits"]
    assert "nodeSelector" not in default and "tolerations" not in default
    own = {"requests": {"cpu": "500m", "memory": "1Gi"}}
    toleration = {"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}
    placed = _picker_pod(_with(endpointPickerResources=own, endpointPickerNodeSelector={"pool": "infra"},
                               endpointPickerTolerations=[toleration]))
    assert placed["containers"][0]["resources"] == own
    assert placed["nodeSelector"] == {"pool": "infra"} and placed["tolerations"] == [toleration]


def test_the_picker_rolls_by_recreate_as_llm_ds() -> None:
    """Only the leader is ready (health.go), so a RollingUpdate (maxUnavailable 0 for 2-3 replicas)
    waits for new pods that never become ready while the old leader lives: a weight change never
    applied. llm-d's chart recreates instead."""
    for replicas in (1, 3):
        deployment = _router(_with(endpointPickerReplicas=replicas))[("Deployment", "demo-epp")]
        assert deployment["spec"]["strategy"] == CHART["deployment"]["strategy"]


def test_the_picker_outlives_its_drain() -> None:
    """On SIGTERM the picker serves ext_proc for its 30 s drain, then waits for the streams in flight
    (runWithGracefulShutdown); Kubernetes' default 30 s grace killed it as the drain ended, cutting
    them. Its grace is llm-d's 130 s at least, and covers the drain plus a verifier's own grace."""
    assert endpoint_picker.DRAIN_TIMEOUT_S == CHART["picker_defaults"]["drain-timeout-s"]
    pod = _picker_pod(SPEC)
    assert pod["terminationGracePeriodSeconds"] >= CHART["deployment"]["terminationGracePeriodSeconds"]
    assert pod["terminationGracePeriodSeconds"] >= 30 + 120  # the verifier's default grace
    spec = copy.deepcopy(SPEC)
    spec["verifier"]["terminationGracePeriodSeconds"] = 600
    assert _picker_pod(spec)["terminationGracePeriodSeconds"] == 630


def test_a_picker_down_fails_open_as_llm_ds() -> None:
    """GIE's API defaults to FailClose (inferencepool_types.go: "drop the request"), so with one
    picker every restart, Recreate roll or node drain failed every request. Every CoSine verifier
    serves the same model, so a gateway's own pick loses only cache affinity: FailOpen, as llm-d's
    chart defaults; FailClose stays a choice."""
    pool = _router(SPEC)[("InferencePool", "demo-router")]["spec"]
    assert pool["endpointPickerRef"]["failureMode"] == CHART["inferencePool"]["endpointPickerRef"]["failureMode"]
    closed = _router(_with(failureMode="FailClose"))[("InferencePool", "demo-router")]["spec"]
    assert closed["endpointPickerRef"]["failureMode"] == "FailClose"


def test_on_istio_the_picker_is_reached_over_tls() -> None:
    """The picker serves TLS on 9002 with a self-signed certificate (SecureServing defaults to
    true); Istio's gateway neither originates TLS to it nor trusts that certificate by itself, so
    with no DestinationRule every call failed. ``provider: istio`` writes the rule GIE v1.0.0
    ships and llm-d's istio.yaml writes, on the picker's Service (its short name, resolved in the
    rule's namespace)."""
    assert CHART["picker_defaults"]["secure-serving"] is True
    objs = _router(_with(provider="istio"))
    rule = objs[("DestinationRule", "demo-epp")]
    assert rule["apiVersion"] == "networking.istio.io/v1" and rule["metadata"]["namespace"] == "ns"
    assert rule["spec"]["host"] == objs[("Service", "demo-epp")]["metadata"]["name"]
    assert rule["spec"]["trafficPolicy"] == CHART["istioDestinationRule"]["spec"]["trafficPolicy"]
    for provider in ("none", "gke"):
        assert "DestinationRule" not in {kind for kind, _ in _router(_with(provider=provider))}


def test_debug_surfaces_are_off() -> None:
    """Tracing defaults to on in the picker (options.go) and, with no OTLP endpoint, prints spans
    to its log: llm-d's chart passes ``--tracing=false``. pprof defaults to on, on the metrics
    port that runs without token review here: ``--enable-pprof=false``."""
    assert CHART["picker_defaults"]["tracing"] and CHART["picker_defaults"]["enable-pprof"]
    _, args = _config_and_args(SPEC)
    assert set(CHART["deployment"]["args"]) <= set(args)
    assert "--enable-pprof=false" in args
    assert not {"--tracing=true", "--enable-pprof=true", "--tracing", "--enable-pprof"} & set(args)


def test_session_affinity_is_opt_in() -> None:
    """Its scorer is alpha (turning on experimental plugins), and it works only for clients that
    echo the x-session-token header it sets, base64 of namespace/pod (it names the pods); OpenAI's
    SDKs never do. Off by default; a weight turns it on."""
    config, args = _config_and_args(SPEC)
    assert "session-affinity-scorer" not in {p["type"] for p in config["plugins"]}
    assert "--allow-experimental-plugins" not in args
    config, args = _config_and_args(_with(weights={"sessionAffinity": 1}))
    assert "session-affinity-scorer" in {p["type"] for p in config["plugins"]}
    _check_like_the_picker(config, args)
