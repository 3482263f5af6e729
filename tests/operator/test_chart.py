"""The Helm chart, offline: lint, render in several configurations, validate every object with
kubernetes-validate (strict schemas), the CRD copy is byte-identical, RBAC = what the operator calls."""

from __future__ import annotations

import copy
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from cosine_spec.cluster_spec import parse_cluster_spec
from cosine_spec.pods import ImageSpec, RoleImage
from cosine_spec.schema import read_fields

from cosine_operator import kube

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "cosine-operator"
K8S_VERSION = "1.30.0"  # the oldest minor GKE and EKS still run in standard support
# Kinds from other projects' CRDs (not in kubernetes-validate's schemas).
EXTERNAL_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "Certificate", "Issuer", "CoSineCluster",
                  "ClusterKopfPeering", "KopfPeering"}
# What kopf itself needs beyond cosine_operator.kube.CALLS: watching its resources, patching
# its annotations on handled objects, posting Events, observing CRDs.
KOPF_NEEDS: dict[tuple[str, str], set[str]] = {
    ("cosine.dev", "cosineclusters"): {"list", "watch", "patch"},
    ("cosine.dev", "cosinedrafterpools"): {"list", "watch", "patch"},
    ("apps", "deployments"): {"list", "watch"},
    ("", "events"): {"create"},
}
# kopf peering (two replicas, one active): cluster-wide, or per watched namespace
PEERING_CLUSTER = {("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "patch"}}
PEERING_NAMESPACED = {("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"}}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values or {})
        out = chart.render(values or {}, name="cosine", namespace="cosine-system", is_install=True)
    return [
        doc for path, text in out.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc
    ]


def test_crds_in_chart_are_byte_identical_to_crds_dir() -> None:
    source = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert source == sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    for name in source:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), name


def test_lint_is_clean() -> None:
    report = helm.lint(CHART, strict=True, kube_version=f"v{K8S_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"watchNamespaces": ["team-a", "team-b"],
         "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True},
                     "prometheusRule": {"enabled": True}}},
        {"webhook": {"enabled": False}, "networkPolicy": {"metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}},
        {"webhook": {"certManager": {"enabled": True}}, "networkPolicy": {"enabled": False}},
        {
            "sampleCluster": {
                "name": "demo",
                "spec": {"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}]},
            }
        },
    ],
    ids=["default", "namespaced", "no-webhook", "cert-manager", "sample"],
)
def test_every_rendered_object_is_valid(values: dict[str, Any]) -> None:
    docs = render(values)
    assert docs
    for doc in docs:
        if doc["kind"] in EXTERNAL_KINDS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    crds = [yaml.safe_load(p.read_text()) for p in (CHART / "crds").glob("*.yaml")]
    for crd in crds:
        kubernetes_validate.validate(crd, K8S_VERSION, strict=True)


def test_values_schema_rejects_unknown_keys() -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"webhook": {"enabeld": True}})


def _grants(docs: list[dict[str, Any]], kinds: set[str]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for doc in docs:
        if doc["kind"] not in kinds:
            continue
        for rule in doc["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def _expected(*extra: dict[tuple[str, str], set[str]]) -> dict[tuple[str, str], set[str]]:
    want: dict[tuple[str, str], set[str]] = {}
    for source in (kube.CALLS, kube.GRANTS, KOPF_NEEDS, *extra):
        for key, verbs in source.items():
            want.setdefault(key, set()).update(verbs)
    return want


def test_rbac_grants_exactly_what_the_operator_calls_cluster_wide() -> None:
    grants = _grants(render(), {"ClusterRole"})
    crds = grants.pop(("apiextensions.k8s.io", "customresourcedefinitions"))
    assert crds == {"list", "watch"}
    assert grants == _expected(PEERING_CLUSTER)
    alone = _grants(render({"peering": {"enabled": False}}), {"ClusterRole"})
    alone.pop(("apiextensions.k8s.io", "customresourcedefinitions"))
    assert alone == _expected()


def test_rbac_per_namespace_uses_roles() -> None:
    docs = render({"watchNamespaces": ["team-a", "team-b"]})
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert _grants(roles[:1], {"Role"}) == _expected(PEERING_NAMESPACED)
    peerings = [d for d in docs if d["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    cluster = _grants(docs, {"ClusterRole"})
    assert cluster == {
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
        ("", "namespaces"): {"list", "watch"},
    }
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--all-namespaces" not in args


def test_operator_deployment_wiring() -> None:
    docs = render()
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["cosine-operator"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert "--log-format=json" in container["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["COSINE_OPERATOR_WEBHOOK_PORT"] == "9443"
    webhook = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")
    config = webhook["webhooks"][0]["clientConfig"]
    assert config["service"]["path"] == "/validate-cosinecluster"  # the kopf handler's id
    assert config["caBundle"]
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}


def test_two_operator_replicas_with_peering_and_a_disruption_budget() -> None:
    """Catches: two replicas both handling objects (no peering), a drain that takes both."""
    docs = render()
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert deployment["spec"]["replicas"] == 2 and "--peering=cosine-cosine-operator" in args
    assert "--standalone" not in args and deployment["spec"]["strategy"] == {"type": "Recreate"}
    (peering,) = [d for d in docs if d["kind"] == "ClusterKopfPeering"]
    assert peering["metadata"]["name"] == "cosine-cosine-operator"
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    crds = {p.name for p in (CHART / "crds").glob("kopf.dev_*.yaml")}
    assert crds == {"kopf.dev_kopfpeerings.yaml", "kopf.dev_clusterkopfpeerings.yaml"}
    alone = render({"peering": {"enabled": False}})
    deployment = next(d for d in alone if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1 and "--standalone" in deployment["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert not [d for d in alone if d["kind"] in ("ClusterKopfPeering", "PodDisruptionBudget")]


def test_webhook_certificate_is_kept_across_an_upgrade_and_restarts_the_operator(tmp_path: Path) -> None:
    """Rendered twice, the second time with the first render's Secret in the cluster (the chart's
    one `lookup`, substituted: offline, lookup finds nothing): the same certificate, caBundle and
    restart checksum. Rendered fresh: a new certificate, and the operator's pods roll.
    Catches: a new CA on every `helm upgrade` (every CoSineCluster write fails with
    failurePolicy Fail until the operator restarts) or a new certificate that does not restart it."""
    import shutil

    def pieces(docs: list[dict[str, Any]]) -> tuple[dict[str, str], str, str]:
        secret = next(d for d in docs if d["kind"] == "Secret")
        webhook = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        return (secret["data"], webhook["webhooks"][0]["clientConfig"]["caBundle"],
                deployment["spec"]["template"]["metadata"]["annotations"]["checksum/webhook-cert"])

    first = pieces(render())
    assert first[1] == first[0]["ca.crt"]
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    lookup = 'lookup "v1" "Secret" .Release.Namespace (include "cosine-operator.webhookSecret" .)'
    assert helpers.count(lookup) == 1
    present = "(dict \"data\" (dict " + " ".join(f'"{k}" "{v}"' for k, v in first[0].items()) + "))"
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "_helpers.tpl").write_text(helpers.replace(lookup, present))
    with helm.Chart.load(chart) as upgraded:
        out = upgraded.render({}, name="cosine", namespace="cosine-system", is_upgrade=True)
    docs = [doc for path, text in out.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    assert pieces(docs) == first  # kept: same certificate, same caBundle, no restart
    fresh = pieces(render())
    assert fresh[0]["tls.crt"] != first[0]["tls.crt"] and fresh[2] != first[2]  # new one: the operator rolls


def test_pod_monitor_scrapes_the_workload_pods() -> None:
    (monitor,) = [d for d in render({"metrics": {"podMonitor": {"enabled": True}}}) if d["kind"] == "PodMonitor"]
    selector = {e["key"]: e["values"] for e in monitor["spec"]["selector"]["matchExpressions"]}
    assert selector == {"app.kubernetes.io/managed-by": ["cosine-operator"],
                        "app.kubernetes.io/component": ["verifier", "drafter"]}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics", "http"]
    assert not [d for d in render() if d["kind"] == "PodMonitor"]


def _policy(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    return policy


def test_operator_network_policy() -> None:
    """Catches: the policy selecting other pods than the operator's; the webhook port closed (the
    API server cannot be named by a selector) or kept when there is no webhook; metrics open to all;
    networkPolicy.metricsFrom ignored; the operator not told who it is (its clusters' policies
    would shut its autoscaler out)."""
    docs = render()
    policy = _policy(docs)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"] == {"matchLabels": pod_labels}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    webhook, metrics = policy["spec"]["ingress"]
    assert webhook == {"ports": [{"protocol": "TCP", "port": 9443}]}
    assert metrics == {"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 9100}]}
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["COSINE_OPERATOR_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    labels = dict(kv.split("=") for kv in env["COSINE_OPERATOR_POD_LABELS"]["value"].split(","))
    assert labels == pod_labels

    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    (metrics,) = _policy(render({"webhook": {"enabled": False}, "networkPolicy": {"metricsFrom": [peer]}}))[
        "spec"
    ]["ingress"]
    assert metrics["from"] == [peer]
    assert not [d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


def _make_var(name: str) -> str:
    """A variable of the Makefile as make expands it (its defaults, no overrides)."""
    out = subprocess.run(["make", "-s", "--no-print-directory", "-f", "Makefile", "-f", "-", "print"], cwd=ROOT,
                         input=f"print:\n\t@echo $({name})\n", capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if not k.endswith(("_IMAGE", "IMAGE_TAG"))})
    return out.stdout.strip()


def test_chart_images_are_the_images_make_builds() -> None:
    """`make images` and `make images-cuda` tag what the chart runs by default: the operator image
    for the operator; for a CoSineCluster's pods the runtime image, its CUDA build on GPU pods."""
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert _make_var("IMAGE_TAG") == app_version
    sample = {"name": "demo", "spec": {"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}]}}
    docs = render({"sampleCluster": sample})
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == _make_var("OPERATOR_IMAGE")
    cluster = next(d for d in docs if d["kind"] == "CoSineCluster")
    runtime, cuda = _make_var("RUNTIME_IMAGE"), _make_var("CUDA_RUNTIME_IMAGE")
    image = read_fields(ImageSpec, cluster["spec"]["image"])  # no tag: per device
    assert image.for_pod(RoleImage(), gpu=False)[0] == runtime
    assert image.for_pod(RoleImage(), gpu=True)[0] == cuda
    assert ImageSpec().for_pod(RoleImage(), gpu=False)[0] == runtime  # the CRD's default
    own = copy.deepcopy(sample)
    own["spec"]["image"] = {"repository": "registry.example/cosine", "tag": "dev"}
    cluster = next(d for d in render({"sampleCluster": own}) if d["kind"] == "CoSineCluster")
    image = cluster["spec"]["image"]
    assert (image["repository"], image["tag"]) == ("registry.example/cosine", "dev")


def test_operator_pod_conventions() -> None:
    """The operator's two replicas spread across nodes by default; the usual pod knobs reach the pod;
    nameOverride/fullnameOverride rename every object; resources make it Burstable, not BestEffort."""
    deployment = next(d for d in render() if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pod["containers"][0]["resources"]["requests"]  # not BestEffort
    values = {"fullnameOverride": "op", "podLabels": {"team": "ml"}, "podAnnotations": {"a": "b"},
              "priorityClassName": "system-cluster-critical", "imagePullSecrets": [{"name": "regcred"}],
              "affinity": {"nodeAffinity": {}}, "topologySpreadConstraints": []}
    docs = render(values)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    template = deployment["spec"]["template"]
    assert deployment["metadata"]["name"] == "op"
    assert template["metadata"]["labels"]["team"] == "ml" and template["metadata"]["annotations"]["a"] == "b"
    assert template["spec"]["priorityClassName"] == "system-cluster-critical"
    assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert "topologySpreadConstraints" not in template["spec"]  # [] turns the default off
    assert {d["metadata"]["name"] for d in docs if d["kind"] in ("Service", "ServiceAccount")} <= {"op", "op-metrics"}
    single = next(d for d in render({"peering": {"enabled": False}}) if d["kind"] == "Deployment")
    assert "topologySpreadConstraints" not in single["spec"]["template"]["spec"]


def test_helm_test_sends_a_completion_through_the_sample_clusters_gateway() -> None:
    """`helm test` with a sample cluster: one hook Pod, restricted, that asks the gateway Service the
    operator creates for that cluster (its name, namespace and port) for a completion."""
    from cosine_operator.builders.networking import build_gateway_service

    spec = {"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}], "gateway": {"port": 8080}}
    docs = render({"sampleCluster": {"name": "demo", "spec": spec}})
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    gateway = build_gateway_service("demo", "cosine-system", parse_cluster_spec(spec))
    port = gateway["spec"]["ports"][0]["port"]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["GATEWAY"] == f"http://{gateway['metadata']['name']}.cosine-system.svc:{port}/v1"
    assert "/completions" in pod["spec"]["containers"][0]["command"][2]
    assert not [d for d in render() if d["kind"] == "Pod"]  # no sample cluster, no test


def _deleted_crds(line: str, base: Path) -> set[str]:
    """The CRDs a documented ``kubectl delete`` line deletes: by name, or every CRD in its ``-f`` files."""
    words = line.split()
    if words[:3] == ["kubectl", "delete", "crd"]:
        return {w for w in words[3:] if not w.startswith("-")}
    names = set()
    for flag, path in zip(words, words[1:], strict=False):
        if flag == "-f":
            target = (base / path) if (base / path).exists() else ROOT / path
            for file in sorted(target.glob("*.yaml")) if target.is_dir() else [target]:
                names |= {d["metadata"]["name"] for d in yaml.safe_load_all(file.read_text())
                          if d and d.get("kind") == "CustomResourceDefinition"}
    return names


def test_the_documented_upgrade_and_uninstall_keep_kopfs_crds_and_apply_ours_first() -> None:
    """Catches: an uninstall that deletes kopf's peering CRDs (``kubectl delete -f crds/``: every other
    kopf operator in the cluster uses them); the chart's README or NOTES not saying that Helm never
    upgrades ``crds/`` (from 0.1 the upgrade then fails on ClusterKopfPeering)."""
    with helm.Chart.load(CHART) as chart:
        notes = chart.render({}, name="cosine", namespace="cosine-system", is_install=True)[
            "cosine-operator/templates/NOTES.txt"]
    pages = {ROOT / "docs" / "kubernetes.md": ROOT, CHART / "README.md": CHART}
    texts = {path: path.read_text() for path in pages} | {CHART / "templates" / "NOTES.txt": notes}
    deleted: set[str] = set()
    for path, text in texts.items():  # the commands: markdown's fenced blocks, all of NOTES
        commands = "\n".join(re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)) if path in pages else text
        for line in re.findall(r"kubectl delete [^\n`)]*", commands):
            deleted |= _deleted_crds(line.strip(), pages.get(path, CHART))
    assert deleted == {"cosineclusters.cosine.dev", "cosinedrafterpools.cosine.dev"}, deleted
    apply_first = "kubectl apply --server-side --force-conflicts -f charts/cosine-operator/crds/"
    for path in (CHART / "README.md", CHART / "templates" / "NOTES.txt"):
        lines = [line.strip() for line in texts[path].splitlines()]
        assert apply_first in lines, path
        assert lines[lines.index(apply_first) + 1].startswith("helm upgrade"), path  # the CRDs first
