"""The Helm chart, offline: lint, render in several configurations, validate every object with
kubernetes-validate (strict schemas), the CRD copy is byte-identical, RBAC = what the operator calls."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from cosine_spec.cluster_spec import parse_cluster_spec
from cosine_spec.pods import ImageSpec, RoleImage
from cosine_spec.schema import read_fields
from pod_security import pod_specs, restricted_violations

from cosine_operator import kube
from cosine_operator.config import OperatorConfig

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


def render(values: dict[str, Any] | None = None, namespace: str = "cosine-system") -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values or {})
        out = chart.render(values or {}, name="cosine", namespace=namespace, is_install=True)
    return [
        doc for path, text in out.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc
    ]


def hooks(doc: dict[str, Any]) -> set[str]:
    """The Helm hook events an object is run at (empty: a release object)."""
    value = ((doc.get("metadata") or {}).get("annotations") or {}).get("helm.sh/hook", "")
    return {e.strip() for e in value.split(",") if e.strip()}


def sample_cluster(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The CoSineCluster the chart's sample Job applies (its ``COSINE_SAMPLE``)."""
    (job,) = [d for d in docs if d["kind"] == "Job" and "post-install" in hooks(d)]
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    return dict(json.loads(env["COSINE_SAMPLE"]))


def operator_config(docs: list[dict[str, Any]]) -> OperatorConfig:
    """What the operator reads from the environment the chart gives it."""
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    return OperatorConfig.from_env({e["name"]: e["value"] for e in env if "value" in e})


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
    assert "--standalone" not in args and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
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
                        "app.kubernetes.io/component": ["verifier", "drafter", "router"]}
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
    """A ``NAME ?= value`` default of the Makefile, ``$(VAR)`` references expanded."""
    text = (ROOT / "Makefile").read_text()
    value = re.search(rf"^{name} \?= (.*)$", text, re.M)
    assert value, name
    return re.sub(r"\$\((\w+)\)", lambda m: _make_var(m.group(1)), value.group(1).strip())


def test_chart_images_are_the_images_make_builds() -> None:
    """`make images` and `make images-cuda` tag what the chart runs by default: the operator image
    for the operator; for a CoSineCluster's pods the runtime image, its CUDA build on GPU pods."""
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert _make_var("IMAGE_TAG") == app_version
    sample = {"name": "demo", "spec": {"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}]}}
    docs = render({"sampleCluster": sample})
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == _make_var("OPERATOR_IMAGE")
    runtime, cuda = _make_var("RUNTIME_IMAGE"), _make_var("CUDA_RUNTIME_IMAGE")
    default = operator_config(docs).runtime_image  # the chart's runtimeImage, as the operator reads it
    image = read_fields(ImageSpec, sample_cluster(docs)["spec"].get("image") or {}).under(default)
    assert image.for_pod(RoleImage(), gpu=False)[0] == runtime  # no tag: per device
    assert image.for_pod(RoleImage(), gpu=True)[0] == cuda
    assert ImageSpec().for_pod(RoleImage(), gpu=False)[0] == runtime  # no operator default either


def test_runtime_image_is_the_operators_default_for_every_cluster() -> None:
    """`runtimeImage` reaches the operator (COSINE_OPERATOR_RUNTIME_IMAGE_*), whose default fills
    what a cluster's spec.image leaves out, field by field (the handler: test_handlers.py), so it
    sets the verifier's and the drafters' image of every cluster, not only the sample's.
    Catches: runtimeImage reaching only the sample cluster and the `helm test` pod."""
    from cosine_operator.builders.inventory import build_children

    values = {"runtimeImage": {"repository": "registry.example/cosine", "tag": "7", "pullPolicy": "Always"}}
    default = operator_config(render(values)).runtime_image
    assert default == ImageSpec(repository="registry.example/cosine", tag="7", pull_policy="Always")
    spec = {"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "model": "d"}]}
    cluster = parse_cluster_spec(spec)
    cluster = dataclasses.replace(cluster, image=cluster.image.under(default))  # what _reconcile does
    pods = pod_specs(build_children("demo", "ns", cluster, {}))
    assert pods and {c["image"] for _, pod in pods for c in pod["containers"]} == {"registry.example/cosine:7"}
    assert {c["imagePullPolicy"] for _, pod in pods for c in pod["containers"]} == {"Always"}
    own = parse_cluster_spec({**spec, "image": {"repository": "mirror.example/cosine"}})  # the spec's wins
    assert own.image.under(default).for_pod(RoleImage(), gpu=False) == ("mirror.example/cosine:7", "Always")
    unset = operator_config(render()).runtime_image  # empty tag: the release's, per device
    assert unset.tag is None and ImageSpec().under(unset).for_pod(RoleImage(), gpu=True)[0].endswith("-cuda")


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


# Helm 4's install order (internal/release/v2/util/kind_sorter.go, InstallOrder): kinds it does
# not list, a CoSineCluster among them, come after these, and it does not wait in between.
HELM_CREATES_BEFORE_UNKNOWN_KINDS = ("ValidatingWebhookConfiguration",)


def test_sample_cluster_is_applied_by_a_hook_after_the_webhook_answers() -> None:
    """Helm 4 creates a CoSineCluster release object after the ValidatingWebhookConfiguration,
    without waiting for the operator: with failurePolicy Fail the API server refuses it ("no
    endpoints available") and `helm install` fails. The sample is applied by a hook Job instead
    (after the release's objects; Helm waits for each hook Job to complete, by weight), which
    retries until the webhook answers (test_sample.py); pre-delete removes it while the operator
    runs. Catches: the sample as a release object; the Job before its RBAC; RBAC the Job lacks."""
    spec = {"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}]}
    docs = render({"sampleCluster": {"name": "demo", "spec": spec}})
    release = [d for d in docs if not hooks(d)]
    assert "ValidatingWebhookConfiguration" in {d["kind"] for d in release}
    assert not [d for d in release if d["kind"] == "CoSineCluster"], "refused at install: see the docstring"
    cluster = sample_cluster(docs)
    assert cluster["metadata"]["namespace"] == "cosine-system" and cluster["metadata"]["name"] == "demo"
    assert cluster["spec"] == spec and "image" not in cluster["spec"]  # the operator's default applies
    jobs = {d["spec"]["template"]["spec"]["containers"][0]["command"][-1]: d for d in docs if d["kind"] == "Job"}
    assert hooks(jobs["apply"]) == {"post-install", "post-upgrade"} and hooks(jobs["delete"]) == {"pre-delete"}
    rbac = [d for d in docs if d["kind"] in ("ServiceAccount", "Role", "RoleBinding") and hooks(d)]
    assert {d["kind"] for d in rbac} == {"ServiceAccount", "Role", "RoleBinding"}
    for job in jobs.values():
        assert job["spec"]["template"]["spec"]["containers"][0]["command"][:3] == [
            "python", "-m", "cosine_operator.sample"]
        weight = int(job["metadata"]["annotations"]["helm.sh/hook-weight"])
        for obj in rbac:  # in place before the Job, at each of its events
            assert hooks(job) <= hooks(obj) and int(obj["metadata"]["annotations"]["helm.sh/hook-weight"]) < weight
        assert job["spec"]["template"]["spec"]["serviceAccountName"] == next(
            d for d in rbac if d["kind"] == "ServiceAccount")["metadata"]["name"]
        assert restricted_violations(job["spec"]["template"]["spec"]) == []
    (role,) = [d for d in rbac if d["kind"] == "Role"]
    grants = {(v, tuple(r.get("resourceNames") or ())) for r in role["rules"] for v in r["verbs"]}
    # sample.py: kube.apply (a PATCH; creates a missing object), kube.delete, kube.get
    assert grants == {("create", ()), ("patch", ("demo",)), ("delete", ("demo",)), ("get", ("demo",))}
    assert not [d for d in render() if d["kind"] == "Job"]


def test_works_as_a_subchart_with_global_values(tmp_path: Path) -> None:
    """A parent chart that depends on this one, with `global` values (which Helm hands to every
    subchart, and checks against each subchart's schema: helm/helm#10392). Catches: the schema
    refusing `global`, which makes the chart unusable as a dependency."""
    parent = tmp_path / "platform"
    (parent / "charts").mkdir(parents=True)
    shutil.copytree(CHART, parent / "charts" / "cosine-operator")
    (parent / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0",
        "dependencies": [{"name": "cosine-operator", "version": "*", "repository": "file://charts/cosine-operator"}],
    }))
    (parent / "templates").mkdir()
    values = {"global": {"imageRegistry": "registry.example"}, "cosine-operator": {"replicas": 3}}
    with helm.Chart.load(parent) as chart:
        chart.validate_schema(values)
        out = chart.render(values, name="platform", namespace="ml", is_install=True)
    docs = [doc for path, text in out.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 3 and deployment["metadata"]["namespace"] == "ml"


def test_service_account_extra_env_args_and_security_contexts() -> None:
    """serviceAccount.create/name, extraEnv, extraArgs, podSecurityContext and securityContext
    reach the operator's pod (and the chart's other pods); the defaults pass Pod Security
    restricted; OpenShift's restricted-v2, which assigns the UID itself, is met by nulling
    runAsUser/runAsGroup. Catches: a hard-coded UID the SCC refuses; no way to bring your own
    ServiceAccount, proxy variables or kopf flags."""
    sample = {"name": "demo", "spec": {"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}]}}
    for _, pod in pod_specs(render({"sampleCluster": sample})):
        assert restricted_violations(pod) == []
        assert pod["securityContext"]["runAsUser"] == 10001
    values = {"serviceAccount": {"create": False, "name": "platform-operator"},
              "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
              "extraArgs": ["--verbose"],
              "podSecurityContext": {"runAsUser": None, "runAsGroup": None},
              "securityContext": {"readOnlyRootFilesystem": False},
              "sampleCluster": sample}
    docs = render(values)
    assert not [d for d in docs if d["kind"] == "ServiceAccount" and not hooks(d)]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "platform-operator"
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
    assert binding["subjects"][0]["name"] == "platform-operator"
    container = pod["containers"][0]
    assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in container["env"]
    assert container["args"][-1] == "--verbose"
    for name, spec in pod_specs(docs):
        assert "runAsUser" not in spec["securityContext"] and "runAsGroup" not in spec["securityContext"], name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False, name
        assert spec["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}, name
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError, match="serviceAccount.name"):
        chart.render({"serviceAccount": {"create": False}}, name="cosine", namespace="ns", is_install=True)
    (account,) = [d for d in render({"serviceAccount": {"annotations": {"iam.gke.io/gcp-service-account": "x"}}})
                  if d["kind"] == "ServiceAccount"]
    assert account["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": "x"}


CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "ValidatingWebhookConfiguration", "ClusterKopfPeering"}


@pytest.mark.parametrize("watch", [["team-a"], []], ids=["namespaced", "cluster-wide"])
def test_releases_of_one_name_in_two_namespaces_share_no_cluster_scoped_object(watch: list[str]) -> None:
    """Helm refuses to create an object another release owns, so `cosine` in team-a's namespace
    and `cosine` in team-b's must name their ClusterRole, ClusterRoleBinding and webhook
    configuration apart. The one exception is deliberate: two cluster-wide operators share one
    ClusterKopfPeering (the same name in both), so at most one of them acts, and the second
    install is refused rather than running two operators on every cluster.
    Catches: cluster-scoped names from the release name alone."""
    first, second = (render({"watchNamespaces": watch and [f"{ns}-work"]}, namespace=ns) for ns in ("team-a", "team-b"))
    names = [{(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in CLUSTER_SCOPED}
             for docs in (first, second)]
    assert {kind for kind, _ in names[0]} >= {"ClusterRole", "ClusterRoleBinding", "ValidatingWebhookConfiguration"}
    shared = names[0] & names[1]
    assert shared == ({("ClusterKopfPeering", "cosine-cosine-operator")} if not watch else set())
    binding = next(d for d in first if d["kind"] == "ClusterRoleBinding")
    role = next(d for d in first if d["kind"] == "ClusterRole")
    assert binding["roleRef"]["name"] == role["metadata"]["name"] == "team-a-cosine-cosine-operator"


def test_kube_version_covers_what_the_crds_use() -> None:
    """Chart.yaml's kubeVersion refuses a cluster whose API server cannot take the CRDs: CEL
    rules that name a `fieldPath` or `reason` need Kubernetes 1.28 (x-kubernetes-validations).
    Catches: no kubeVersion, so `helm install` on 1.27 fails only at the CRDs."""
    constraint = yaml.safe_load((CHART / "Chart.yaml").read_text()).get("kubeVersion", "")
    floor = re.fullmatch(r">=\s*1\.(\d+)\.0-0", constraint)
    assert floor, constraint
    crds = "".join(p.read_text() for p in (CHART / "crds").glob("*.yaml"))
    needs = 28 if re.search(r"^\s*(fieldPath|reason):", crds, re.M) else 25
    assert int(floor.group(1)) >= needs


def _pem_pair(tmp_path: Path) -> dict[str, str]:
    """A CA and a serving certificate for the chart's webhook Service, PEM (what a team keeps in
    its encrypted values)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: Any, issuer: str, signer: Any, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=365))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("webhook-ca", ca_key, "webhook-ca", ca_key, ca=True)
    serving = cert("cosine-cosine-operator.cosine-system.svc", key, "webhook-ca", ca_key, ca=False)
    pem = serialization.Encoding.PEM
    return {"ca": ca.public_bytes(pem).decode(), "crt": serving.public_bytes(pem).decode(),
            "key": key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()}


def _webhook_pieces(docs: list[dict[str, Any]]) -> tuple[dict[str, str], str, str]:
    secret = next(d for d in docs if d["kind"] == "Secret")
    webhook = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return (secret["data"], webhook["webhooks"][0]["clientConfig"]["caBundle"],
            deployment["spec"]["template"]["metadata"]["annotations"]["checksum/webhook-cert"])


def test_webhook_certificate_from_values_is_the_same_on_every_render(tmp_path: Path) -> None:
    """GitOps (Argo CD renders with `helm template`, where `lookup` finds nothing): with
    webhook.certificate the Secret, the caBundle and the operator's restart checksum are the same
    on every render, so a sync changes nothing. Catches: a certificate that changes on every sync
    (a permanent diff and an operator restart each time), or values that are half set."""
    import base64

    pem = _pem_pair(tmp_path)
    values = {"webhook": {"certificate": pem}}
    first, second = _webhook_pieces(render(values)), _webhook_pieces(render(values))
    assert first == second
    data, ca_bundle, _ = first
    assert base64.b64decode(ca_bundle).decode() == pem["ca"]
    assert base64.b64decode(data["tls.crt"]).decode() == pem["crt"]
    assert base64.b64decode(data["tls.key"]).decode() == pem["key"]
    assert _webhook_pieces(render())[1] != _webhook_pieces(render())[1]  # self-signed: new on every render
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError, match="webhook.certificate"):
        chart.render({"webhook": {"certificate": {"crt": pem["crt"]}}}, name="cosine", namespace="ns", is_install=True)


def _strict(schema: Any) -> Any:
    """A CRD's structural schema as JSON Schema that refuses unknown fields (the API server would
    prune them silently: a misspelt field is lost, not refused)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
        if "properties" in schema and "additionalProperties" not in schema and not schema.get(
                "x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def test_cert_manager_objects_match_cert_managers_crds() -> None:
    """With webhook.certManager: a self-signed Issuer and a Certificate that validate against
    cert-manager v1.21.1's own CRDs (tests/operator/data/cert-manager), the Certificate writing the
    Secret the operator mounts, for the DNS name the webhook configuration calls, and cert-manager's
    cainjector told to fill the caBundle from it. Catches: a misspelt field cert-manager's API server
    would drop, a certificate for another name or Secret, a webhook configuration never given a CA."""
    import jsonschema

    docs = render({"webhook": {"certManager": {"enabled": True}}})
    schemas = {}
    for path in (Path(__file__).parent / "data" / "cert-manager").glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schemas[crd["spec"]["names"]["kind"]] = _strict(version["schema"]["openAPIV3Schema"])
    objects = {d["kind"]: d for d in docs if d["apiVersion"] == "cert-manager.io/v1"}
    assert set(objects) == {"Issuer", "Certificate"}
    for kind, obj in objects.items():
        jsonschema.validate({k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")},
                            {**schemas[kind], "properties": {k: v for k, v in schemas[kind]["properties"].items()
                                                             if k not in ("apiVersion", "kind", "metadata")}})
    certificate, issuer = objects["Certificate"], objects["Issuer"]
    assert certificate["spec"]["issuerRef"] == {"name": issuer["metadata"]["name"], "kind": "Issuer"}
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "webhook-tls"]
    assert certificate["spec"]["secretName"] == volume["secret"]["secretName"]
    webhook = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")
    service = webhook["webhooks"][0]["clientConfig"]["service"]
    assert certificate["spec"]["dnsNames"] == [f"{service['name']}.{service['namespace']}.svc"]
    assert webhook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{certificate['metadata']['namespace']}/{certificate['metadata']['name']}")
    assert "caBundle" not in webhook["webhooks"][0]["clientConfig"]
    assert not [d for d in docs if d["kind"] == "Secret"]
    own = render({"webhook": {"certManager": {"enabled": True, "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer",
                                                                             "group": "cert-manager.io"}}}})
    (certificate,) = [d for d in own if d["kind"] == "Certificate"]
    jsonschema.validate(certificate["spec"], schemas["Certificate"]["properties"]["spec"])
    assert certificate["spec"]["issuerRef"]["kind"] == "ClusterIssuer" and not [d for d in own if d["kind"] == "Issuer"]


def test_only_the_operators_pods_carry_its_selector() -> None:
    """The operator's Service (the webhook's endpoints), PodDisruptionBudget and NetworkPolicy
    select its pods by label; the chart's other pods (the sample's hook Jobs, the `helm test` pod)
    must not match, or the API server's webhook calls reach a pod that does not serve them.
    Catches: hook pods labelled with the operator's selector labels."""
    sample = {"name": "demo", "spec": {"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}]}}
    docs = render({"sampleCluster": sample})
    selector = next(d for d in docs if d["kind"] == "Service")["spec"]["selector"]
    by_name = {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}
    pods = {name: by_name[name] for name, _ in pod_specs(docs)}
    matching = []
    for name, obj in pods.items():
        labels = obj["metadata"]["labels"] if obj["kind"] == "Pod" else obj["spec"]["template"]["metadata"]["labels"]
        if selector.items() <= labels.items():
            matching.append(name)
    assert matching == ["Deployment/cosine-cosine-operator"] and len(pods) == 4
