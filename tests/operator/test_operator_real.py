"""The real operator (``kopf run``) with its own objects on Kubernetes' CRD server.

CoSineCluster and CoSineDrafterPool live in apiextensions-apiserver + etcd (real_apiserver.py):
schema, status and scale subresources, resourceVersions, managedFields and deletion are
Kubernetes' code. Core and apps children live in the emulator (k8s_emulator.py); api_router.py
puts both behind the operator's one URL. There is no garbage collector: owner references are
asserted, not followed. What a user does with ``kubectl`` (apply, patch, scale, delete, get) is sent
as kubectl sends it, to the real server through the router (``kube_api``).
"""

from __future__ import annotations

import json
import shutil
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kube_api
import pytest
from api_router import ApiRouter
from conftest import RESYNC_S, run_operator
from k8s_emulator import (
    CONFIGMAPS,
    DEPLOYMENTS,
    NETWORKPOLICIES,
    PDBS,
    ROLEBINDINGS,
    ROLES,
    SERVICEACCOUNTS,
    SERVICES,
    Kube,
    wait_for,
)
from test_crds_real import apply_crds
from test_handlers import cluster_body, mark_ready, replicas

pytestmark = pytest.mark.real_apiserver

NS = "default"
CLUSTERS = "cosine.dev/v1alpha1/cosineclusters"
POOLS = "cosine.dev/v1alpha1/cosinedrafterpools"
# the same collections as kubectl addresses them through the router (kube_api)
CSC = f"/apis/{CLUSTERS.replace('/cosineclusters', '')}/namespaces/{NS}/cosineclusters"
POOL_PATH = f"/apis/{POOLS.replace('/cosinedrafterpools', '')}/namespaces/{NS}/cosinedrafterpools"


@pytest.fixture(scope="module")
def router(routed: ApiRouter) -> ApiRouter:
    apply_crds(routed)
    return routed


@pytest.fixture(scope="module")
def kube(router: ApiRouter) -> Kube:
    return Kube(router.url)


@pytest.fixture(scope="module")
def real_operator(router: ApiRouter, webhook_port: int,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The operator through the router, its webhook on TLS with a certificate for 127.0.0.1."""
    certs = tmp_path_factory.mktemp("webhook-certs")
    shutil.copy(router.real.certs["server.crt"], certs / "tls.crt")
    shutil.copy(router.real.certs["server.key"], certs / "tls.key")
    env = {"COSINE_OPERATOR_WEBHOOK_PORT": str(webhook_port), "COSINE_OPERATOR_WEBHOOK_CERT_DIR": str(certs)}
    with run_operator(router.kubeconfig, env) as runner:
        yield runner


def _conditions(kube: Kube, name: str) -> dict[str, str]:
    status = (kube.get(CLUSTERS, NS, name) or {}).get("status") or {}
    return {c["type"]: c["status"] for c in status.get("conditions") or []}


def _create(router: ApiRouter, name: str) -> dict[str, Any]:
    # fieldValidation=Ignore, as `kubectl apply --validate=false` sends it; the server's own schema
    # validation still applies (strictness is tested in test_crds_real).
    kube_api.apply(router, cluster_body(name), validation="Ignore")
    created = kube_api.get(router, f"{CSC}/{name}")
    assert created is not None, name
    return created


def test_reconcile_children_status_and_printer_columns(real_operator: Any, kube: Kube, router: ApiRouter) -> None:
    created = _create(router, "alpha")
    uid = created["metadata"]["uid"]
    children = [(CONFIGMAPS, "alpha-config"), (SERVICES, "alpha-verifier"), (SERVICES, "alpha-gateway"),
                (DEPLOYMENTS, "alpha-verifier"), (DEPLOYMENTS, "alpha-drafter-code"),
                (DEPLOYMENTS, "alpha-drafter-ngram"), (POOLS, "alpha-code"), (POOLS, "alpha-ngram")]
    for resource, name in children:
        obj = wait_for(lambda: kube.get(resource, NS, name), what=name)  # noqa: B023
        refs = obj["metadata"]["ownerReferences"]
        assert [(r["uid"], r["kind"], r["name"], r.get("controller")) for r in refs] == [
            (uid, "CoSineCluster", "alpha", True)], name
    # The pools are real objects: their scale subresource answers with the operator's selector.
    scale = router.real.http.get(f"/apis/cosine.dev/v1alpha1/namespaces/{NS}/cosinedrafterpools/alpha-code/scale")
    assert scale.status_code == 200 and scale.json()["spec"]["replicas"] == 1, scale.text
    # ... and the pods' selector (what an HPA needs) from creation on, before any pod exists.
    selector = wait_for(lambda: router.real.http.get(
        f"/apis/cosine.dev/v1alpha1/namespaces/{NS}/cosinedrafterpools/alpha-code/scale").json()["status"]
        .get("selector"), what="scale selector")
    assert "cosine.dev/pool=code" in selector.split(","), selector

    wait_for(lambda: _conditions(kube, "alpha").get("Ready") == "False", what="Ready=False")

    def all_ready() -> list[list[Any]]:
        """Play the Deployment controller on every poll (a pool the autoscaler scaled since has its
        new replicas ready too, as a controller would report them; CI's loaded run once read 1/2),
        then `kubectl get csc alpha`: the server's table of the CRD's printer columns."""
        for name in ("alpha-verifier", "alpha-drafter-code", "alpha-drafter-ngram"):
            mark_ready(kube, name)
        columns, rows = kube_api.table(router, f"{CSC}/alpha")
        assert columns[:5] == ["Name", "Ready", "Verifier", "Drafters", "Acceptance"], columns
        return rows if len(rows) == 1 and rows[0][:4] == ["alpha", "True", "1/1", "2/2"] else []

    wait_for(all_ready, what="Ready=True, 1/1 verifier, 2/2 drafters in the printer columns")
    assert _conditions(kube, "alpha").get("Ready") == "True"

    # observedGeneration follows a spec change the server counted as a new generation.
    before = kube.get(CLUSTERS, NS, "alpha")
    kube_api.patch(router, f"{CSC}/alpha", {"spec": {"verifier": {"model": "qwen2.5-coder-3b-instruct"}}})
    after = kube.get(CLUSTERS, NS, "alpha")
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1
    wait_for(lambda: kube.get(CLUSTERS, NS, "alpha")["status"].get("observedGeneration")
             == after["metadata"]["generation"], what="observedGeneration")
    wait_for(lambda: "qwen2.5-coder-3b-instruct" in kube.get(CONFIGMAPS, NS, "alpha-config")["data"]["cluster.yaml"],
             what="new model in the ConfigMap")


def test_kubectl_scale_reaches_the_deployment(real_operator: Any, kube: Kube, router: ApiRouter) -> None:
    _create(router, "gamma")
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "gamma-drafter-code"), what="drafter Deployment")
    # the pool object is applied in the same pass, after its Deployment: scaling it earlier is a 404
    wait_for(lambda: kube_api.get(router, f"{POOL_PATH}/gamma-code"), what="the CoSineDrafterPool")
    assert kube_api.scale(router, f"{POOL_PATH}/gamma-code", 3).status_code == 200
    wait_for(lambda: replicas(kube, "gamma-drafter-code") == 3, what="code pool at 3")
    assert kube_api.scale(router, f"{POOL_PATH}/gamma-code", 40).status_code == 200
    wait_for(lambda: replicas(kube, "gamma-drafter-code") == 4, what="clamped to maxReplicas 4")


def test_kubectl_scale_on_the_cluster_reaches_the_verifier(real_operator: Any, kube: Kube, router: ApiRouter) -> None:
    """The CoSineCluster's scale subresource is the verifier's (an HPA or KEDA targets it):
    ``kubectl scale csc`` writes ``spec.verifier.replicas``, the verifier Deployment follows, the
    scale reports the pods' selector, and a later spec edit keeps the scaled value."""
    _create(router, "theta")
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "theta-verifier"), what="verifier Deployment")
    assert kube_api.scale(router, f"{CSC}/theta", 3).status_code == 200
    wait_for(lambda: replicas(kube, "theta-verifier") == 3, what="verifier at 3")
    scale = wait_for(lambda: (r := router.real.http.get(
        f"/apis/cosine.dev/v1alpha1/namespaces/{NS}/cosineclusters/theta/scale").json())["status"].get("selector")
        and r, what="scale with selector")
    assert scale["spec"]["replicas"] == 3
    assert "app.kubernetes.io/component=verifier" in scale["status"]["selector"].split(","), scale
    kube_api.patch(router, f"{CSC}/theta", {"spec": {"speculation": {"maxDraftLen": 5}}})
    generation = kube.get(CLUSTERS, NS, "theta")["metadata"]["generation"]
    wait_for(lambda: kube.get(CLUSTERS, NS, "theta")["status"].get("observedGeneration") == generation,
             what="the edit reconciled")
    time.sleep(RESYNC_S + 1)  # and a resync after it
    assert replicas(kube, "theta-verifier") == 3
    assert kube.get(CLUSTERS, NS, "theta")["spec"]["verifier"]["replicas"] == 3


def _writes(router: ApiRouter) -> int:
    return sum(1 for method, _ in router.requests if method in ("PATCH", "PUT", "POST", "DELETE"))


def test_second_field_manager_does_not_fight_the_operator(real_operator: Any, kube: Kube, router: ApiRouter) -> None:
    _create(router, "delta")
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "delta-drafter-ngram"), what="children")
    apply = {"apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "delta"},
             "spec": {"speculation": {"maxDraftLen": 4}}}
    r = router.real.http.patch(
        f"/apis/cosine.dev/v1alpha1/namespaces/{NS}/cosineclusters/delta", content=json.dumps(apply),
        headers={"Content-Type": "application/apply-patch+yaml"}, params={"fieldManager": "gitops"})
    assert r.status_code == 200, r.text
    generation = r.json()["metadata"]["generation"]
    wait_for(lambda: kube.get(CLUSTERS, NS, "delta")["status"].get("observedGeneration") == generation,
             what="observedGeneration after the second manager's apply")
    objects = [(CLUSTERS, "delta"), (POOLS, "delta-code"), (POOLS, "delta-ngram")]

    def current() -> dict[str, str]:
        return {n: kube.get(r, NS, n)["metadata"]["resourceVersion"] for r, n in objects}

    # The reconcile's own writes land first; on a loaded machine they can take seconds, so wait
    # for a whole resync with nothing moving (a write loop never gets there) rather than a fixed
    # sleep.
    versions, still_since = current(), time.monotonic()

    def settled() -> bool:
        nonlocal versions, still_since
        now = current()
        if now != versions:
            versions, still_since = now, time.monotonic()
        return time.monotonic() - still_since > RESYNC_S + 0.5

    wait_for(settled, timeout_s=30, what="the reconcile's own writes to land")
    start = _writes(router)
    time.sleep(2 * RESYNC_S + 1)
    # Quiet: no write loop between the operator's patches and the other manager's fields. The
    # resync re-applies every RESYNC_S (writes are sent), and the real server finds nothing to
    # change: no resourceVersion moves.
    assert _writes(router) > start  # the resync ran
    assert versions == current()
    obj = kube.get(CLUSTERS, NS, "delta")
    assert obj["spec"]["speculation"]["maxDraftLen"] == 4
    assert obj["metadata"]["generation"] == generation
    assert "gitops" in {m["manager"] for m in obj["metadata"]["managedFields"]}


def test_webhook_over_tls_allows_and_denies(real_operator: Any, webhook_port: int, router: ApiRouter) -> None:
    def review(name: str, pools: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
        request = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": f"uid-{name}", "operation": "CREATE", "namespace": NS, "name": name,
            "kind": {"group": "cosine.dev", "version": "v1alpha1", "kind": "CoSineCluster"},
            "resource": {"group": "cosine.dev", "version": "v1alpha1", "resource": "cosineclusters"},
            "userInfo": {"username": "tester"}, "object": cluster_body(name, drafterPools=pools, **spec)}}

        def post() -> dict[str, Any] | None:
            try:
                return dict(httpx.post(f"https://127.0.0.1:{webhook_port}/validate-cosinecluster", json=request,
                                       verify=ssl.create_default_context(cafile=str(router.real.certs["ca.crt"])),
                                       timeout=5).json())
            except httpx.HTTPError:
                return None

        answer = wait_for(post, what="webhook answer")
        assert answer["response"]["uid"] == f"uid-{name}"
        return dict(answer["response"])

    bad = review("eps", [{"name": "chat", "model": "HuggingFaceTB/SmolLM2-135M-Instruct"}])
    assert bad["allowed"] is False and bad["status"]["code"] == 422
    assert "spec.drafterPools[0].model" in bad["status"]["message"]
    good = review("eps", [{"name": "chat", "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "translateTokenizer": True}])
    assert good["allowed"] is True and "warnings" not in good
    # one GPU verifier that cannot surge: admitted, with the outage every roll costs as a warning
    gpu = {"model": "qwen2.5-coder-1.5b-instruct", "resources": {"limits": {"nvidia.com/gpu": 1}}}
    lone = review("eps", [{"name": "ngram", "kind": "ngram"}], verifier=gpu)
    assert lone["allowed"] is True and [w.split(":")[0] for w in lone["warnings"]] == ["spec.verifier.replicas"]
    surged = review("eps", [{"name": "ngram", "kind": "ngram"}], verifier={**gpu, "rollout": {"maxSurge": 1}})
    assert surged["allowed"] is True and "warnings" not in surged


def test_delete_runs_kopf_finalizer_and_leaves_owned_children(real_operator: Any, kube: Kube,
                                                               router: ApiRouter) -> None:
    created = _create(router, "zeta")
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "zeta-verifier"), what="children")
    finalizers = wait_for(lambda: kube.get(CLUSTERS, NS, "zeta")["metadata"].get("finalizers"), what="finalizer")
    assert all(f.startswith("kopf.zalando.org/") for f in finalizers), finalizers
    kube_api.delete(router, f"{CSC}/zeta")
    # The real server only marks it (deletionTimestamp) until kopf removes its finalizer.
    wait_for(lambda: kube.get(CLUSTERS, NS, "zeta") is None, what="cluster gone")
    # No garbage collector here: the children remain, each pointing at the deleted owner, which
    # is what a real cluster's GC would follow.
    for resource, name in [(DEPLOYMENTS, "zeta-verifier"), (CONFIGMAPS, "zeta-config"), (POOLS, "zeta-code")]:
        obj = kube.get(resource, NS, name)
        assert obj is not None, name
        assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [created["metadata"]["uid"]], name


def test_router_discovery_merges_both_servers(router: ApiRouter) -> None:
    groups = {g["name"] for g in httpx.get(router.url + "/apis").json()["groups"]}
    assert {"apps", "cosine.dev", "apiextensions.k8s.io"} <= groups
    assert Path(router.kubeconfig).exists()


def test_the_scale_handover_keeps_what_an_older_apply_owned(router: ApiRouter) -> None:
    """On Kubernetes' own server (managedFields are its code): an object whose ``spec.replicas``
    the operator's apply owns (what operators before the scale handover did) keeps its replicas
    through ``kube.apply_scale_free``, and afterwards the operator's apply owns them no more.
    The control shows why: the same apply without replicas and without the handover removes the
    field (here the schema requires it, so the server refuses; a Deployment would fall back to 1)."""
    import asyncio
    import os

    from cosine_spec.contract import POOL_KIND
    from kubernetes_asyncio.client.exceptions import ApiException

    from cosine_operator import kube as k

    def pool(name: str, replicas: int) -> dict[str, Any]:
        return {"apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineDrafterPool",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"clusterName": name, "pool": "p", "replicas": replicas, "minReplicas": 0, "maxReplicas": 8}}

    def without_replicas(body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "spec": {k: v for k, v in body["spec"].items() if k != "replicas"}}

    async def run() -> tuple[dict[str, Any], int | None]:
        api = await k.connect()
        try:
            for name in ("handover", "control"):
                await k.apply(api, pool(name, 3))  # an older operator: its apply carries the scale
                assert k.applies(await k.get(api, POOL_KIND, NS, name), ("spec", "replicas"))
            await k.apply_scale_free(api, pool("handover", 1))
            try:
                await k.apply(api, without_replicas(pool("control", 1)))
                control: int | None = (await k.get(api, POOL_KIND, NS, "control"))["spec"].get("replicas")
            except ApiException as e:
                assert e.status == 422 and "replicas" in (e.body or ""), e
                control = None
            return await k.get(api, POOL_KIND, NS, "handover"), control
        finally:
            await api.close()

    saved = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(router.kubeconfig)
    try:
        handed, control = asyncio.run(run())
    finally:
        if saved is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = saved
    assert handed["spec"]["replicas"] == 3  # not the 1 of the apply, not removed
    assert not k.applies(handed, ("spec", "replicas"))
    assert k.applies(handed, ("spec", "replicas"), k.SCALE_HANDOVER_MANAGER)
    assert control != 3  # the field went with the apply that owned it


INFERENCEPOOLS = "inference.networking.k8s.io/v1/inferencepools"
HTTPROUTES = "gateway.networking.k8s.io/v1/httproutes"
LEADERWORKERSETS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
ROUTER_ON = {"enabled": True, "gatewayName": "inference-gateway", "gatewayNamespace": "gateways",
             "weights": {"prefixCache": 4}}


def test_router_children_are_created_valid_owned_and_removed(real_operator: Any, kube: Kube,
                                                               router: ApiRouter) -> None:
    """``spec.router`` on: the InferencePool and HTTPRoute are accepted and defaulted by
    Kubernetes' own server under the schemas of GIE v1.0 and Gateway API v1.3
    (data/external-crds), the endpoint picker's objects exist, everything is owned by the cluster;
    switched off, all of them go."""
    kube_api.apply(router, cluster_body("iota", router=ROUTER_ON), validation="Ignore")
    uid = kube.get(CLUSTERS, NS, "iota")["metadata"]["uid"]
    children = [(INFERENCEPOOLS, "iota-router"), (HTTPROUTES, "iota-router"), (DEPLOYMENTS, "iota-epp"),
                (SERVICES, "iota-epp"), (SERVICEACCOUNTS, "iota-epp"), (ROLES, "iota-epp"),
                (ROLEBINDINGS, "iota-epp"), (CONFIGMAPS, "iota-epp"), (NETWORKPOLICIES, "iota-epp")]
    for resource, name in children:
        obj = wait_for(lambda: kube.get(resource, NS, name), what=f"{resource} {name}")  # noqa: B023
        assert [(r["uid"], r["kind"]) for r in obj["metadata"]["ownerReferences"]] == [(uid, "CoSineCluster")], name
    # the real server stored them, with the defaults of the APIs' schemas filled in
    assert any(path.startswith("/apis/inference.networking.k8s.io/") for _, path in router.requests)
    pool = kube.get(INFERENCEPOOLS, NS, "iota-router")["spec"]
    assert pool["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "iota-epp",
                                         "port": {"number": 9002}, "failureMode": "FailOpen"}
    assert pool["selector"]["matchLabels"]["app.kubernetes.io/component"] == "verifier"
    route = kube.get(HTTPROUTES, NS, "iota-router")["spec"]
    assert route["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                    "name": "inference-gateway", "namespace": "gateways"}]
    assert route["rules"][0]["backendRefs"][0]["weight"] == 1  # defaulted by the server
    config = kube.get(CONFIGMAPS, NS, "iota-epp")["data"]["config.yaml"]
    assert "session-affinity-scorer" not in config and "weight: 4.0" in config  # the spec's weights
    # the endpoint picker may read the verifiers' CoSine metrics
    verifier_policy = wait_for(lambda: kube.get(NETWORKPOLICIES, NS, "iota-verifier"), what="verifier policy")
    peers = [p for rule in verifier_policy["spec"]["ingress"] for p in rule.get("from", [])]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "iota", "cosine.dev/cluster": "iota",
                                            "app.kubernetes.io/component": "router"}}} in peers

    off = json.dumps({"spec": {"router": {"enabled": False}}})
    kube_api.patch(router, f"{CSC}/iota", json.loads(off))
    for resource, name in children:
        wait_for(lambda: kube.get(resource, NS, name) is None, what=f"{resource} {name} deleted")  # noqa: B023
    assert kube.get(DEPLOYMENTS, NS, "iota-verifier") is not None
    _delete(router, "iota")


GCPBACKENDPOLICIES = "networking.gke.io/v1/gcpbackendpolicies"
HEALTHCHECKPOLICIES = "networking.gke.io/v1/healthcheckpolicies"


def test_gke_router_policies_are_made_valid_and_dropped_with_the_provider(real_operator: Any, kube: Kube,
                                                                          router: ApiRouter) -> None:
    """``spec.router.provider: gke``: GKE's GCPBackendPolicy and HealthCheckPolicy on the pool are
    accepted by the real server under GKE's schemas (data/external-crds) and owned by the cluster,
    the picker's NetworkPolicy admits GKE's health checkers to 9003; back to ``none``, the policies
    go and the rest of the router stays."""
    kube_api.apply(router, cluster_body("gkepol", router={**ROUTER_ON, "provider": "gke"}), validation="Ignore")
    uid = kube.get(CLUSTERS, NS, "gkepol")["metadata"]["uid"]
    for resource in (GCPBACKENDPOLICIES, HEALTHCHECKPOLICIES):
        obj = wait_for(lambda: kube.get(resource, NS, "gkepol-router"), what=resource)  # noqa: B023
        assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid]
    assert kube.get(GCPBACKENDPOLICIES, NS, "gkepol-router")["spec"]["default"]["timeoutSec"] == 300
    policy = wait_for(lambda: kube.get(NETWORKPOLICIES, NS, "gkepol-epp"), what="picker policy")
    health = [rule for rule in policy["spec"]["ingress"] if rule["ports"] == [{"protocol": "TCP", "port": 9003}]]
    assert health and {p["ipBlock"]["cidr"] for p in health[0]["from"]} == {"35.191.0.0/16", "130.211.0.0/22"}

    none = json.dumps({"spec": {"router": {"provider": "none"}}})
    kube_api.patch(router, f"{CSC}/gkepol", json.loads(none))
    for resource in (GCPBACKENDPOLICIES, HEALTHCHECKPOLICIES):
        wait_for(lambda: kube.get(resource, NS, "gkepol-router") is None, what=f"{resource} deleted")  # noqa: B023
    assert kube.get(INFERENCEPOOLS, NS, "gkepol-router") is not None
    _delete(router, "gkepol")


def _delete(router: ApiRouter, name: str) -> None:
    """Delete a cluster once its test is done (not waited for: kopf stops its daemons first), so the
    operator's shutdown at the module's end has fewer clusters' resyncs and daemons to stop within
    the runner's timeout."""
    kube_api.delete(router, f"{CSC}/{name}")


def test_a_verifier_on_two_nodes_is_a_leader_worker_set(real_operator: Any, kube: Kube, router: ApiRouter,
                                                         webhook_port: int) -> None:
    """``parallelism.nodes: 2`` on GPU pods: a LeaderWorkerSet (accepted by the real server under
    LWS v0.7's schema) replaces the verifier Deployment, its groups of two pods running vLLM's
    multi-node mode; back to one node, the Deployment returns and the set goes."""
    gpu = {"model": "qwen2.5-coder-1.5b-instruct", "resources": {"limits": {"nvidia.com/gpu": 4}},
           "parallelism": {"nodes": 2, "tensor": 4, "pipeline": 2}}
    kube_api.apply(router, cluster_body("kappa", verifier=gpu), validation="Ignore")
    lws = wait_for(lambda: kube.get(LEADERWORKERSETS, NS, "kappa-verifier"), what="LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["replicas"] == 1 and lws["spec"]["startupPolicy"] == "LeaderCreated"
    assert group["workerTemplate"]["spec"]["containers"][0]["args"][0] == "verifier-worker"
    assert kube.get(DEPLOYMENTS, NS, "kappa-verifier") is None
    pdb = wait_for(lambda: kube.get(PDBS, NS, "kappa-verifier"), what="PDB")
    assert pdb["spec"]["selector"]["matchExpressions"][0]["values"] == ["verifier", "verifier-worker"]
    # the drafters admit the leader (its labels are the verifier's), not the workers
    drafter_policy = kube.get(NETWORKPOLICIES, NS, "kappa-drafter-code")
    assert group["leaderTemplate"]["metadata"]["labels"]["app.kubernetes.io/component"] == "verifier"
    assert drafter_policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "verifier"
    # kubectl scale on the cluster scales groups
    assert kube_api.scale(router, f"{CSC}/kappa", 2).status_code == 200
    wait_for(lambda: kube.get(LEADERWORKERSETS, NS, "kappa-verifier")["spec"]["replicas"] == 2, what="2 groups")
    # the webhook refuses a shape vLLM cannot run, naming the field
    bad = {**gpu, "parallelism": {"nodes": 2, "tensor": 4}}
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "uid-kappa", "operation": "UPDATE", "namespace": NS, "name": "kappa",
        "kind": {"group": "cosine.dev", "version": "v1alpha1", "kind": "CoSineCluster"},
        "resource": {"group": "cosine.dev", "version": "v1alpha1", "resource": "cosineclusters"},
        "userInfo": {"username": "tester"}, "object": cluster_body("kappa", verifier=bad)}}
    answer = httpx.post(f"https://127.0.0.1:{webhook_port}/validate-cosinecluster", json=review, timeout=5,
                        verify=ssl.create_default_context(cafile=str(router.real.certs["ca.crt"]))).json()["response"]
    assert answer["allowed"] is False and answer["status"]["code"] == 422
    assert answer["status"]["message"].startswith("spec.verifier.parallelism: tensor (4) x pipeline (1) = 4 ranks")
    # a new group size is a new set (LWS refuses to resize one in place), its scale kept from the spec
    uid = kube.get(LEADERWORKERSETS, NS, "kappa-verifier")["metadata"]["uid"]
    kube_api.patch(router, f"{CSC}/kappa",
                   {"spec": {"verifier": {"parallelism": {"nodes": 4, "tensor": 4, "pipeline": 4}}}})
    resized = wait_for(lambda: (x := kube.get(LEADERWORKERSETS, NS, "kappa-verifier")) and x["metadata"]["uid"] != uid
                       and x, what="LeaderWorkerSet recreated")
    assert resized["spec"]["leaderWorkerTemplate"]["size"] == 4 and resized["spec"]["replicas"] == 2
    # one node again: a Deployment, and the set is deleted
    kube_api.patch(router, f"{CSC}/kappa",
                   {"spec": {"verifier": {"parallelism": {"nodes": 1, "tensor": 4, "pipeline": 1}}}})
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "kappa-verifier"), what="verifier Deployment back")
    wait_for(lambda: kube.get(LEADERWORKERSETS, NS, "kappa-verifier") is None, what="LeaderWorkerSet deleted")
    _delete(router, "kappa")
