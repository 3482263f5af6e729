"""The real operator (``kopf run`` via KopfRunner) against the API emulator.

Scenarios: create, status follows Deployment readiness, scale a pool, change the model, remove a
pool, a pool's scale written through its ``/scale`` survives reconciles, autoscaler up and down
from fake ``/metrics``, delete with garbage collection. The admission webhook (over TLS) and
``kubectl scale`` are tested on the real API server (test_operator_real.py).
The tests play the Deployment controller (they patch ``status.readyReplicas``).
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import RESYNC_S, RUNTIME_REPOSITORY
from cosine_spec.pods import RUNTIME_TAG
from fake_metrics import Counters, serve
from k8s_emulator import (
    CLUSTERS,
    CONFIGMAPS,
    DEPLOYMENTS,
    EVENTS,
    JOBS,
    NETWORKPOLICIES,
    PDBS,
    PODS,
    POOLS,
    PVCS,
    SERVICES,
    EmulatorThread,
    Kube,
    wait_for,
)

from cosine_operator import capacity_placement

NS = "default"


@pytest.fixture(autouse=True)
def _delete_clusters_after(kube: Kube) -> Iterator[None]:
    """Each test's clusters are deleted when it ends (not waited for): the module's operator
    re-applies every live cluster's children each resync, and clusters left behind by earlier
    tests kept it busy enough, on a loaded 2-core machine, that a deletion's finalizer waited
    past its test's timeout. One listed may be gone by its delete (an earlier test's deletion,
    its finalizer removed meanwhile: CI saw a 404 here)."""
    yield
    for body in kube.list(CLUSTERS, NS):
        kube.delete(CLUSTERS, NS, body["metadata"]["name"], missing_ok=True)


def cluster_body(name: str, **spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "verifier": {"model": "qwen2.5-coder-1.5b-instruct"},
        "drafterPools": [
            {"name": "code", "model": "qwen2.5-coder-0.5b-instruct", "expertise": ["code"]},
            {"name": "ngram", "kind": "ngram", "minReplicas": 0},
        ],
        "autoscaling": {"enabled": False},
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": "cosine.dev/v1alpha1",
        "kind": "CoSineCluster",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


def replicas(kube: Kube, name: str) -> int:
    return int(kube.get(DEPLOYMENTS, NS, name)["spec"]["replicas"])


def mark_ready(kube: Kube, name: str) -> None:
    """Play the Deployment controller: every desired replica is ready."""
    want = replicas(kube, name)
    kube.patch(DEPLOYMENTS, NS, name, {"status": {"replicas": want, "readyReplicas": want}}, sub="status")


def replica_writes(emulator: EmulatorThread, resource: str, name: str, start: int = 0) -> list[int]:
    """``spec.replicas`` of every PATCH of ``resource``/``name`` (not via a subresource) since ``start``."""
    assert emulator.emulator is not None
    return [
        body["spec"]["replicas"]
        for res, n, sub, body in emulator.emulator.patches[start:]
        if res == resource and n == name and sub is None and "replicas" in ((body or {}).get("spec") or {})
    ]


def operator_applies_replicas(obj: dict[str, Any]) -> bool:
    """Whether the operator's server-side apply owns ``spec.replicas`` (``managedFields``)."""
    from cosine_operator import kube as k

    return k.applies(obj, ("spec", "replicas"))


def condition(kube: Kube, cluster: str, type_: str) -> dict[str, Any] | None:
    conds = (kube.get(CLUSTERS, NS, cluster) or {}).get("status", {}).get("conditions") or []
    return next((c for c in conds if c["type"] == type_), None)


def test_create_children_owner_references_and_status(operator: Any, kube: Kube) -> None:
    created = kube.create(CLUSTERS, NS, cluster_body("alpha"))
    uid = created["metadata"]["uid"]
    verifier = wait_for(lambda: kube.get(DEPLOYMENTS, NS, "alpha-verifier"), what="verifier Deployment")
    children = [
        (CONFIGMAPS, "alpha-config"),
        (SERVICES, "alpha-verifier"),
        (SERVICES, "alpha-gateway"),
        (DEPLOYMENTS, "alpha-drafter-code"),
        (SERVICES, "alpha-drafter-code"),
        (DEPLOYMENTS, "alpha-drafter-ngram"),
        (SERVICES, "alpha-drafter-ngram"),
        (POOLS, "alpha-code"),
        (POOLS, "alpha-ngram"),
        (NETWORKPOLICIES, "alpha-verifier"),
        (NETWORKPOLICIES, "alpha-drafter-code"),
        (NETWORKPOLICIES, "alpha-drafter-ngram"),
    ]
    for resource, name in children:
        obj = kube.get(resource, NS, name)
        assert obj is not None, name
        assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid], name
    args = verifier["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "code=dns:///alpha-drafter-code.default.svc:50052" in args
    # spec.image unset: the operator's default repository (the chart's runtimeImage), the release's tag
    for name in ("alpha-verifier", "alpha-drafter-code"):
        image = kube.get(DEPLOYMENTS, NS, name)["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == f"{RUNTIME_REPOSITORY}:{RUNTIME_TAG}", name
    # the operator's own pods (namespace and labels from its environment) may scrape the metrics ports
    operator_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "cosine-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "cosine-operator"}},
    }
    metrics_rule = kube.get(NETWORKPOLICIES, NS, "alpha-verifier")["spec"]["ingress"][1]
    assert metrics_rule["from"] == [{"podSelector": {}}, operator_peer]
    pending = wait_for(lambda: condition(kube, "alpha", "Ready"), what="Ready condition")
    assert pending["status"] == "False"

    for name in ("alpha-verifier", "alpha-drafter-code", "alpha-drafter-ngram"):
        mark_ready(kube, name)
    wait_for(lambda: (condition(kube, "alpha", "Ready") or {}).get("status") == "True", what="Ready=True")
    status = kube.get(CLUSTERS, NS, "alpha")["status"]
    assert status["verifier"]["ready"] == "1/1"
    assert status["drafters"]["ready"] == "2/2"
    assert status["gatewayUrl"] == "http://alpha-gateway.default.svc:8000"
    assert status["observedGeneration"] == 1


def test_an_engine_arg_cosine_sets_is_refused_where_no_webhook_runs(operator: Any, kube: Kube, caplog: Any) -> None:
    """A plain-manifest install has no admission webhook: the reconcile runs its engine-argument
    check, fails permanently naming the entry, and creates nothing. Catches: `--max_model_len=4096`
    (vLLM reads it as `--max-model-len`, last value wins) reaching the verifier's argv unchecked."""
    verifier = {"model": "qwen2.5-coder-1.5b-instruct", "engineArgs": ["--max_model_len=4096"]}
    kube.create(CLUSTERS, NS, cluster_body("eta", verifier=verifier))
    failed = wait_for(lambda: [r.getMessage() for r in caplog.records if "failed permanently" in r.getMessage()],
                      what="the reconcile's permanent failure")
    assert "spec.verifier.engineArgs[0]: --max-model-len is set by CoSine" in failed[0], failed
    assert "spec.verifier.maxModelLen" in failed[0]
    assert kube.get(DEPLOYMENTS, NS, "eta-verifier") is None and kube.get(CONFIGMAPS, NS, "eta-config") is None


def test_scale_pool_change_model_and_remove_pool(operator: Any, kube: Kube) -> None:
    kube.create(CLUSTERS, NS, cluster_body("beta"))
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "beta-drafter-ngram"), what="drafter Deployments")
    old_hash = kube.get(DEPLOYMENTS, NS, "beta-drafter-code")["spec"]["template"]["metadata"]["annotations"]

    # Scale by hand: the Deployment and the scale target follow, pods are not restarted.
    spec = copy.deepcopy(kube.get(CLUSTERS, NS, "beta")["spec"])
    spec["drafterPools"][0]["replicas"] = 3
    kube.patch(CLUSTERS, NS, "beta", {"spec": {"drafterPools": spec["drafterPools"]}})
    wait_for(lambda: replicas(kube, "beta-drafter-code") == 3, what="code pool at 3")
    wait_for(lambda: kube.get(POOLS, NS, "beta-code")["spec"]["replicas"] == 3, what="scale target at 3")
    new_annotations = kube.get(DEPLOYMENTS, NS, "beta-drafter-code")["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert new_annotations == old_hash

    # Change the verifier's model: a new pod template (config hash) and the new ConfigMap.
    kube.patch(CLUSTERS, NS, "beta", {"spec": {"verifier": {"model": "qwen2.5-coder-3b-instruct"}}})
    wait_for(
        lambda: (
            "qwen2.5-coder-3b-instruct" in kube.get(CONFIGMAPS, NS, "beta-config")["data"]["cluster.yaml"]
        ),
        what="ConfigMap with the new model",
    )
    wait_for(
        lambda: (
            kube.get(DEPLOYMENTS, NS, "beta-drafter-code")["spec"]["template"]["metadata"]["annotations"]
            != old_hash
        ),
        what="new pod template",
    )
    assert replicas(kube, "beta-drafter-code") == 3  # the rollout kept the scale

    # Remove the ngram pool: its Deployment, Service, scale target and NetworkPolicy go.
    spec = copy.deepcopy(kube.get(CLUSTERS, NS, "beta")["spec"])
    kube.patch(CLUSTERS, NS, "beta", {"spec": {"drafterPools": spec["drafterPools"][:1]}})
    for resource, name in [
        (DEPLOYMENTS, "beta-drafter-ngram"),
        (SERVICES, "beta-drafter-ngram"),
        (POOLS, "beta-ngram"),
        (NETWORKPOLICIES, "beta-drafter-ngram"),
    ]:
        wait_for(lambda: kube.get(resource, NS, name) is None, what=f"{name} deleted")  # noqa: B023
    args = kube.get(DEPLOYMENTS, NS, "beta-verifier")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any("ngram=" in a for a in args)


def test_a_field_removed_from_the_spec_leaves_the_child(operator: Any, kube: Kube) -> None:
    """Catches: children merge-patched (a removed nodeSelector, toleration, affinity or env var stays
    on the Deployment); the pool's scale lost when the operator re-applies its Deployment."""
    gpu = {"limits": {"nvidia.com/gpu": 1}}
    scheduling = {
        "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "env": [{"name": "EXTRA", "value": "1"}],
    }
    body = cluster_body("sigma")
    body["spec"]["verifier"].update(copy.deepcopy(scheduling), resources=gpu)
    body["spec"]["drafterPools"][0].update(copy.deepcopy(scheduling))
    kube.create(CLUSTERS, NS, body)
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "sigma-verifier"), what="verifier Deployment")
    kube.patch(POOLS, NS, "sigma-code", {"spec": {"replicas": 3}})  # the autoscaler's write
    wait_for(lambda: replicas(kube, "sigma-drafter-code") == 3, what="code pool at 3")

    def template(name: str) -> dict[str, Any]:
        return kube.get(DEPLOYMENTS, NS, name)["spec"]["template"]["spec"]

    assert template("sigma-drafter-code")["nodeSelector"] and template("sigma-verifier")["affinity"]
    spec = copy.deepcopy(kube.get(CLUSTERS, NS, "sigma")["spec"])
    for role in (spec["verifier"], spec["drafterPools"][0]):
        for key in scheduling:
            role.pop(key)
    kube.patch(CLUSTERS, NS, "sigma", {"spec": {"verifier": None, "drafterPools": None}})
    kube.patch(CLUSTERS, NS, "sigma", {"spec": {"verifier": spec["verifier"], "drafterPools": spec["drafterPools"]}})
    wait_for(lambda: "nodeSelector" not in template("sigma-drafter-code"), what="pool's nodeSelector removed")
    # the verifier keeps the operator's own rule (off spot nodes), the spec's zone term goes
    off_spot = capacity_placement.off_spot({}, None)  # no spec.spot, no router provider: every provider's
    wait_for(lambda: template("sigma-verifier").get("affinity") == off_spot, what="verifier's affinity removed")
    for name in ("sigma-verifier", "sigma-drafter-code"):
        pod = template(name)
        assert "nodeSelector" not in pod and pod.get("affinity", off_spot) == off_spot, name
        assert not any(t.get("key") == "dedicated" for t in pod.get("tolerations") or ()), name
        assert not any(e["name"] == "EXTRA" for e in pod["containers"][0]["env"]), name
    assert "affinity" not in template("sigma-drafter-code")
    # the GPU toleration the operator adds stays while the verifier requests a GPU
    assert any(t["key"] == "nvidia.com/gpu" for t in template("sigma-verifier")["tolerations"])
    assert replicas(kube, "sigma-drafter-code") == 3  # the pool's scale survived the re-apply
    assert kube.get(PDBS, NS, "sigma-verifier")["spec"]["maxUnavailable"] == 1


def test_pods_wait_for_the_model_cache_job(operator: Any, kube: Kube) -> None:
    """Catches: pods started before the cache holds their models, a failed pull not reported, a
    changed model list not pulled again."""
    kube.create(CLUSTERS, NS, cluster_body("tau", modelCache={"size": "50Gi"},
                                           hfTokenSecretRef={"name": "hf", "key": "token"}))
    jobs = wait_for(lambda: kube.list(JOBS, NS) or None, what="model pull Job")
    (job,) = [j for j in jobs if j["metadata"]["name"].startswith("tau-models-")]
    assert kube.get(PVCS, NS, "tau-models")["spec"]["resources"]["requests"]["storage"] == "50Gi"
    pulling = wait_for(lambda: condition(kube, "tau", "ModelsReady"), what="ModelsReady condition")
    assert (pulling["status"], pulling["reason"]) == ("False", "Pulling")
    time.sleep(1.0)
    assert kube.get(DEPLOYMENTS, NS, "tau-verifier") is None and kube.get(POOLS, NS, "tau-code") is None
    assert kube.get(CONFIGMAPS, NS, "tau-config") is not None  # everything else is there
    # the Job fails: reported with where to look, still no pods
    name = job["metadata"]["name"]
    kube.patch(JOBS, NS, name, {"status": {"failed": 4, "conditions": [{"type": "Failed", "status": "True"}]}},
               sub="status")
    failed = wait_for(lambda: (c := condition(kube, "tau", "ModelsReady")) and c["reason"] == "PullFailed" and c,
                      what="PullFailed", timeout_s=30)  # reconcile looks again every 10 s
    assert f"kubectl logs job/{name}" in failed["message"]
    # it succeeds: the pods come, mounting the claim read-only
    kube.patch(JOBS, NS, name, {"status": {"failed": 0, "succeeded": 1, "conditions": []}}, sub="status")
    verifier = wait_for(lambda: kube.get(DEPLOYMENTS, NS, "tau-verifier"), what="verifier after the pull",
                        timeout_s=30)
    pod = verifier["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "tau-models", "readOnly": True}} in pod["volumes"]
    wait_for(lambda: kube.get(POOLS, NS, "tau-code"), what="pool scale target")
    wait_for(lambda: condition(kube, "tau", "ModelsReady")["status"] == "True", what="ModelsReady")
    # a new model: a new Job, the old one deleted
    kube.patch(CLUSTERS, NS, "tau", {"spec": {"verifier": {"model": "qwen2.5-coder-3b-instruct"}}})
    wait_for(lambda: kube.get(JOBS, NS, name) is None, what="old Job deleted")
    assert any(j["metadata"]["name"] != name for j in kube.list(JOBS, NS))


def test_drift_is_repaired_and_what_others_own_stays(operator: Any, kube: Kube) -> None:
    """Catches: children repaired only on spec edits or restarts (a deleted Deployment, Service,
    NetworkPolicy or PDB stays gone), a hand edit of an operator-owned field kept, and the resync
    reverting the verifier's replicas set by whoever scales it (an HPA on the Deployment), or a
    ``spec.verifier.replicas`` change not reaching the Deployment."""
    kube.create(CLUSTERS, NS, cluster_body("drift"))
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "drift-verifier"), what="verifier Deployment")
    gone = [(DEPLOYMENTS, "drift-drafter-code"), (SERVICES, "drift-gateway"), (NETWORKPOLICIES, "drift-verifier"),
            (PDBS, "drift-verifier"), (CONFIGMAPS, "drift-config")]
    for resource, name in gone:
        kube.delete(resource, NS, name)
    kube.patch(SERVICES, NS, "drift-verifier", {"spec": {"ports": [{"name": "http", "port": 9999}]}})
    kube.patch(DEPLOYMENTS, NS, "drift-verifier", {"spec": {"replicas": 4}}, sub="scale")  # an HPA's write
    for resource, name in gone:
        wait_for(lambda: kube.get(resource, NS, name), timeout_s=3 * RESYNC_S + 5,  # noqa: B023
                 what=f"{name} back")
    wait_for(lambda: kube.get(SERVICES, NS, "drift-verifier")["spec"]["ports"][0]["port"] == 8000,
             timeout_s=3 * RESYNC_S + 5, what="hand edit undone")
    time.sleep(2 * RESYNC_S)
    assert replicas(kube, "drift-verifier") == 4  # not the spec's 1: not the operator's to set
    # reconcile never reads-then-writes the scale: its applies own no replicas (an HPA write landing
    # between a read and an apply could not be reverted, as there is no such read or apply)
    for deployment in ("drift-verifier", "drift-drafter-code"):
        assert not operator_applies_replicas(kube.get(DEPLOYMENTS, NS, deployment)), deployment
    # a spec edit elsewhere keeps it too; a changed spec.verifier.replicas (kubectl scale csc) is applied
    kube.patch(CLUSTERS, NS, "drift", {"spec": {"speculation": {"maxDraftLen": 4}}})
    wait_for(lambda: kube.get(CLUSTERS, NS, "drift")["status"].get("observedGeneration") == 2, what="reconciled")
    assert replicas(kube, "drift-verifier") == 4
    kube.patch(CLUSTERS, NS, "drift", {"spec": {"verifier": {"replicas": 2}}})
    wait_for(lambda: replicas(kube, "drift-verifier") == 2, what="spec.verifier.replicas applied")
    time.sleep(2 * RESYNC_S)
    assert replicas(kube, "drift-verifier") == 2
    assert kube.get(CLUSTERS, NS, "drift")["status"]["verifier"]["selector"] == ",".join(
        f"{k}={v}" for k, v in kube.get(DEPLOYMENTS, NS, "drift-verifier")["spec"]["selector"]["matchLabels"].items())


def test_image_change_is_a_new_pull_job_and_a_claim_change_a_condition(operator: Any, kube: Kube) -> None:
    """A real API server refuses a changed Job template (422) and any change of a claim's spec but
    a larger storage request (the emulator too: test_k8s_emulator.py). Catches: an image change
    or an operator upgrade re-applying the pull Job under its old name (reconcile wedged on the
    422), and a claim change failing the whole reconcile instead of surfacing as a condition."""
    kube.create(CLUSTERS, NS, cluster_body("upg", modelCache={"size": "50Gi"}))
    (job,) = wait_for(lambda: [j for j in kube.list(JOBS, NS) if j["metadata"]["name"].startswith("upg-models-")],
                      what="pull Job")
    kube.patch(JOBS, NS, job["metadata"]["name"], {"status": {"succeeded": 1}}, sub="status")
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "upg-verifier"), what="verifier after the pull", timeout_s=30)
    kube.patch(CLUSTERS, NS, "upg", {"spec": {"image": {"tag": "0.3.0"}}})
    wait_for(lambda: kube.get(JOBS, NS, job["metadata"]["name"]) is None, what="old Job replaced")
    (new,) = [j for j in kube.list(JOBS, NS) if j["metadata"]["name"].startswith("upg-models-")]
    assert new["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.3.0")
    kube.patch(JOBS, NS, new["metadata"]["name"], {"status": {"succeeded": 1}}, sub="status")

    def image() -> str:
        return str(kube.get(DEPLOYMENTS, NS, "upg-verifier")["spec"]["template"]["spec"]["containers"][0]["image"])

    wait_for(lambda: image().endswith(":0.3.0"), what="verifier on the new image", timeout_s=30)
    assert (condition(kube, "upg", "ModelCacheReady") or {}).get("status") == "True"
    # a claim change the server refuses: a condition naming the field; the rest reconciles
    kube.patch(CLUSTERS, NS, "upg", {"spec": {"modelCache": {"storageClassName": "premium"},
                                             "speculation": {"maxDraftLen": 3}}})
    refused = wait_for(lambda: (c := condition(kube, "upg", "ModelCacheReady")) and c["status"] == "False" and c,
                       what="ModelCacheReady=False", timeout_s=15)
    assert refused["reason"] == "ClaimImmutable" and "spec.modelCache" in refused["message"]
    assert "immutable" in refused["message"]
    wait_for(lambda: "maxDraftLen: 3" in kube.get(CONFIGMAPS, NS, "upg-config")["data"]["cluster.yaml"],
             what="the rest of the cluster reconciled")
    assert kube.get(PVCS, NS, "upg-models")["spec"].get("storageClassName") is None
    # growing the cache is allowed
    kube.patch(CLUSTERS, NS, "upg", {"spec": {"modelCache": {"storageClassName": None, "size": "80Gi"}}})
    wait_for(lambda: condition(kube, "upg", "ModelCacheReady")["status"] == "True", what="claim applied")
    assert kube.get(PVCS, NS, "upg-models")["spec"]["resources"]["requests"]["storage"] == "80Gi"


def test_network_policies_follow_spec_network_policy(operator: Any, kube: Kube) -> None:
    """Catches: policies left behind after ``enabled: false``, or not recreated when re-enabled;
    a changed ``metricsFrom`` not applied to existing policies."""
    names = ["gamma-verifier", "gamma-drafter-code", "gamma-drafter-ngram"]
    kube.create(CLUSTERS, NS, cluster_body("gamma"))
    wait_for(lambda: all(kube.get(NETWORKPOLICIES, NS, n) for n in names), what="NetworkPolicies")
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    kube.patch(CLUSTERS, NS, "gamma", {"spec": {"networkPolicy": {"metricsFrom": [monitoring]}}})
    wait_for(
        lambda: kube.get(NETWORKPOLICIES, NS, "gamma-drafter-code")["spec"]["ingress"][1]["from"][0] == monitoring,
        what="metricsFrom applied",
    )
    kube.patch(CLUSTERS, NS, "gamma", {"spec": {"networkPolicy": {"enabled": False}}})
    for n in names:
        wait_for(lambda: kube.get(NETWORKPOLICIES, NS, n) is None, what=f"{n} deleted")  # noqa: B023
    assert kube.get(DEPLOYMENTS, NS, "gamma-drafter-code") is not None  # nothing else goes
    kube.patch(CLUSTERS, NS, "gamma", {"spec": {"networkPolicy": {"enabled": True}}})
    wait_for(lambda: all(kube.get(NETWORKPOLICIES, NS, n) for n in names), what="NetworkPolicies back")


def test_pool_scale_survives_reconcile_and_status_is_observed(operator: Any, kube: Kube,
                                                              emulator: EmulatorThread) -> None:
    """HPA/KEDA/``kubectl scale`` write the pool's ``/scale``: the Deployment follows, and a later
    reconcile (a model change) neither undoes it nor sends any ``replicas`` of its own.

    Catches: reconcile re-applying the cluster spec's replicas (values back to 1), and reconcile
    carrying the pool's replicas in its patches (the lost update against a concurrent ``/scale``
    write); the pool's status showing desired instead of observed replicas, or no selector
    before the Deployment has pods."""
    kube.create(CLUSTERS, NS, cluster_body("eta"))
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "eta-drafter-code"), what="drafter Deployment")
    pool_status = wait_for(lambda: kube.get(POOLS, NS, "eta-code")["status"], what="pool status")
    assert pool_status["selector"] == ",".join(
        f"{k}={v}"
        for k, v in kube.get(DEPLOYMENTS, NS, "eta-drafter-code")["spec"]["selector"]["matchLabels"].items()
    )
    assert pool_status["replicas"] == 0  # no pods yet (the Deployment asks for 1)

    kube.patch(POOLS, NS, "eta-code", {"spec": {"replicas": 3}}, sub="scale")
    wait_for(lambda: replicas(kube, "eta-drafter-code") == 3, what="Deployment follows /scale")
    mark_ready(kube, "eta-drafter-code")
    wait_for(lambda: kube.get(POOLS, NS, "eta-code")["status"]["replicas"] == 3, what="observed 3")

    start = len(emulator.emulator.patches)  # type: ignore[union-attr]
    kube.patch(CLUSTERS, NS, "eta", {"spec": {"verifier": {"model": "qwen2.5-coder-3b-instruct"}}})
    wait_for(lambda: kube.get(CLUSTERS, NS, "eta")["status"].get("observedGeneration") == 2, what="reconciled")
    assert kube.get(POOLS, NS, "eta-code")["spec"]["replicas"] == 3
    assert replicas(kube, "eta-drafter-code") == 3
    assert replica_writes(emulator, DEPLOYMENTS, "eta-drafter-code", start) == []
    assert replica_writes(emulator, POOLS, "eta-code", start) == []


def _fake_pod(
    kube: Kube, cluster: str, name: str, component: str, port: int, pool: str | None = None
) -> None:
    labels = {"cosine.dev/cluster": cluster, "app.kubernetes.io/component": component}
    if pool:
        labels["cosine.dev/pool"] = pool
    kube.create(
        PODS,
        NS,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": labels,
                "annotations": {"prometheus.io/port": str(port), "prometheus.io/path": "/metrics"},
            },
            "status": {"phase": "Running", "podIP": "127.0.0.1"},
        },
    )


def test_autoscaler_scales_a_pool_up_when_saturated_and_down_when_idle(
    operator: Any, kube: Kube, emulator: EmulatorThread
) -> None:
    """Catches: no scale-up or scale-down; a scale-down faster than ``maxScaleDownStep`` (1) per
    decision or below ``minReplicas``; the autoscaler writing the Deployment itself besides the
    pool (two writers: more Deployment replica writes than pool replica writes)."""
    # Pool "code" is asked 20 times/s and late on 40 steps/s: demand 60/s. Busy 0.4 serving 20/s,
    # it would be busy 1.2 serving all: 2 replicas at the target 0.7 (at most 2x per decision).
    verifier = Counters(
        **{
            "cosine_verifier_busy_seconds_total": 1.0,
            "cosine_verifier_steps_total": 10.0,
            "cosine_drafter_calls_total|code": 20.0,
            "cosine_spec_decode_drafts_late_total|code": 40.0,
            "cosine_spec_decode_num_draft_tokens_total|code": 100.0,
            "cosine_spec_decode_num_accepted_tokens_total|code": 80.0,
            "cosine_verifier_tokens_verified_total": 100.0,
        }
    )
    verifier.gauges["cosine_num_requests_running"] = 6
    verifier.gauges["cosine_drafter_rtt_seconds|code"] = 0.03
    drafter = Counters(
        **{"cosine_drafter_draft_tokens_total": 100.0, "cosine_drafter_busy_seconds_total": 0.4,
           "cosine_drafter_rounds_total": 20.0, "cosine_drafter_batched_requests_total": 60.0}
    )
    body = cluster_body(
        "delta",
        autoscaling={
            "enabled": True,
            "intervalSeconds": 1,
            "stabilizationSeconds": 0,
            "targetDrafterUtilization": 0.7,
            "acceptedTokenValuePerMillionUsd": 0,
            "maxScaleDownStep": 1,
        },
    )
    body["spec"]["drafterPools"] = [
        {
            "name": "code",
            "model": "qwen2.5-coder-0.5b-instruct",
            "replicas": 1,
            "minReplicas": 1,
            "maxReplicas": 4,
        }
    ]
    with serve(verifier) as v_port, serve(drafter) as d_port:
        _fake_pod(kube, "delta", "delta-verifier-abc-1", "verifier", v_port)
        _fake_pod(kube, "delta", "delta-drafter-code-abc-1", "drafter", d_port, pool="code")
        kube.create(CLUSTERS, NS, body)
        wait_for(lambda: kube.get(DEPLOYMENTS, NS, "delta-drafter-code"), what="drafter Deployment")
        mark_ready(kube, "delta-drafter-code")
        wait_for(lambda: replicas(kube, "delta-drafter-code") >= 2, timeout_s=15, what="scale up")
        assert kube.get(POOLS, NS, "delta-code")["spec"]["replicas"] >= 2
        status = wait_for(
            lambda: kube.get(CLUSTERS, NS, "delta")["status"].get("lastScaleDecision"),
            what="decision in status",
        )
        demand, served, busy = map(float, re.search(r"demand ([\d.]+)/s, served ([\d.]+)/s at busy fraction ([\d.]+)",
                                                    status).groups())
        assert (55 < demand < 65, 18 < served < 22, 0.35 < busy < 0.45) == (True, True, True), status
        assert "growing" in status
        active = condition(kube, "delta", "ScalingActive")
        assert active is not None and active["status"] == "True"
        assert abs(kube.get(CLUSTERS, NS, "delta")["status"]["acceptanceRate"] - 0.8) < 0.05
        events = wait_for(
            lambda: [e for e in kube.list(EVENTS, NS) if e.get("reason") == "ScaledUp"], what="ScaledUp event"
        )
        assert "drafter pool code: 1 → " in events[0]["message"]

        # The verifier stays busy but the requests stop wanting the pool's drafts (they do not pay
        # there): it shrinks one step at a time.
        verifier.set_rates(**{"cosine_drafter_calls_total|code": 1.0, "cosine_spec_decode_drafts_late_total|code": 0.0})
        drafter.set_rates(**{"cosine_drafter_busy_seconds_total": 0.02, "cosine_drafter_rounds_total": 1.0,
                             "cosine_drafter_batched_requests_total": 1.0})
        seen = [replicas(kube, "delta-drafter-code")]
        deadline = time.monotonic() + 30
        while seen[-1] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
            now = replicas(kube, "delta-drafter-code")
            if now != seen[-1]:
                seen.append(now)
        peak = max(seen)
        assert peak >= 2 and seen[seen.index(peak):] == list(range(peak, 0, -1)), seen  # one step at a time
        time.sleep(2.5)  # two more decisions: held at minReplicas
        assert replicas(kube, "delta-drafter-code") == 1
        assert kube.get(POOLS, NS, "delta-code")["spec"]["replicas"] == 1
        assert any(e.get("reason") == "ScaledDown" for e in kube.list(EVENTS, NS))
        # One writer chain: the autoscaler writes the pool, only the pool handler the Deployment.
        to_deployment = replica_writes(emulator, DEPLOYMENTS, "delta-drafter-code")
        to_pool = replica_writes(emulator, POOLS, "delta-code")
        # (the pool handler also sets the Deployment once when the pool is created)
        assert len(to_pool) >= 2 * (peak - 1), to_pool
        assert to_deployment in (to_pool, [1, *to_pool]), (to_pool, to_deployment)


def test_delete_cluster_removes_children(operator: Any, kube: Kube) -> None:
    kube.create(CLUSTERS, NS, cluster_body("zeta"))
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "zeta-verifier"), what="children")
    # deleted once the create handler is done: a deletion landing while it still runs is seen by
    # kopf only through a later watch event, which the emulator did not always send on a loaded
    # machine (its finalizer then stayed); a real API server sends one for kopf's own patch
    wait_for(lambda: (kube.get(CLUSTERS, NS, "zeta").get("status") or {}).get("observedGeneration") == 1,
             what="reconciled")
    # The only finalizer is kopf's own (it stops the autoscaler daemon first); the operator adds none.
    finalizers = kube.get(CLUSTERS, NS, "zeta")["metadata"].get("finalizers") or []
    assert all(f.startswith("kopf.zalando.org/") for f in finalizers), finalizers
    kube.delete(CLUSTERS, NS, "zeta")
    # kopf removes its finalizer once the cluster's daemon and timer have stopped (a resync pass
    # in flight finishes first, and kopf looks again a second later): seconds on a loaded machine
    wait_for(lambda: kube.get(CLUSTERS, NS, "zeta") is None, timeout_s=20.0, what="cluster gone")
    for resource, name in [
        (DEPLOYMENTS, "zeta-verifier"),
        (DEPLOYMENTS, "zeta-drafter-code"),
        (SERVICES, "zeta-gateway"),
        (CONFIGMAPS, "zeta-config"),
        (POOLS, "zeta-code"),
    ]:
        assert kube.get(resource, NS, name) is None, name


def test_a_cluster_deleted_during_a_resync_pass_goes_within_seconds(operator: Any, kube: Kube, emulator: Any) -> None:
    """kopf holds its finalizer until the cluster's resync timer has stopped, and does not cancel a
    timer mid-pass: it looks again after `settings.background.cancellation_polling` (kopf's
    default 60 s). Catches the operator leaving that default: a deletion landing while a pass
    runs (here held 3 s by a slow API server on one child's apply) then takes a minute."""
    kube.create(CLUSTERS, NS, cluster_body("eta"))
    wait_for(lambda: (kube.get(CLUSTERS, NS, "eta").get("status") or {}).get("observedGeneration") == 1,
             what="reconciled")
    slowed = emulator.emulator.slowed
    emulator.emulator.slow_writes[(CONFIGMAPS, "eta-config")] = 3.0
    try:
        wait_for(lambda: emulator.emulator.slowed > slowed, timeout_s=4 * RESYNC_S + 5, what="a resync pass in flight")
        started = time.monotonic()
        kube.delete(CLUSTERS, NS, "eta")
        wait_for(lambda: kube.get(CLUSTERS, NS, "eta") is None, timeout_s=30.0, what="cluster gone")
        assert time.monotonic() - started < 3.0 + 2 * RESYNC_S + 5, "the finalizer waited for kopf's 60 s poll"
    finally:
        emulator.emulator.slow_writes.clear()


def _spot_pod(kube: Kube, cluster: str, name: str, scheduled: bool) -> None:
    """A pod of pool ``code`` on spot capacity: Pending with no node (``scheduled`` False, as when
    the provider has no spot capacity) or Running on one."""
    labels = {"cosine.dev/cluster": cluster, "app.kubernetes.io/component": "drafter", "cosine.dev/pool": "code",
              "cosine.dev/capacity": "spot"}
    st = ({"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]} if scheduled else
          {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]})
    if kube.get(PODS, NS, name) is None:
        kube.create(PODS, NS, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS,
                                                                                "labels": labels}, "status": st})
    else:
        kube.patch(PODS, NS, name, {"status": st}, sub="status")


def test_a_spot_pool_without_spot_capacity_gets_an_on_demand_sibling_and_returns_to_spot(
    operator: Any, kube: Kube, operator_metrics_port: int
) -> None:
    """Catches: no fallback while spot replicas stay Pending past ``spec.spot.pendingTimeoutSeconds``;
    a fallback that keeps the spot node selector and toleration (it would stay Pending too) or
    selects the spot pods; a sibling left behind once the spot replicas are Ready; the sibling's
    counts written onto the pool's status."""
    pools = [{"name": "code", "model": "qwen2.5-coder-0.5b-instruct", "expertise": ["code"], "capacity": "spot",
              "replicas": 2, "pricePerHourUsd": 0.7, "spotPricePerHourUsd": 0.25}]
    kube.create(CLUSTERS, NS, cluster_body("kappa", drafterPools=pools,
                                           spot={"provider": "gke", "pendingTimeoutSeconds": 1}))
    spot = wait_for(lambda: kube.get(DEPLOYMENTS, NS, "kappa-drafter-code"), what="spot Deployment")
    # the dashboards' per-pool-dollar panel reads the price the spec gives a spot replica
    # (labelled cosine_cluster and cosine_namespace: a scrape's `namespace` is the operator pod's)
    price = 'cosine_drafter_pool_price_usd_per_hour{cosine_cluster="kappa",cosine_namespace="default",pool="code"} 0.25'
    wait_for(lambda: price in httpx.get(f"http://127.0.0.1:{operator_metrics_port}/metrics").text,
             what="the pool's spot price exported")
    # CoSineVerifierDown's clusters: each one the operator reconciles
    info = 'cosine_operator_cluster_info{cosine_cluster="kappa",cosine_namespace="default"} 1.0'
    assert info in httpx.get(f"http://127.0.0.1:{operator_metrics_port}/metrics").text
    assert spot["spec"]["template"]["metadata"]["labels"]["cosine.dev/capacity"] == "spot"
    assert spot["spec"]["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    for i in range(2):
        _spot_pod(kube, "kappa", f"kappa-drafter-code-{i}", scheduled=False)
    sibling = wait_for(lambda: kube.get(DEPLOYMENTS, NS, "kappa-drafter-code-ondemand"), timeout_s=4 * RESYNC_S + 5,
                       what="on-demand sibling")
    assert sibling["spec"]["replicas"] == 2
    assert sibling["spec"]["selector"]["matchLabels"]["cosine.dev/capacity"] == "onDemand"
    pod = sibling["spec"]["template"]["spec"]
    assert "cloud.google.com/gke-spot" not in (pod.get("nodeSelector") or {})
    assert not any(t.get("key") == "cloud.google.com/gke-spot" for t in pod.get("tolerations") or ())
    assert [r["kind"] for r in sibling["metadata"]["ownerReferences"]] == ["CoSineCluster"]
    cond = wait_for(lambda: (c := condition(kube, "kappa", "SpotFallback")) and c["status"] == "True" and c,
                    what="SpotFallback=True")
    assert "Pending over 1 s" in cond["message"], cond
    kube.patch(DEPLOYMENTS, NS, "kappa-drafter-code-ondemand", {"status": {"replicas": 2, "readyReplicas": 2}},
               sub="status")
    time.sleep(RESYNC_S)
    assert kube.get(POOLS, NS, "kappa-code")["status"].get("readyReplicas", 0) == 0  # the pool's own Deployment's

    # spot capacity comes back: both spot replicas are scheduled and Ready; the load returns to spot
    for i in range(2):
        _spot_pod(kube, "kappa", f"kappa-drafter-code-{i}", scheduled=True)
    mark_ready(kube, "kappa-drafter-code")
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "kappa-drafter-code-ondemand") is None, timeout_s=4 * RESYNC_S + 5,
             what="sibling removed")
    wait_for(lambda: (condition(kube, "kappa", "SpotFallback") or {}).get("status") == "False", what="back on spot")


def test_a_field_of_a_later_release_is_read_past_and_counted(operator: Any, kube: Kube,
                                                             operator_metrics_port: int) -> None:
    """The API server fills a later release's CRD defaults into every stored object: this operator
    reconciles it anyway and counts the fields it ignored (``cosine_operator_spec_unknown_fields``,
    what tells a rollback or a half-done upgrade). Catches: a strict read (``invalid spec``, nothing
    reconciled, every cluster stuck until the new operator runs)."""
    kube.create(CLUSTERS, NS, cluster_body("skew", speculation={"maxDraftLen": 4, "futureKnob": 3}))
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "skew-verifier"), what="the cluster reconciled")
    gauge = 'cosine_operator_spec_unknown_fields{cosine_cluster="skew",cosine_namespace="default"} 1.0'
    wait_for(lambda: gauge in httpx.get(f"http://127.0.0.1:{operator_metrics_port}/metrics").text,
             what="the unknown field counted")
    config = kube.get(CONFIGMAPS, NS, "skew-config")["data"]["cluster.yaml"]
    assert "futureKnob: 3" in config  # the pods get the spec as stored (and read it tolerantly)
