"""Pure builders: the runtime contract (names, ports, commands), GPU scheduling, roll-out hashing."""

from __future__ import annotations

import copy
from typing import Any

import yaml
from cosine_spec.cluster_spec import parse_cluster_spec
from cosine_spec.contract import COMPONENT_LABEL, CONFIG_FILE, POOL_LABEL
from cosine_spec.pods import RUNTIME_TAG

from cosine_operator.builders.inventory import build_children
from cosine_operator.builders.multinode import build_verifier
from cosine_operator.builders.names import labels, selector_labels
from cosine_operator.builders.networking import (
    build_drafter_service,
    build_gateway_service,
    build_network_policies,
    metrics_sources,
    operator_peer,
)
from cosine_operator.builders.pods import DEFAULT_RESOURCES
from cosine_operator.builders.router import build_router
from cosine_operator.builders.security import writable_dirs
from cosine_operator.builders.storage import (
    PULL_LIMIT_REQUEST_RATIO,
    build_model_claim,
    build_model_job,
    cluster_models,
    model_storage_gib,
    pull_memory_gib,
)
from cosine_operator.builders.workloads import (
    build_config_map,
    build_disruption_budgets,
    build_drafter_deployment,
    build_verifier_deployment,
)

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
    cm = build_config_map("demo", "ns", CLUSTER)
    assert cm["metadata"]["name"] == "demo-config"
    doc = yaml.safe_load(cm["data"]["cluster.yaml"])
    assert doc == {
        "apiVersion": "cosine.dev/v1alpha1",
        "kind": "CoSineCluster",
        "metadata": {"name": "demo"},
        "spec": SPEC,
    }


def test_verifier_deployment_command_ports_probes_and_gpu() -> None:
    d = build_verifier_deployment("demo", "ns", CLUSTER)
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
    assert d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9091"  # cosine_ series
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    env = {e["name"]: e for e in c["env"]}
    assert env["COSINE_CACHE"]["value"] == "/models"
    assert env["COSINE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "cosine-key", "key": "token"}
    assert env["HF_HOME"]["value"] == "/models/hf"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    # vLLM needs more shared memory than 64 MiB; HOME (the compile caches) and /tmp: the writable places
    assert mounts == {"/etc/cosine", "/models", "/dev/shm", "/home/cosine", "/tmp"}
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_drafter_deployment_and_headless_service() -> None:
    d = build_drafter_deployment("demo", "ns", CLUSTER, "code", replicas=3)
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
    # a llama.cpp or n-gram pool needs no big /dev/shm; vLLM's engine processes do
    assert not [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    v = build_verifier_deployment("demo", "ns", CLUSTER)["spec"]["template"]["spec"]
    (mount,) = [m for m in v["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert {"name": mount["name"], "emptyDir": {"medium": "Memory"}} in v["volumes"]
    svc = build_drafter_service("demo", "ns", "code")
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["port"] for p in svc["spec"]["ports"]} == {50052, 9090}
    assert (
        d["spec"]["selector"]["matchLabels"].items()
        <= svc["spec"]["selector"].items() | d["spec"]["template"]["metadata"]["labels"].items()
    )


def test_gateway_service_maps_port_to_8000() -> None:
    svc = build_gateway_service("demo", "ns", CLUSTER)
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == selector_labels("demo", "verifier")


def _templates(spec: dict[str, Any]) -> dict[str, Any]:
    """Every workload's pod template by the workload's name."""
    children = build_children("demo", "ns", parse_cluster_spec(spec), {})
    return {c["metadata"]["name"]: c["spec"]["template"] for c in children if c["kind"] == "Deployment"}


def test_gateway_service_fields_make_an_internal_load_balancer() -> None:
    spec = copy.deepcopy(SPEC)
    spec["gateway"].update(annotations={"networking.gke.io/load-balancer-type": "Internal"},
                           loadBalancerSourceRanges=["10.0.0.0/8"], loadBalancerClass="service.k8s.aws/nlb")
    svc = build_gateway_service("demo", "ns", parse_cluster_spec(spec))
    assert svc["metadata"]["annotations"] == {"networking.gke.io/load-balancer-type": "Internal"}
    assert svc["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
    assert svc["spec"]["loadBalancerClass"] == "service.k8s.aws/nlb"
    plain = build_gateway_service("demo", "ns", CLUSTER)
    assert "annotations" not in plain["metadata"] and "loadBalancerClass" not in plain["spec"]


def test_scaling_does_not_change_the_pod_template_but_a_model_change_does() -> None:
    base = _templates(SPEC)
    scaled = copy.deepcopy(SPEC)
    scaled["drafterPools"][0]["replicas"] = 4
    scaled["autoscaling"] = {"enabled": False}
    assert _templates(scaled) == base
    changed = copy.deepcopy(SPEC)
    changed["verifier"]["model"] = "qwen2.5-coder-3b-instruct"
    assert _templates(changed)["demo-verifier"] != base["demo-verifier"]
    resources = copy.deepcopy(SPEC)
    resources["drafterPools"][0]["resources"] = {"limits": {"cpu": "2"}}
    assert _templates(resources)["demo-drafter-code"] != base["demo-drafter-code"]


def test_build_children_uses_the_scale_targets_replicas() -> None:
    children = build_children("demo", "ns", CLUSTER, {"code": 5})
    kinds = [(c["kind"], c["metadata"]["name"]) for c in children if c["kind"] != "NetworkPolicy"]
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

    (v,) = init(build_verifier_deployment("demo", "ns", parse_cluster_spec(spec)))
    assert v["name"] == "model-pull" and v["command"] == ["cosine"]
    assert v["args"] == ["models", "pull", "qwen2.5-coder-1.5b-instruct"]
    assert v["volumeMounts"] == [{"name": "models", "mountPath": "/models"},  # and, its root filesystem read-only:
                                 {"name": "cache", "mountPath": "/home/cosine"}, {"name": "tmp", "mountPath": "/tmp"}]
    assert {e["name"]: e.get("value") for e in v["env"]}["COSINE_CACHE"] == "/models"
    (code,) = init(build_drafter_deployment("demo", "ns", parse_cluster_spec(spec), "code", replicas=1))
    assert code["args"] == ["models", "pull", "qwen2.5-coder-0.5b-instruct"]
    (small,) = init(build_drafter_deployment("demo", "ns", parse_cluster_spec(spec), "small", replicas=1))
    assert small["args"] == ["models", "pull", "smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"]
    assert init(build_drafter_deployment("demo", "ns", parse_cluster_spec(spec), "ngram", replicas=1)) == []


def test_children_carry_their_scale_for_creation() -> None:
    """Catches: a drafter Deployment created with other replicas than its pool's, or the scale
    target created before the Deployment it resizes (the operator applies both without replicas
    after creation: kube.apply_scale_free)."""
    for child in build_children("demo", "ns", CLUSTER, {"code": 5}):
        if (child["kind"], child["metadata"]["name"]) == ("Deployment", "demo-drafter-code"):
            assert child["spec"]["replicas"] == 5  # the pool's current scale
    kinds = [c["kind"] for c in build_children("demo", "ns", CLUSTER, {})]
    assert kinds.index("Deployment") < kinds.index("CoSineDrafterPool")  # the scale target's Deployment first


# ---------------------------------------------------------------- NetworkPolicies and TLS

OPERATOR_LABELS = {"app.kubernetes.io/name": "cosine-operator", "app.kubernetes.io/instance": "cosine"}
OPERATOR = operator_peer("cosine-system", OPERATOR_LABELS)


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the evaluator below knows matchLabels only
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_admits(peer: dict[str, Any], policy_ns: str, ns: str, labels: dict[str, str]) -> bool:
    assert set(peer) <= {"podSelector", "namespaceSelector"}, peer
    if "namespaceSelector" in peer:
        ns_ok = _matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": ns})
    else:
        ns_ok = ns == policy_ns  # a podSelector alone: the policy's namespace
    return ns_ok and _matches(peer.get("podSelector", {}), labels)


def allowed(policies: list[dict[str, Any]], dest: tuple[str, dict[str, str]], port: int,
            src: tuple[str, dict[str, str]]) -> bool:
    """Kubernetes' ingress semantics for pods: ``src`` (namespace, labels) may reach ``port`` of
    ``dest`` if no policy selects ``dest``, or some rule of a selecting policy admits both."""
    selecting = [
        p for p in policies
        if p["metadata"]["namespace"] == dest[0] and _matches(p["spec"]["podSelector"], dest[1])
        and "Ingress" in p["spec"]["policyTypes"]
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            port_ok = "ports" not in rule or any(
                r["port"] == port and r.get("protocol", "TCP") == "TCP" for r in rule["ports"]
            )
            from_ok = "from" not in rule or any(
                _peer_admits(peer, policy["metadata"]["namespace"], *src) for peer in rule["from"]
            )
            if port_ok and from_ok:
                return True
    return False


def _pod(component: str, pool: str | None = None, cluster: str = "demo", ns: str = "ns") -> tuple[str, dict[str, str]]:
    return ns, labels(cluster, component, pool)


def test_network_policies_allow_what_each_port_needs_and_nothing_else() -> None:
    """Catches: drafters' gRPC open to any pod (or to another cluster's verifier); a policy on the
    wrong pods (another pool, the whole namespace); metrics open across namespaces, or closed to the
    operator's autoscaler; the OpenAI port closed."""
    policies = build_network_policies("demo", "ns", CLUSTER, OPERATOR)
    names = sorted(p["metadata"]["name"] for p in policies)
    assert names == ["demo-drafter-code", "demo-drafter-ngram", "demo-verifier"]
    verifier, code, ngram = _pod("verifier"), _pod("drafter", "code"), _pod("drafter", "ngram")
    neighbour = ("ns", {"app": "something-else"})
    elsewhere = ("other", {"app": "something-else"})
    operator = ("cosine-system", OPERATOR_LABELS)
    other_verifier = _pod("verifier", cluster="other")
    for drafter in (code, ngram):
        assert allowed(policies, drafter, 50052, verifier)
        for src in (neighbour, elsewhere, operator, other_verifier, _pod("drafter", "ngram")):
            assert not allowed(policies, drafter, 50052, src), (drafter, src)
        for src in (neighbour, operator, verifier):
            assert allowed(policies, drafter, 9090, src), (drafter, src)
        assert not allowed(policies, drafter, 9090, elsewhere)
        assert not allowed(policies, drafter, 8080, verifier)  # no other port
    for src in (neighbour, elsewhere, operator):
        assert allowed(policies, verifier, 8000, src)
    assert allowed(policies, verifier, 9091, neighbour) and allowed(policies, verifier, 9091, operator)
    assert not allowed(policies, verifier, 9091, elsewhere)
    assert not allowed(policies, verifier, 50052, neighbour)
    # each policy selects its own pods only: another cluster's and the operator's pods are untouched
    assert allowed(policies, _pod("drafter", "code", cluster="other"), 50052, neighbour)
    (code_policy,) = [p for p in policies if p["metadata"]["name"] == "demo-drafter-code"]
    assert allowed([code_policy], ngram, 50052, neighbour)  # code's policy does not select ngram pods
    assert code_policy["metadata"]["labels"][POOL_LABEL] == "code"  # pruned with its pool


def test_metrics_from_replaces_the_namespace_peer_and_disabled_creates_none() -> None:
    """Catches: metricsFrom ignored or merged with the namespace-wide default; the operator's peer
    dropped when metricsFrom is given; policies built although disabled."""
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    spec = copy.deepcopy(SPEC)
    spec["networkPolicy"] = {"metricsFrom": [monitoring]}
    policies = build_network_policies("demo", "ns", parse_cluster_spec(spec), OPERATOR)
    prometheus = ("monitoring", {"app": "prometheus"})
    for dest, port in ((_pod("verifier"), 9091), (_pod("drafter", "code"), 9090)):
        assert allowed(policies, dest, port, prometheus)
        assert allowed(policies, dest, port, ("cosine-system", OPERATOR_LABELS))
        assert not allowed(policies, dest, port, ("ns", {"app": "something-else"}))
    spec["networkPolicy"] = {"enabled": False}
    cluster = parse_cluster_spec(spec)
    assert build_network_policies("demo", "ns", cluster) == []
    assert not [c for c in build_children("demo", "ns", cluster, {}) if c["kind"] == "NetworkPolicy"]
    # no operator identity (it runs outside the cluster): no operator peer, the namespace still allowed
    assert operator_peer("", OPERATOR_LABELS) is None
    assert metrics_sources(CLUSTER) == [{"podSelector": {}}]


def test_network_policies_come_first_and_do_not_restart_pods() -> None:
    kinds = [c["kind"] for c in build_children("demo", "ns", CLUSTER, {})]
    assert kinds.index("Deployment") > max(i for i, k in enumerate(kinds) if k == "NetworkPolicy")
    spec = copy.deepcopy(SPEC)
    spec["networkPolicy"] = {"enabled": False, "metricsFrom": [{"podSelector": {}}]}
    assert _templates(spec) == _templates(SPEC)


def test_drafter_tls_secret_is_mounted_and_flags_set() -> None:
    """Catches: the Secret not mounted in one of the two roles, a flag missing (one side plain, the
    other TLS: no draft ever arrives), the kubelet's plaintext gRPC probe left on a TLS port."""
    spec = copy.deepcopy(SPEC)
    spec["drafterTLS"] = {"secretName": "drafter-tls", "serverName": "drafters.cosine.internal"}
    cluster = parse_cluster_spec(spec)
    v = build_verifier_deployment("demo", "ns", cluster)
    d = build_drafter_deployment("demo", "ns", cluster, "code", replicas=1)
    for deployment in (v, d):
        pod = deployment["spec"]["template"]["spec"]
        assert {"name": "drafter-tls", "secret": {"secretName": "drafter-tls"}} in pod["volumes"]
        mount = {"name": "drafter-tls", "mountPath": "/etc/cosine-tls", "readOnly": True}
        assert mount in pod["containers"][0]["volumeMounts"]
    v_args = v["spec"]["template"]["spec"]["containers"][0]["args"]
    assert v_args[v_args.index("--drafter-tls-dir") + 1] == "/etc/cosine-tls"
    assert v_args[v_args.index("--drafter-tls-server-name") + 1] == "drafters.cosine.internal"
    drafter = d["spec"]["template"]["spec"]["containers"][0]
    assert drafter["args"][drafter["args"].index("--tls-dir") + 1] == "/etc/cosine-tls"
    assert drafter["readinessProbe"]["tcpSocket"] == {"port": 50052} and "grpc" not in drafter["readinessProbe"]
    # without drafterTLS: plain gRPC, no volume, no flag
    plain = build_drafter_deployment("demo", "ns", CLUSTER, "code", replicas=1)["spec"]["template"]["spec"]
    assert "--tls-dir" not in plain["containers"][0]["args"]
    assert all(vol["name"] != "drafter-tls" for vol in plain["volumes"])
    assert plain["containers"][0]["readinessProbe"]["grpc"] == {"port": 50052}
    plain_v = build_verifier_deployment("demo", "ns", CLUSTER)["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--drafter-tls") for a in plain_v["args"])


def _template(d: dict[str, Any]) -> dict[str, Any]:
    return d["spec"]["template"]["spec"]


def test_gpu_pods_run_the_cuda_image_and_others_the_cpu_image() -> None:
    """Catches: one image for every role (a GPU verifier on CPU vLLM), a role override ignored."""
    spec = copy.deepcopy(SPEC)
    spec["drafterPools"][0]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    cluster = parse_cluster_spec(spec)
    images = {d["metadata"]["name"]: _template(d)["containers"][0]["image"]
              for d in build_children("demo", "ns", cluster, {}) if d["kind"] == "Deployment"}
    assert images == {"demo-verifier": f"ghcr.io/cosine-project/cosine:{RUNTIME_TAG}-cuda",
                      "demo-drafter-code": f"ghcr.io/cosine-project/cosine:{RUNTIME_TAG}-cuda",
                      "demo-drafter-ngram": f"ghcr.io/cosine-project/cosine:{RUNTIME_TAG}"}
    # the pull container needs no GPU: the CPU image
    init = _template(build_verifier_deployment("demo", "ns", cluster))["initContainers"]
    assert init[0]["image"].endswith(f":{RUNTIME_TAG}")
    spec["image"] = {"repository": "registry.example/cosine", "pullPolicy": "Always"}
    spec["verifier"]["image"] = {"tag": "dev-cuda"}
    cluster = parse_cluster_spec(spec)
    v = _template(build_verifier_deployment("demo", "ns", cluster))["containers"][0]
    assert (v["image"], v["imagePullPolicy"]) == ("registry.example/cosine:dev-cuda", "Always")
    ngram = _template(build_drafter_deployment("demo", "ns", cluster, "ngram", 1))["containers"][0]
    assert ngram["image"] == f"registry.example/cosine:{RUNTIME_TAG}"
    spec["image"]["tag"] = "pinned"  # spec.image.tag: every role
    code = _template(build_drafter_deployment("demo", "ns", parse_cluster_spec(spec), "code", 1))
    assert code["containers"][0]["image"] == "registry.example/cosine:pinned"


def test_lifecycle_probes_strategy_grace_and_disruption_budgets() -> None:
    spec = copy.deepcopy(SPEC)
    spec["drafterPools"][0].update(startupTimeoutSeconds=300, terminationGracePeriodSeconds=10,
                                   strategy={"type": "Recreate"})
    cluster = parse_cluster_spec(spec)
    v = build_verifier_deployment("demo", "ns", cluster)
    c = _template(v)["containers"][0]
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 1800  # the default budget
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert _template(v)["terminationGracePeriodSeconds"] == 120
    # a rollout drains: the pod keeps serving while load balancers learn it is gone (preStop), then
    # vLLM finishes its in-flight requests within what the grace period leaves, refusing new ones
    assert c["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "10"]}}
    assert cluster.verifier.shutdown_timeout_s == 120 - 10 - 5
    from cosine_spec.verifier_spec import VerifierSpec
    assert (VerifierSpec(model="m", termination_grace_s=8).pre_stop_s,
            VerifierSpec(model="m", termination_grace_s=8).shutdown_timeout_s) == (2, 1)
    # probes sized for a loaded server, not the kubelet's 1 s
    assert {c[p]["timeoutSeconds"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {5}
    # a 1-GPU verifier rolls without a spare GPU
    assert v["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    code = build_drafter_deployment("demo", "ns", cluster, "code", 1)
    c = _template(code)["containers"][0]
    assert c["startupProbe"]["grpc"] == {"port": 50052} and c["livenessProbe"]["grpc"] == {"port": 50052}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 300
    assert _template(code)["terminationGracePeriodSeconds"] == 10 and code["spec"]["strategy"] == {"type": "Recreate"}
    ngram = build_drafter_deployment("demo", "ns", cluster, "ngram", 1)
    assert ngram["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == "25%"  # CPU pods: Kubernetes' default
    pdbs = {p["metadata"]["name"]: p["spec"] for p in build_disruption_budgets("demo", "ns", cluster)}
    assert pdbs == {
        "demo-verifier": {"maxUnavailable": 1,
                          "selector": {"matchLabels": selector_labels("demo", "verifier")}},
        "demo-drafter-code": {"maxUnavailable": 1,
                              "selector": {"matchLabels": selector_labels("demo", "drafter", "code")}},
        "demo-drafter-ngram": {"maxUnavailable": 1,
                               "selector": {"matchLabels": selector_labels("demo", "drafter", "ngram")}},
    }


def test_model_cache_job_fills_a_claim_the_pods_mount_read_only() -> None:
    """Catches: pods that download again (an init container with a cache), a token in the runtime
    containers, a Job that does not change with the models."""
    spec = copy.deepcopy(SPEC)
    spec["modelCache"] = {"storageClassName": "standard-rwx", "size": "200Gi"}
    spec["hfTokenSecretRef"] = {"name": "hf", "key": "token"}
    cluster = parse_cluster_spec(spec)
    claim = build_model_claim("demo", "ns", cluster)
    assert claim["metadata"]["name"] == "demo-models"
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "200Gi"}},
                             "storageClassName": "standard-rwx"}
    job = build_model_job("demo", "ns", cluster)
    pod = job["spec"]["template"]["spec"]
    (pull,) = pod["containers"]
    assert pull["args"] == ["models", "pull", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in pull["env"]
    assert pod["volumes"] == [{"name": "models", "persistentVolumeClaim": {"claimName": "demo-models"}},
                              *writable_dirs(gpu=False)[1]]  # its root filesystem is read-only
    assert pod["restartPolicy"] == "Never" and pull["resources"]["limits"]["memory"]
    for d in (build_verifier_deployment("demo", "ns", cluster),
              build_drafter_deployment("demo", "ns", cluster, "code", 1)):
        p = _template(d)
        assert "initContainers" not in p  # nothing downloaded at start
        claim = {"name": "models", "persistentVolumeClaim": {"claimName": "demo-models", "readOnly": True}}
        assert claim in p["volumes"]
        mount = next(m for m in p["containers"][0]["volumeMounts"] if m["name"] == "models")
        assert mount["readOnly"] is True
        assert "HF_TOKEN" not in str(p["containers"])
    changed = copy.deepcopy(spec)
    changed["verifier"]["model"] = "qwen2.5-coder-7b-instruct"
    renamed = build_model_job("demo", "ns", parse_cluster_spec(changed))["metadata"]["name"]
    assert renamed != job["metadata"]["name"]
    own = copy.deepcopy(spec)
    own["modelCache"] = {"claimName": "shared-models"}
    assert build_model_claim("demo", "ns", parse_cluster_spec(own)) is None
    v = _template(build_verifier_deployment("demo", "ns", parse_cluster_spec(own)))
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "shared-models", "readOnly": True}} in v["volumes"]


def test_without_a_cache_the_pull_container_reserves_the_models_disk() -> None:
    spec = copy.deepcopy(SPEC)
    spec["verifier"]["model"] = "Qwen/Qwen2.5-Coder-7B-Instruct"
    spec["hfTokenSecretRef"] = {"name": "hf", "key": "token"}
    p = _template(build_verifier_deployment("demo", "ns", parse_cluster_spec(spec)))
    (pull,) = p["initContainers"]
    models = next(v for v in p["volumes"] if v["name"] == "models")
    assert models == {"name": "models", "emptyDir": {"sizeLimit": "18Gi"}}  # 7B x 2 bytes + headroom
    assert pull["resources"]["requests"]["ephemeral-storage"] == "18Gi"
    assert any(e["name"] == "HF_TOKEN" for e in pull["env"]) and "HF_TOKEN" not in str(p["containers"])
    assert model_storage_gib("smollm2-135m-instruct") == 2
    assert model_storage_gib("my-finetune") == 20  # no size in the name


def test_object_store_credentials_reach_only_the_containers_that_pull() -> None:
    """``spec.modelCredentialsSecretRef``: every key of the Secret an environment variable of the
    pull (as the AWS and Google SDKs read them) and the Secret mounted read-only at
    ``MODEL_CREDENTIALS_DIR`` (a GCS key file), in the pull Job and in a pod's pull init container;
    never in the runtime containers. Catches: an s3:// pull with no credentials, keys leaking into
    the serving containers, a Job not replaced when the Secret changes."""
    spec = copy.deepcopy(SPEC)
    spec["verifier"]["model"] = "s3://weights/models/qwen2.5-coder-1.5b-instruct"
    spec["modelCredentialsSecretRef"] = {"name": "store-keys"}
    mount = {"name": "model-credentials", "mountPath": "/var/run/secrets/cosine/model-credentials", "readOnly": True}
    volume = {"name": "model-credentials", "secret": {"secretName": "store-keys"}}
    p = _template(build_verifier_deployment("demo", "ns", parse_cluster_spec(spec)))
    (pull,) = p["initContainers"]
    assert pull["args"] == ["models", "pull", "s3://weights/models/qwen2.5-coder-1.5b-instruct"]
    assert pull["envFrom"] == [{"secretRef": {"name": "store-keys"}}] and mount in pull["volumeMounts"]
    assert volume in p["volumes"] and "store-keys" not in str(p["containers"])
    spec["modelCache"] = {"size": "20Gi"}
    cluster = parse_cluster_spec(spec)
    job = build_model_job("demo", "ns", cluster)
    pod = job["spec"]["template"]["spec"]
    (pull,) = pod["containers"]
    assert pull["envFrom"] == [{"secretRef": {"name": "store-keys"}}] and mount in pull["volumeMounts"]
    assert pod["volumes"] == [{"name": "models", "persistentVolumeClaim": {"claimName": "demo-models"}},
                              *writable_dirs(gpu=False)[1], volume]
    for d in (build_verifier_deployment("demo", "ns", cluster),
              build_drafter_deployment("demo", "ns", cluster, "code", 1)):
        assert "store-keys" not in str(_template(d))  # the cache is read as is: no pull, no keys
    other = copy.deepcopy(spec)
    other["modelCredentialsSecretRef"] = {"name": "other-keys"}
    assert build_model_job("demo", "ns", parse_cluster_spec(other))["metadata"]["name"] != job["metadata"][
        "name"]
    del spec["modelCredentialsSecretRef"]
    pod = build_model_job("demo", "ns", parse_cluster_spec(spec))["spec"]["template"]["spec"]
    assert "envFrom" not in pod["containers"][0] and "secret" not in str(pod["volumes"])


def test_a_prepopulated_cache_runs_no_pull_job() -> None:
    """``spec.modelCache.prePopulated``: no pull Job among the children (so reconcile never waits
    for one), no init container; the pods mount the claim read-only as it is."""
    spec = copy.deepcopy(SPEC)
    spec["modelCache"] = {"claimName": "weights", "prePopulated": True}
    cluster = parse_cluster_spec(spec)
    assert build_model_job("demo", "ns", cluster) is None
    assert build_model_claim("demo", "ns", cluster) is None  # the user's claim
    kinds = [c["kind"] for c in build_children("demo", "ns", cluster, {})]
    assert "Job" not in kinds and "PersistentVolumeClaim" not in kinds
    p = _template(build_verifier_deployment("demo", "ns", cluster))
    assert "initContainers" not in p
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in p["volumes"]
    spec["modelCache"]["prePopulated"] = False
    assert build_model_job("demo", "ns", parse_cluster_spec(spec)) is not None


def test_pod_template_fields_and_a_restricted_security_context() -> None:
    spec = copy.deepcopy(SPEC)
    spec["verifier"].update(
        imagePullSecrets=[{"name": "regcred"}], serviceAccountName="cosine-wi", priorityClassName="inference",
        runtimeClassName="nvidia", volumes=[{"name": "scratch", "emptyDir": {}}],
        volumeMounts=[{"name": "scratch", "mountPath": "/scratch"}])
    p = _template(build_verifier_deployment("demo", "ns", parse_cluster_spec(spec)))
    assert p["imagePullSecrets"] == [{"name": "regcred"}]
    assert (p["serviceAccountName"], p["priorityClassName"], p["runtimeClassName"]) == ("cosine-wi", "inference",
                                                                                         "nvidia")
    assert {"name": "scratch", "emptyDir": {}} in p["volumes"]
    assert {"name": "scratch", "mountPath": "/scratch"} in p["containers"][0]["volumeMounts"]
    assert p["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    ngram = _template(build_drafter_deployment("demo", "ns", parse_cluster_spec(spec), "ngram", 1))
    assert "serviceAccountName" not in ngram and "imagePullSecrets" not in ngram  # per role


def test_no_service_account_token_in_workload_pods() -> None:
    """The runtime never calls the Kubernetes API: verifier, drafter and pull pods mount no token,
    with or without a named service account (Workload Identity / IRSA need none mounted)."""
    spec = copy.deepcopy(SPEC)
    spec["verifier"]["serviceAccountName"] = "cosine-wi"
    spec["modelCache"] = {"size": "20Gi"}
    cluster = parse_cluster_spec(spec)
    job = build_model_job("demo", "ns", cluster)
    assert job is not None
    pods = [_template(build_verifier_deployment("demo", "ns", cluster)),
            _template(build_drafter_deployment("demo", "ns", cluster, "ngram", 1)),
            job["spec"]["template"]["spec"]]
    assert [p["automountServiceAccountToken"] for p in pods] == [False, False, False]


def test_the_pull_job_runs_as_the_verifiers_service_account() -> None:
    """The pull Job takes the verifier's ``serviceAccountName``, which the workload identity
    webhooks (IRSA, EKS Pod Identity) and GKE's metadata server key on. Catches: a Job run as the
    namespace's ``default`` account, so an ``s3://`` or ``gs://`` model without a Secret fails the
    pull and every pod waits on it."""
    spec = copy.deepcopy(SPEC)
    spec["verifier"]["model"] = "s3://weights/models/qwen2.5-coder-1.5b-instruct"
    spec["verifier"]["serviceAccountName"] = "cosine-irsa"
    spec["modelCache"] = {"size": "20Gi"}
    cluster = parse_cluster_spec(spec)
    job = build_model_job("demo", "ns", cluster)["spec"]["template"]["spec"]
    verifier = _template(build_verifier_deployment("demo", "ns", cluster))
    assert job["serviceAccountName"] == verifier["serviceAccountName"] == "cosine-irsa"
    del spec["verifier"]["serviceAccountName"]
    assert "serviceAccountName" not in build_model_job("demo", "ns", parse_cluster_spec(spec))["spec"]["template"][
        "spec"]  # the namespace's default, as the verifier's


def test_pull_job_name_follows_its_whole_template() -> None:
    """A Job's template is immutable: whatever changes it must change the name (test_k8s_emulator)."""
    spec = copy.deepcopy(SPEC)
    spec["modelCache"] = {"size": "20Gi"}

    def name(**changes: Any) -> str:
        s = copy.deepcopy(spec)
        s.update(changes)
        job = build_model_job("demo", "ns", parse_cluster_spec(s))
        assert job is not None
        return str(job["metadata"]["name"])

    base = name()
    assert base == name()  # stable
    assert base != name(image={"tag": "0.3.0"})
    assert base != name(hfTokenSecretRef={"name": "hf", "key": "token"})
    assert base != name(verifier={"model": "qwen2.5-coder-3b-instruct"})
    assert len(base) == len("demo-models-") + 8


def test_the_pull_has_the_memory_its_conversion_needs() -> None:
    """A GGUF from PyPI is converted to float32 in memory: 1.5B parameters need ~7 GiB, not 2."""
    assert pull_memory_gib(["qwen2.5-coder-1.5b-instruct"]) == 8
    assert pull_memory_gib(["smollm2-135m-instruct", "my-model"]) == 2
    spec = copy.deepcopy(SPEC)
    spec["modelCache"] = {"size": "20Gi"}
    job = build_model_job("demo", "ns", parse_cluster_spec(spec))
    assert job is not None
    (pull,) = job["spec"]["template"]["spec"]["containers"]
    models = cluster_models(parse_cluster_spec(spec))
    assert pull["resources"]["limits"]["memory"] == f"{pull_memory_gib(models)}Gi"


def _gib(quantity: str) -> float:
    return float(quantity[:-2]) / (1024 if quantity.endswith("Mi") else 1)


def test_a_hub_download_streams_and_the_pull_fits_a_limit_range() -> None:
    """Catches a 405B Hub model asking 1887 GiB (its conversion is for PyPI's GGUF files only) and
    a limit 3,800 times the request, which a namespace LimitRange (maxLimitRequestRatio) refuses."""
    assert pull_memory_gib(["meta-llama/Llama-3.1-405B-Instruct"]) == 2
    for models in (["meta-llama/Llama-3.1-405B-Instruct"], ["qwen2.5-coder-1.5b-instruct"]):
        spec = copy.deepcopy(SPEC)
        spec["verifier"]["model"] = models[0]
        spec["modelCache"] = {"size": "2Ti"}
        job = build_model_job("demo", "ns", parse_cluster_spec(spec))
        assert job is not None
        resources = job["spec"]["template"]["spec"]["containers"][0]["resources"]
        ratio = _gib(resources["limits"]["memory"]) / _gib(resources["requests"]["memory"])
        assert ratio <= PULL_LIMIT_REQUEST_RATIO


def _spot(provider: str, **pool: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["drafterPools"][0].update(capacity="spot", **pool)
    spec["spot"] = {"provider": provider}
    deployment = build_drafter_deployment("demo", "ns", parse_cluster_spec(spec), "code", 1)
    return deployment["spec"]["template"]["spec"]


def test_a_spot_pool_lands_on_its_providers_spot_nodes_within_the_notice() -> None:
    """Catches: a spot pool without the provider's selector or toleration (it lands on demand, or
    nowhere: a tainted node refuses it), or with a grace longer than the node lives after its notice."""
    gke = _spot("gke")
    assert gke["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
            "effect": "NoSchedule"} in gke["tolerations"]
    assert gke["terminationGracePeriodSeconds"] == 15  # GKE: 15 s of its 30 s notice for pods
    karpenter = _spot("karpenter", terminationGracePeriodSeconds=300)
    assert karpenter["nodeSelector"] == {"karpenter.sh/capacity-type": "spot"} and "tolerations" not in karpenter
    assert karpenter["terminationGracePeriodSeconds"] == 110  # within EC2's 2-minute notice
    aks = _spot("aks", terminationGracePeriodSeconds=10, nodeSelector={"agentpool": "spotgpu"},
                tolerations=[{"key": "kubernetes.azure.com/scalesetpriority", "operator": "Exists"}])
    assert aks["nodeSelector"] == {"kubernetes.azure.com/scalesetpriority": "spot", "agentpool": "spotgpu"}
    assert aks["tolerations"] == [{"key": "kubernetes.azure.com/scalesetpriority", "operator": "Exists"}]  # the pool's
    assert aks["terminationGracePeriodSeconds"] == 10  # a shorter grace stands
    on_demand = build_drafter_deployment("demo", "ns", CLUSTER, "code", 1)["spec"]["template"]["spec"]
    assert "nodeSelector" not in on_demand and on_demand["terminationGracePeriodSeconds"] == 30


def test_a_spot_pool_without_a_provider_is_refused_naming_the_field() -> None:
    import pytest

    spec = copy.deepcopy(SPEC)
    spec["drafterPools"][1]["capacity"] = "spot"
    with pytest.raises(ValueError, match=r"^spec\.spot\.provider is required: spec\.drafterPools\[1\] \(ngram\)"):
        parse_cluster_spec(spec)
    spec["spot"] = {"provider": "gcp"}
    with pytest.raises(ValueError, match=r"^spec\.spot\.provider must be one of"):
        parse_cluster_spec(spec)


def test_role_pods_take_spread_annotations_and_labels_and_are_never_best_effort() -> None:
    """Catches: a role's topologySpreadConstraints, podAnnotations or podLabels not reaching its pods;
    a podLabel that overrides the operator's (the Deployment would lose its pods); a pod with no
    `resources` left BestEffort (the first evicted under node pressure)."""
    spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "verifier"}}}]
    spec = copy.deepcopy(SPEC)
    spec["verifier"].pop("resources", None)
    spec["verifier"].update(topologySpreadConstraints=spread, podAnnotations={"karpenter.sh/do-not-disrupt": "true"},
                            podLabels={"team": "ml", "cosine.dev/cluster": "other"})
    spec["drafterPools"][0].update(resources={"requests": {"cpu": "2"}}, podLabels={"team": "ml"})
    cluster = parse_cluster_spec(spec)
    verifier = build_verifier_deployment("demo", "ns", cluster)["spec"]["template"]
    assert verifier["spec"]["topologySpreadConstraints"] == spread
    assert verifier["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    assert verifier["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    labels = verifier["metadata"]["labels"]
    assert labels["team"] == "ml" and labels["cosine.dev/cluster"] == "demo"
    # the defaults, and the disk of the pod's emptyDirs: the model (5 GiB), the caches (2) and /tmp (1)
    assert verifier["spec"]["containers"][0]["resources"] == {
        "requests": {**DEFAULT_RESOURCES["verifier"]["requests"], "ephemeral-storage": "8Gi"}}
    drafter = build_drafter_deployment("demo", "ns", cluster, "code", 1)["spec"]["template"]
    # the spec's, as written, and the emptyDirs' disk (a 3 GiB model, the caches, /tmp)
    assert drafter["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "2", "ephemeral-storage": "6Gi"}}
    assert "topologySpreadConstraints" not in drafter["spec"] and drafter["metadata"]["labels"]["team"] == "ml"
    for role in DEFAULT_RESOURCES.values():
        assert role["requests"]["cpu"] and role["requests"]["memory"] and "limits" not in role  # Burstable


MULTINODE = parse_cluster_spec({
    **SPEC, "verifier": {**SPEC["verifier"], "resources": {"limits": {"nvidia.com/gpu": 8}},
                         "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2}},
})


def test_a_verifier_across_nodes_is_a_leader_worker_set_of_leader_and_engine_workers() -> None:
    """Leader = the verifier pod (labels the Services, InferencePool and drafters' policy select);
    workers = the engine alone, other labels, waiting for the leader's drain before they exit.
    Catches: workers in the verifier Service (requests to a headless engine), a group that does
    not restart together, a worker that exits under the leader's in-flight requests."""
    lws = build_verifier("demo", "ns", MULTINODE)
    assert lws["kind"] == "LeaderWorkerSet" and lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    assert leader == build_verifier_deployment("demo", "ns", MULTINODE)["spec"]["template"]
    assert worker["metadata"]["labels"][COMPONENT_LABEL] == "verifier-worker"
    assert not set(selector_labels("demo", "verifier").items()) <= set(worker["metadata"]["labels"].items())
    (w,) = worker["spec"]["containers"]
    assert w["args"] == ["verifier-worker", "--cluster", CONFIG_FILE]
    assert w["resources"]["limits"]["nvidia.com/gpu"] == 8 and "ports" not in w
    wait = w["lifecycle"]["preStop"]["exec"]["command"]
    assert wait[:2] == ["python3", "-c"] and "LWS_LEADER_ADDRESS" in wait[2] and "8000" in wait[2]
    compile(wait[2], "preStop", "exec")  # the script is valid Python
    assert build_verifier("demo", "ns", CLUSTER)["kind"] == "Deployment"


def test_a_group_drains_one_at_a_time_and_talks_only_to_itself() -> None:
    pdb = build_disruption_budgets("demo", "ns", MULTINODE)[0]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchExpressions"] == [
        {"key": COMPONENT_LABEL, "operator": "In", "values": ["verifier", "verifier-worker"]}]
    policies = {p["metadata"]["name"]: p for p in build_network_policies("demo", "ns", MULTINODE)}
    worker = policies["demo-verifier-worker"]["spec"]
    assert worker["podSelector"]["matchLabels"][COMPONENT_LABEL] == "verifier-worker"
    (rule,) = worker["ingress"]
    assert "ports" not in rule and {p["podSelector"]["matchLabels"][COMPONENT_LABEL]
                                    for p in rule["from"]} == {"verifier", "verifier-worker"}
    drafter = policies["demo-drafter-code"]["spec"]["ingress"][0]["from"]
    assert drafter == [{"podSelector": {"matchLabels": selector_labels("demo", "verifier")}}]


def test_a_verifier_with_a_surge_starts_its_successor_before_the_old_pod_goes() -> None:
    """``spec.verifier.rollout.maxSurge``: the Deployment and a multi-node verifier's
    LeaderWorkerSet roll that many replicas beyond ``replicas`` and take none down first. Catches: a
    lone GPU verifier down for a whole model load on every roll, with no way to say the node pool
    can add a node (the groups of a LeaderWorkerSet had no way at all)."""
    import kubernetes_validate

    surge = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert build_verifier("demo", "ns", CLUSTER)["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0, "maxUnavailable": 1}  # the default: a GPU pod surges none
    spec = copy.deepcopy(SPEC)
    spec["verifier"]["rollout"] = {"maxSurge": 1}
    deployment = build_verifier("demo", "ns", parse_cluster_spec(spec))
    assert deployment["spec"]["strategy"] == surge
    kubernetes_validate.validate(deployment, "1.30.0", strict=True)
    spec["verifier"].update(resources={"limits": {"nvidia.com/gpu": 8}},
                            parallelism={"tensor": 8, "pipeline": 2, "nodes": 2})
    lws = build_verifier("demo", "ns", parse_cluster_spec(spec))
    assert lws["spec"]["rolloutStrategy"] == {"type": "RollingUpdate", "rollingUpdateConfiguration": surge[
        "rollingUpdate"]}
    assert build_verifier("demo", "ns", MULTINODE)["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxSurge": 0, "maxUnavailable": 1}
    # a pool's strategy is its own: the verifier's surge leaves the pools as they were
    assert build_drafter_deployment("demo", "ns", parse_cluster_spec(spec), "ngram", 1)["spec"]["strategy"][
        "rollingUpdate"]["maxSurge"] == "25%"


ROUTED = parse_cluster_spec({**SPEC, "router": {"enabled": True, "gatewayName": "gw",
                                                "gatewayFrom": [{"namespaceSelector": {}}],
                                                "weights": {"sessionAffinity": 0, "suffixAffinity": 2}}})


def test_router_objects_pool_route_and_a_least_privilege_endpoint_picker() -> None:
    objs = {(o["kind"], o["metadata"]["name"]): o for o in build_router("demo", "ns", ROUTED)}
    assert build_router("demo", "ns", CLUSTER) == []
    pool = objs[("InferencePool", "demo-router")]["spec"]
    assert pool["selector"]["matchLabels"] == selector_labels("demo", "verifier")
    assert pool["targetPorts"] == [{"number": 8000}]
    assert pool["endpointPickerRef"]["name"] == "demo-epp" and pool["endpointPickerRef"]["port"] == {"number": 9002}
    route = objs[("HTTPRoute", "demo-router")]["spec"]
    assert route["parentRefs"][0]["name"] == "gw" and "namespace" not in route["parentRefs"][0]
    assert route["rules"][0]["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                 "name": "demo-router"}]
    role = objs[("Role", "demo-epp")]
    granted = {(g, r): set(rule["verbs"])
               for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    # llm-d-router v0.10.0's charts (llm-d-router-gateway/templates/rbac.yaml, routerlib/_rbac.yaml):
    # the picker watches InferenceObjectives and InferenceModelRewrites in both groups
    assert granted == {key: {"get", "list", "watch"} for key in (
        ("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
        ("inference.networking.x-k8s.io", "inferenceobjectives"),
        ("inference.networking.x-k8s.io", "inferencemodelrewrites"),
        ("llm-d.ai", "inferenceobjectives"), ("llm-d.ai", "inferencemodelrewrites"))}
    # the operator holds what it grants (RBAC refuses a Role granting more than its creator has)
    from cosine_operator import kube
    for key, verbs in granted.items():
        assert verbs <= kube.GRANTS[key]
    binding = objs[("RoleBinding", "demo-epp")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-epp", "namespace": "ns"}]
    pod = objs[("Deployment", "demo-epp")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "demo-epp"
    args = pod["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == "demo-router" and args[args.index("--pool-namespace") + 1] == "ns"


def test_router_network_policy_admits_the_gateway_and_lets_the_picker_read_metrics() -> None:
    policies = {p["metadata"]["name"]: p for p in build_network_policies("demo", "ns", ROUTED)}
    epp = policies["demo-epp"]["spec"]
    assert epp["ingress"][0] == {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": 9002}]}
    verifier = policies["demo-verifier"]["spec"]["ingress"]
    assert verifier[0] == {"ports": [{"protocol": "TCP", "port": 8000}]}  # the API (and vLLM's metrics): anyone
    assert {"podSelector": {"matchLabels": selector_labels("demo", "router")}} in verifier[1]["from"]

