"""Pure builders: the runtime contract (names, ports, commands), GPU scheduling, roll-out hashing."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from cosine.operator import builders
from cosine.operator.settings import parse_cluster_spec

SPEC: dict[str, Any] = {
    "verifier": {
        "model": "qwen2.5-coder-1.5b-instruct",
        "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "16Gi"}},
        "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
        "env": [{"name": "HF_HOME", "value": "/models/hf"}],
    },
    "drafterPools": [
        {"name": "code", "model": "qwen2.5-coder-0.5b-instruct", "replicas": 2},
        {"name": "ngram", "kind": "ngram"},
    ],
    "gateway": {
        "serviceType": "LoadBalancer",
        "port": 80,
        "apiKeySecretRef": {"name": "cosine-key", "key": "token"},
    },
}
CLUSTER = parse_cluster_spec(SPEC)


def test_config_map_holds_the_cluster_document() -> None:
    cm = builders.build_config_map("demo", "ns", CLUSTER)
    assert cm["metadata"]["name"] == "demo-config"
    doc = yaml.safe_load(cm["data"]["cluster.yaml"])
    assert doc == {
        "apiVersion": "cosine.dev/v1alpha1",
        "kind": "CoSineCluster",
        "metadata": {"name": "demo"},
        "spec": SPEC,
    }


def test_verifier_deployment_command_ports_probes_and_gpu() -> None:
    d = builders.build_verifier_deployment("demo", "ns", CLUSTER)
    pod = d["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["cosine"]
    assert c["args"] == [
        "verifier",
        "--cluster",
        "/etc/cosine/cluster.yaml",
        "--http-port",
        "8000",
        "--metrics-port",
        "9091",
        "--host",
        "0.0.0.0",
        "--drafter",
        "code=dns:///demo-drafter-code.ns.svc:50052",
        "--drafter",
        "ngram=dns:///demo-drafter-ngram.ns.svc:50052",
    ]
    assert {p["containerPort"] for p in c["ports"]} == {8000, 9091}
    assert d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9091"  # cosine: series
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    env = {e["name"]: e for e in c["env"]}
    assert env["COSINE_CACHE"]["value"] == "/models"
    assert env["COSINE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "cosine-key", "key": "token"}
    assert env["HF_HOME"]["value"] == "/models/hf"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == {"/etc/cosine", "/models"}
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_drafter_deployment_and_headless_service() -> None:
    d = builders.build_drafter_deployment("demo", "ns", CLUSTER, "code", replicas=3)
    c = d["spec"]["template"]["spec"]["containers"][0]
    assert d["metadata"]["name"] == "demo-drafter-code" and d["spec"]["replicas"] == 3
    assert c["args"] == [
        "drafter",
        "--cluster",
        "/etc/cosine/cluster.yaml",
        "--pool",
        "code",
        "--grpc-port",
        "50052",
        "--metrics-port",
        "9090",
        "--host",
        "0.0.0.0",
    ]
    assert c["readinessProbe"]["grpc"] == {"port": 50052}
    assert "tolerations" not in d["spec"]["template"]["spec"]  # no GPU asked for
    svc = builders.build_drafter_service("demo", "ns", "code")
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["port"] for p in svc["spec"]["ports"]} == {50052, 9090}
    assert (
        d["spec"]["selector"]["matchLabels"].items()
        <= svc["spec"]["selector"].items() | d["spec"]["template"]["metadata"]["labels"].items()
    )


def test_gateway_service_maps_port_to_8000() -> None:
    svc = builders.build_gateway_service("demo", "ns", CLUSTER)
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == builders.selector_labels("demo", "verifier")


def test_scaling_does_not_change_the_pod_template_but_a_model_change_does() -> None:
    base = builders.config_hash(CLUSTER)
    scaled = copy.deepcopy(SPEC)
    scaled["drafterPools"][0]["replicas"] = 4
    scaled["autoscaling"] = {"enabled": False}
    assert builders.config_hash(parse_cluster_spec(scaled)) == base
    changed = copy.deepcopy(SPEC)
    changed["verifier"]["model"] = "qwen2.5-coder-3b-instruct"
    assert builders.config_hash(parse_cluster_spec(changed)) != base
    resources = copy.deepcopy(SPEC)
    resources["drafterPools"][0]["resources"] = {"limits": {"cpu": "2"}}
    assert builders.config_hash(parse_cluster_spec(resources)) != base


def test_build_children_uses_the_scale_targets_replicas() -> None:
    children = builders.build_children("demo", "ns", CLUSTER, {"code": 5})
    kinds = [(c["kind"], c["metadata"]["name"]) for c in children]
    assert kinds[0] == ("ConfigMap", "demo-config")
    assert ("CoSineDrafterPool", "demo-code") in kinds
    by_name = {c["metadata"]["name"]: c for c in children if c["kind"] == "Deployment"}
    assert by_name["demo-drafter-code"]["spec"]["replicas"] == 5
    assert by_name["demo-drafter-ngram"]["spec"]["replicas"] == 1
    assert all(c["metadata"]["namespace"] == "ns" for c in children)


def test_pods_pull_their_models_before_the_runtime_starts() -> None:
    """The runtime only loads from the model cache (an emptyDir), so an init container fills it:
    the verifier's model; a model pool's model, plus the verifier's when it translates tokenizers;
    nothing for a model-free n-gram pool."""
    spec = copy.deepcopy(SPEC)
    spec["drafterPools"].append({"name": "small", "model": "smollm2-135m-instruct", "translateTokenizer": True})

    def init(d: dict[str, Any]) -> list[dict[str, Any]]:
        return d["spec"]["template"]["spec"].get("initContainers", [])

    (v,) = init(builders.build_verifier_deployment("demo", "ns", parse_cluster_spec(spec)))
    assert v["name"] == "model-pull" and v["command"] == ["cosine"]
    assert v["args"] == ["models", "pull", "qwen2.5-coder-1.5b-instruct"]
    assert v["volumeMounts"] == [{"name": "models", "mountPath": "/models"}]
    assert {e["name"]: e.get("value") for e in v["env"]}["COSINE_CACHE"] == "/models"
    (code,) = init(builders.build_drafter_deployment("demo", "ns", parse_cluster_spec(spec), "code", replicas=1))
    assert code["args"] == ["models", "pull", "qwen2.5-coder-0.5b-instruct"]
    (small,) = init(builders.build_drafter_deployment("demo", "ns", parse_cluster_spec(spec), "small", replicas=1))
    assert small["args"] == ["models", "pull", "smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"]
    assert init(builders.build_drafter_deployment("demo", "ns", parse_cluster_spec(spec), "ngram", replicas=1)) == []


def test_reconcile_patches_leave_the_pools_scale_alone() -> None:
    """Catches: a reconcile patch that carries a drafter Deployment's or a pool's replicas (a second
    writer of the pool's scale); the verifier's replicas stay (reconcile is their one writer)."""
    for child in builders.build_children("demo", "ns", CLUSTER, {"code": 5}):
        patch = builders.scale_free(child)
        drafter = child["metadata"]["labels"].get(builders.COMPONENT_LABEL) == "drafter"
        if child["kind"] == "CoSineDrafterPool" or (child["kind"] == "Deployment" and drafter):
            assert "replicas" in child["spec"] and "replicas" not in patch["spec"]
        else:
            assert patch == child
    kinds = [c["kind"] for c in builders.build_children("demo", "ns", CLUSTER, {})]
    assert kinds.index("Deployment") < kinds.index("CoSineDrafterPool")  # the scale target's Deployment first
