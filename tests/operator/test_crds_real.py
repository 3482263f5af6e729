"""The CRDs as Kubernetes itself executes them (apiextensions-apiserver + etcd, real_apiserver.py):
``kubectl apply`` of crds/ and every shipped example, schema defaults, every CEL rule firing with
its field named, the scale subresource through ``kubectl scale``, server-side apply conflicts."""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cosine_spec.cluster_spec import parse_cluster_spec
from test_chart import render, sample_cluster

pytestmark = pytest.mark.real_apiserver

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = "/apis/cosine.dev/v1alpha1/namespaces/default/cosineclusters"
POOLS = "/apis/cosine.dev/v1alpha1/namespaces/default/cosinedrafterpools"


def kubectl(router: Any, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """kubectl through the router: it needs core discovery (/api), which only the emulator has."""
    out = subprocess.run(
        ["kubectl", "--kubeconfig", str(router.kubeconfig), *args],
        capture_output=True, text=True, input=stdin, timeout=60,
    )
    if check and out.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {out.stderr}")
    return out


EXTERNAL_CRDS = Path(__file__).resolve().parent / "data" / "external-crds"


def apply_crds(routed: Any) -> None:
    """Our CRDs, and the schemas of the other projects' APIs the operator writes objects of
    (``data/external-crds``: GIE's InferencePool, the Gateway API's HTTPRoute, LWS, GKE's
    GCPBackendPolicy and HealthCheckPolicy, Istio's DestinationRule), established."""
    kubectl(routed, "apply", "--server-side", "-f", str(ROOT / "crds"), "-f", str(EXTERNAL_CRDS))
    kubectl(routed, "wait", "--for", "condition=Established", "--timeout", "30s",
            "crd/cosineclusters.cosine.dev", "crd/cosinedrafterpools.cosine.dev",
            "crd/inferencepools.inference.networking.k8s.io", "crd/httproutes.gateway.networking.k8s.io",
            "crd/leaderworkersets.leaderworkerset.x-k8s.io", "crd/gcpbackendpolicies.networking.gke.io",
            "crd/healthcheckpolicies.networking.gke.io", "crd/destinationrules.networking.istio.io")


@pytest.fixture(scope="module")
def crds(routed: Any) -> Any:
    """The router with the CRDs established; ``crds.http`` talks to the real server directly."""
    apply_crds(routed)
    routed.http = routed.real.http
    return routed


def _examples() -> list[tuple[str, dict[str, Any]]]:
    out = [(p.name, yaml.safe_load(p.read_text())) for p in sorted((ROOT / "manifests" / "examples").glob("*.yaml"))]
    sample = {"name": "sample", "spec": {"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}]}}
    return [*out, ("chart sample-cluster.yaml", sample_cluster(render({"sampleCluster": sample})))]


def _missing_defaults(schema: dict[str, Any], obj: Any, path: str = "") -> list[str]:
    """Paths where the schema declares a default that the stored object lacks (walking only the
    parts of the object that exist, as the server defaults)."""
    missing: list[str] = []
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj:
                if "default" in sub:
                    missing.append(f"{path}.{key}")
            else:
                missing += _missing_defaults(sub, obj[key], f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            missing += _missing_defaults(schema["items"], item, f"{path}[{i}]")
    return missing


def _schema(name: str) -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / name).read_text())
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def test_every_example_is_accepted_and_defaulted(crds: Any) -> None:
    schema = _schema("cosine.dev_cosineclusters.yaml")
    for name, doc in _examples():
        doc = copy.deepcopy(doc)
        doc["metadata"] = {"name": f"ex-{name.split('.')[0].split()[-1].replace('_', '-')}"[:40].lower()}
        # Server-side dry run with strict field validation (unknown fields are errors, not
        # pruned): admitted, defaulted and validated exactly as stored, but not kept (the operator
        # tests share this server). Not kubectl: its client-side validation wants /openapi/v2,
        # which this server does not serve.
        out = crds.http.post(CLUSTERS, json=doc, params={"dryRun": "All", "fieldValidation": "Strict"})
        assert out.status_code == 201, f"{name}: {out.text}"
        stored = out.json()
        assert stored["spec"]["verifier"]["model"] == doc["spec"]["verifier"]["model"]
        assert _missing_defaults(schema, stored) == [], name
        # Defaults really were filled in by the server, not present in the example already.
        assert _missing_defaults(schema, doc) != [], f"{name} sets every default itself: the check proves nothing"


def _valid() -> dict[str, Any]:
    return {
        "apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "cel"},
        "spec": {
            "verifier": {"model": "qwen2.5-coder-1.5b-instruct"},
            "drafterPools": [
                {"name": "code", "model": "qwen2.5-coder-0.5b-instruct", "replicas": 1, "minReplicas": 1,
                 "maxReplicas": 3},
                {"name": "ngram", "kind": "ngram"},
            ],
            "speculation": {"maxDraftLen": 8},
            "autoscaling": {"intervalSeconds": 30, "stabilizationSeconds": 120},
        },
    }


def _pool(spec: dict[str, Any], **fields: Any) -> None:
    spec["drafterPools"][0].update(fields)


# rule (its message) -> an object made to break it -> the field the 422 must name.
CEL_TABLE: list[tuple[str, Any, str]] = [
    ("minReplicas must be <= maxReplicas", lambda s: _pool(s, minReplicas=3, maxReplicas=2, replicas=2),
     "spec.drafterPools[0].minReplicas"),
    ("replicas must lie within [minReplicas, maxReplicas]", lambda s: _pool(s, replicas=5),
     "spec.drafterPools[0].replicas"),
    ("a drafter pool of kind model needs a model", lambda s: s["drafterPools"][0].pop("model"),
     "spec.drafterPools[0].model"),
    ("a drafter pool of kind ngram takes no model", lambda s: s["drafterPools"][1].update(model="x"),
     "spec.drafterPools[1].model"),
    ("a drafter pool of kind ngram takes no engine", lambda s: s["drafterPools"][1].update(engine="llamacpp"),
     "spec.drafterPools[1].engine"),
    ("stabilizationSeconds must be 0 or >= intervalSeconds",
     lambda s: s["autoscaling"].update(stabilizationSeconds=10), "spec.autoscaling.stabilizationSeconds"),
    ("spec.spot.provider is required when a drafter pool asks for capacity spot",
     lambda s: _pool(s, capacity="spot"), "spec.spot"),
    ("spec.gateway.loadBalancerSourceRanges and loadBalancerClass need serviceType LoadBalancer",
     lambda s: s.update(gateway={"loadBalancerClass": "service.k8s.aws/nlb"}), "spec.gateway.serviceType"),
    ("modelCache.prePopulated needs modelCache.claimName, the claim that holds the models",
     lambda s: s.update(modelCache={"prePopulated": True}), "spec.modelCache"),
    ("spec.verifier.rollout.maxSurge and spec.verifier.strategy cannot both be set",
     lambda s: s["verifier"].update(rollout={"maxSurge": 1}, strategy={"type": "Recreate"}),
     "spec.verifier.rollout.maxSurge"),
]


@pytest.mark.parametrize("message,breaker,field", CEL_TABLE, ids=[row[0] for row in CEL_TABLE])
def test_cel_rule_fires_with_field_named(crds: Any, message: str, breaker: Any, field: str) -> None:
    body = _valid()
    ok = crds.http.post(CLUSTERS, json=body, params={"dryRun": "All"})
    assert ok.status_code == 201, ok.text
    breaker(body["spec"])
    r = crds.http.post(CLUSTERS, json=body, params={"dryRun": "All"})
    assert r.status_code == 422, r.text
    causes = r.json()["details"]["causes"]
    # The server prefixes the rule's message with "Invalid value: <value>: ".
    assert any(c.get("field") == field and c["message"].endswith(message) for c in causes), causes
    print(f"CEL | {message} | {field} | {r.json()['message']}")


def test_rules_that_schema_validation_preempts(crds: Any) -> None:
    """``size(drafterPools) >= 1`` and the unique-names rule are backed by ``minItems`` and
    ``x-kubernetes-list-type: map`` (key ``name``): the real server reports those first, still
    naming the field."""
    body = _valid()
    body["spec"]["drafterPools"] = []
    r = crds.http.post(CLUSTERS, json=body, params={"dryRun": "All"})
    assert r.status_code == 422 and "spec.drafterPools" in r.text, r.text
    print(f"CEL | at least one drafter pool | {r.json()['message']}")
    body = _valid()
    body["spec"]["drafterPools"][1] = {**body["spec"]["drafterPools"][0]}
    r = crds.http.post(CLUSTERS, json=body, params={"dryRun": "All"})
    assert r.status_code == 422 and "spec.drafterPools[1]" in r.text, r.text
    print(f"CEL | drafter pool names must be unique | {r.json()['message']}")


def test_a_bad_autoscaling_objective_or_price_is_refused_naming_the_field(crds: Any) -> None:
    for breaker, field in ((lambda s: _pool(s, pricePerHourUsd=-0.5), "spec.drafterPools[0].pricePerHourUsd"),
                           (lambda s: s["autoscaling"].update(acceptedTokenValuePerMillionUsd=-1),
                            "spec.autoscaling.acceptedTokenValuePerMillionUsd")):
        body = _valid()
        breaker(body["spec"])
        r = crds.http.post(CLUSTERS, json=body, params={"dryRun": "All"})
        assert r.status_code == 422 and field in r.text, r.text
    body = _valid()
    _pool(body["spec"], pricePerHourUsd=0.35)
    body["spec"]["autoscaling"]["acceptedTokenValuePerMillionUsd"] = 2.5
    r = crds.http.post(CLUSTERS, json=body, params={"dryRun": "All"})
    assert r.status_code == 201 and r.json()["spec"]["drafterPools"][0]["pricePerHourUsd"] == 0.35, r.text


@pytest.fixture
def cleanup(crds: Any) -> Iterator[list[str]]:
    """Pools to delete after the test (the operator tests share this server)."""
    names: list[str] = []
    yield names
    for name in names:
        crds.http.delete(f"{POOLS}/{name}")


def _create_pool(server: Any, name: str) -> dict[str, Any]:
    body = {"apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineDrafterPool", "metadata": {"name": name},
            "spec": {"clusterName": "demo", "pool": "code", "replicas": 1, "minReplicas": 1, "maxReplicas": 4}}
    r = server.http.post(POOLS, json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_kubectl_scale_goes_through_the_scale_subresource(crds: Any, cleanup: list[str]) -> None:
    pool = _create_pool(crds, "scale-me")
    cleanup.append("scale-me")
    crds.http.patch(f"{POOLS}/scale-me/status", json={"status": {"replicas": 1, "selector": "app=x"}},
                    headers={"Content-Type": "application/merge-patch+json"}).raise_for_status()
    kubectl(crds, "scale", "cosinedrafterpool/scale-me", "--replicas=3")
    scale = crds.http.get(f"{POOLS}/scale-me/scale").json()
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 1, "selector": "app=x"}
    after = crds.http.get(f"{POOLS}/scale-me").json()
    assert after["spec"]["replicas"] == 3
    assert after["metadata"]["generation"] == pool["metadata"]["generation"] + 1
    # A negative count is rejected by the CRD's schema through the subresource too.
    bad = kubectl(crds, "scale", "cosinedrafterpool/scale-me", "--replicas=-1", check=False)
    assert bad.returncode != 0


def test_stale_resource_version_is_a_conflict(crds: Any, cleanup: list[str]) -> None:
    pool = _create_pool(crds, "stale")
    cleanup.append("stale")
    crds.http.patch(f"{POOLS}/stale", json={"spec": {"replicas": 2}},
                    headers={"Content-Type": "application/merge-patch+json"}).raise_for_status()
    pool["spec"]["replicas"] = 3
    r = crds.http.put(f"{POOLS}/stale", json=pool)
    assert r.status_code == 409, r.text


def test_server_side_apply_conflict_between_managers(crds: Any, cleanup: list[str]) -> None:
    _create_pool(crds, "ssa")
    cleanup.append("ssa")
    apply = {"Content-Type": "application/apply-patch+yaml"}
    body = {"apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineDrafterPool", "metadata": {"name": "ssa"},
            "spec": {"clusterName": "demo", "pool": "code", "replicas": 2}}
    r = crds.http.patch(f"{POOLS}/ssa", content=json.dumps(body), headers=apply, params={"fieldManager": "hpa"})
    assert r.status_code == 409, r.text  # replicas is owned by the creator's manager
    r = crds.http.patch(f"{POOLS}/ssa", content=json.dumps(body), headers=apply,
                        params={"fieldManager": "hpa", "force": "true"})
    assert r.status_code == 200, r.text
    managers = {m["manager"] for m in r.json()["metadata"]["managedFields"]}
    assert "hpa" in managers


# CoSineDrafterPool rules: (message, update that breaks it, field). The first two are transition
# rules (oldSelf): a pool re-pointed at another cluster or pool would orphan its Deployment.
POOL_TABLE: list[tuple[str, dict[str, Any], str]] = [
    ("clusterName is immutable", {"clusterName": "other"}, "spec.clusterName"),
    ("pool is immutable", {"pool": "other"}, "spec.pool"),
    ("minReplicas must be <= maxReplicas", {"minReplicas": 5}, "spec.minReplicas"),
]


@pytest.mark.parametrize("message,change,field", POOL_TABLE, ids=[row[0] for row in POOL_TABLE])
def test_pool_rule_fires_with_field_named(crds: Any, cleanup: list[str], message: str, change: dict[str, Any],
                                          field: str) -> None:
    name = f"rule-{field.rsplit('.', 1)[-1].lower()}"
    _create_pool(crds, name)
    cleanup.append(name)
    r = crds.http.patch(f"{POOLS}/{name}", json={"spec": change},
                        headers={"Content-Type": "application/merge-patch+json"})
    assert r.status_code == 422, r.text
    causes = r.json()["details"]["causes"]
    assert any(c.get("field") == field and c["message"].endswith(message) for c in causes), causes
    print(f"CEL | {message} | {field} | {r.json()['message']}")
    # The same write of an unchanged value passes: the rule is about change, not content.
    ok = crds.http.patch(f"{POOLS}/{name}", json={"spec": {"replicas": 2}},
                         headers={"Content-Type": "application/merge-patch+json"})
    assert ok.status_code == 200, ok.text


def test_network_policy_and_drafter_tls_fields(crds: Any) -> None:
    """Catches: metricsFrom peers pruned or rejected (they are Kubernetes' NetworkPolicyPeer,
    kept verbatim); networkPolicy.enabled not defaulted to true; drafterTLS without its Secret."""
    body = _valid()
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app": "prometheus"}}}
    body["spec"]["networkPolicy"] = {"metricsFrom": [peer, {"ipBlock": {"cidr": "10.0.0.0/8"}}]}
    body["spec"]["drafterTLS"] = {"secretName": "drafter-tls"}
    out = crds.http.post(CLUSTERS, json=body, params={"dryRun": "All", "fieldValidation": "Strict"})
    assert out.status_code == 201, out.text
    spec = out.json()["spec"]
    assert spec["networkPolicy"] == {"enabled": True, "metricsFrom": body["spec"]["networkPolicy"]["metricsFrom"]}
    assert spec["drafterTLS"] == {"secretName": "drafter-tls"}
    del body["spec"]["networkPolicy"]
    assert crds.http.post(CLUSTERS, json=body, params={"dryRun": "All"}).json()["spec"]["networkPolicy"] == {
        "enabled": True
    }
    body["spec"]["drafterTLS"] = {"serverName": "drafters"}
    r = crds.http.post(CLUSTERS, json=body, params={"dryRun": "All"})
    assert r.status_code == 422 and "spec.drafterTLS.secretName" in r.text, r.text


def test_model_source_fields(crds: Any) -> None:
    """Catches: model URIs, a pre-populated cache or the credentials Secret pruned or refused by
    the schema (strict field validation: a field the CRD lacks is an error); prePopulated not
    defaulted; the credentials Secret without its name."""
    body = _valid()
    body["spec"]["verifier"]["model"] = "s3://ml-weights/qwen2.5-coder-1.5b-instruct"
    body["spec"]["modelCache"] = {"claimName": "weights", "prePopulated": True}
    body["spec"]["modelCredentialsSecretRef"] = {"name": "model-store"}
    out = crds.http.post(CLUSTERS, json=body, params={"dryRun": "All", "fieldValidation": "Strict"})
    assert out.status_code == 201, out.text
    spec = out.json()["spec"]
    assert spec["verifier"]["model"] == "s3://ml-weights/qwen2.5-coder-1.5b-instruct"
    assert spec["modelCache"]["prePopulated"] is True and spec["modelCredentialsSecretRef"] == {"name": "model-store"}
    body["spec"]["modelCache"] = {"size": "10Gi"}
    assert crds.http.post(CLUSTERS, json=body, params={"dryRun": "All"}).json()["spec"]["modelCache"][
        "prePopulated"] is False
    body["spec"]["modelCredentialsSecretRef"] = {}
    r = crds.http.post(CLUSTERS, json=body, params={"dryRun": "All"})
    assert r.status_code == 422 and "spec.modelCredentialsSecretRef.name" in r.text, r.text


PREVIOUS_CRDS = Path(__file__).parent / "data" / "crds-previous"  # the CRDs of the release before this one


def test_crd_upgrade_from_the_previous_release(crds: Any) -> None:
    """The documented upgrade, `kubectl apply --server-side -f crds/` over the previous release's
    CRDs, on the real server: an object stored under the old schema still reads, gains the new
    defaults, and takes the new fields; before the upgrade the old schema prunes them.
    Catches: a CRD change that breaks stored objects (a new required field, a narrowed type)."""
    name = "upgrade-me"
    try:
        kubectl(crds, "apply", "--server-side", "-f", str(PREVIOUS_CRDS))
        kubectl(crds, "wait", "--for", "condition=Established", "--timeout", "30s", "crd/cosineclusters.cosine.dev")
        body = {"apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": name},
                "spec": {"verifier": {"model": "qwen2.5-coder-1.5b-instruct"},
                         "drafterPools": [{"name": "ngram", "kind": "ngram"}], "modelCache": {"size": "10Gi"}}}
        r = crds.http.post(CLUSTERS, json=body)
        assert r.status_code == 201, r.text
        old = r.json()["spec"]
        assert "modelCache" not in old  # unknown to the old schema: pruned
        assert old["image"]["tag"] == "0.1.0"  # the old CRD defaulted the tag (README: upgrading)
        apply_crds(crds)  # this release's
        kubectl(crds, "wait", "--for", "condition=Established", "--timeout", "30s", "crd/cosineclusters.cosine.dev")
        stored = crds.http.get(f"{CLUSTERS}/{name}").json()["spec"]
        assert stored["verifier"]["startupTimeoutSeconds"] == 1800  # new defaults apply on read
        patched = crds.http.patch(f"{CLUSTERS}/{name}", json={"spec": {"modelCache": {"size": "10Gi"}}},
                                  headers={"Content-Type": "application/merge-patch+json"})
        assert patched.status_code == 200, patched.text
        assert patched.json()["spec"]["modelCache"] == {"size": "10Gi", "accessMode": "ReadWriteMany",
                                                        "prePopulated": False}
    finally:
        crds.http.delete(f"{CLUSTERS}/{name}")
        apply_crds(crds)


_PLURALS = {"InferencePool": "inferencepools", "HTTPRoute": "httproutes",
            "GCPBackendPolicy": "gcpbackendpolicies", "HealthCheckPolicy": "healthcheckpolicies",
            "DestinationRule": "destinationrules"}


def test_the_gke_routers_objects_are_valid_on_the_real_server(crds: Any) -> None:
    """The router of the GKE example (spec.router.provider: gke): its InferencePool, HTTPRoute and
    GKE's policies on the pool pass GIE's, the Gateway API's and GKE's schemas (data/external-crds)
    as the real server checks them, unknown fields refused."""
    from cosine_operator.builders.router import build_router

    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "gke-gateway-multinode.yaml").read_text())
    cluster = parse_cluster_spec(doc["spec"])
    assert cluster.router.provider == "gke"
    objs = [o for o in build_router("llama405", "default", cluster) if o["kind"] in _PLURALS]
    assert sorted(o["kind"] for o in objs) == sorted(set(_PLURALS) - {"DestinationRule"})
    for obj in objs:
        path = f"/apis/{obj['apiVersion']}/namespaces/default/{_PLURALS[obj['kind']]}"
        r = crds.http.post(path, json=obj, params={"dryRun": "All", "fieldValidation": "Strict"})
        assert r.status_code == 201, (obj["kind"], r.text)
    check = next(o for o in objs if o["kind"] == "HealthCheckPolicy")
    bad = copy.deepcopy(check)
    bad["spec"]["default"]["timeoutSec"] = 10  # beyond checkIntervalSec: GKE's rule refuses it
    r = crds.http.post("/apis/networking.gke.io/v1/namespaces/default/healthcheckpolicies", json=bad,
                       params={"dryRun": "All"})
    assert r.status_code == 422 and "checkIntervalSec" in r.text


def test_the_istio_routers_objects_are_valid_on_the_real_server(crds: Any) -> None:
    """``spec.router.provider: istio``: the picker's DestinationRule passes the schema of Istio
    1.28's CRD (data/external-crds) as the real server checks it, unknown fields refused, beside
    the pool and the route; a TLS mode Istio does not define is refused."""
    from cosine_operator.builders.router import build_router

    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "gke-gateway-multinode.yaml").read_text())
    doc["spec"]["router"]["provider"] = "istio"
    objs = [o for o in build_router("llama405", "default", parse_cluster_spec(doc["spec"])) if o["kind"] in _PLURALS]
    assert sorted(o["kind"] for o in objs) == ["DestinationRule", "HTTPRoute", "InferencePool"]
    for obj in objs:
        path = f"/apis/{obj['apiVersion']}/namespaces/default/{_PLURALS[obj['kind']]}"
        r = crds.http.post(path, json=obj, params={"dryRun": "All", "fieldValidation": "Strict"})
        assert r.status_code == 201, (obj["kind"], r.text)
    rule = copy.deepcopy(next(o for o in objs if o["kind"] == "DestinationRule"))
    rule["spec"]["trafficPolicy"]["tls"]["mode"] = "TLS"
    r = crds.http.post("/apis/networking.istio.io/v1/namespaces/default/destinationrules", json=rule,
                       params={"dryRun": "All"})
    assert r.status_code == 422 and "mode" in r.text
