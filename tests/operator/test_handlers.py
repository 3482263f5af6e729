"""The real operator (kopf run) against the API emulator: create → children → status → delete."""

from __future__ import annotations

from typing import Any

from conftest import CLUSTERS, CONFIGMAPS, DEPLOYMENTS, POOLS, SERVICES, wait_for
from k8s_emulator import Kube

NS = "default"


def cluster_body(name: str = "demo", **spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "verifier": {"model": "qwen2.5-coder-1.5b-instruct"},
        "drafterPools": [
            {"name": "code", "model": "qwen2.5-coder-0.5b-instruct", "expertise": ["code"]},
            {"name": "ngram", "kind": "ngram", "minReplicas": 0},
        ],
        "autoscaling": {"enabled": False},
    }
    spec.update(spec_overrides)
    return {"apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


def test_create_builds_children_with_owner_references(operator: Any, kube: Kube) -> None:
    created = kube.create(CLUSTERS, NS, cluster_body())
    uid = created["metadata"]["uid"]
    deployment = wait_for(lambda: kube.get(DEPLOYMENTS, NS, "demo-verifier"), what="verifier Deployment")
    for resource, name in [(CONFIGMAPS, "demo-config"), (SERVICES, "demo-verifier"), (SERVICES, "demo-gateway"),
                           (DEPLOYMENTS, "demo-drafter-code"), (SERVICES, "demo-drafter-code"),
                           (DEPLOYMENTS, "demo-drafter-ngram"), (POOLS, "demo-code")]:
        obj = kube.get(resource, NS, name)
        assert obj is not None, name
        assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid], name
    assert "--drafter" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    status = wait_for(lambda: kube.get(CLUSTERS, NS, "demo")["status"].get("conditions"), what="status")
    assert {c["type"] for c in status} >= {"Ready", "VerifierReady", "DraftersReady"}
