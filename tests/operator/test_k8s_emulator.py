"""The emulator refuses what the real API server refuses: immutable fields (k8s_emulator.IMMUTABLE).

Each rule is checked both ways (the change refused with a 422 naming the field, an allowed change
passing), through a merge patch and through server-side apply, which the operator uses. The first
test replays what the operator did before the model pull Job was named by its whole template: the
same Job name with a new image, which a real cluster refuses and which wedged reconcile.
"""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest
from cosine_spec.cluster_spec import ClusterSpec, parse_cluster_spec
from k8s_emulator import DEPLOYMENTS, JOBS, PVCS, SERVICES, Kube

from cosine_operator.builders.storage import build_model_job

NS = "default"


def _apply(kube: Kube, resource: str, body: dict[str, Any]) -> httpx.Response:
    return kube.http.patch(kube.path(resource, NS, body["metadata"]["name"]), json=body,
                           headers={"Content-Type": "application/apply-patch+yaml"},
                           params={"fieldManager": "cosine-operator", "force": "true"})


def _cluster(image: str) -> ClusterSpec:
    return parse_cluster_spec({"verifier": {"model": "qwen2.5-coder-1.5b-instruct"},
                                 "drafterPools": [{"name": "lookup", "kind": "ngram"}],
                                 "image": {"repository": "ghcr.io/cosine-project/cosine", "tag": image},
                                 "modelCache": {"size": "20Gi"}})


def test_a_changed_job_template_under_the_same_name_is_refused(kube: Kube) -> None:
    old = build_model_job("img", NS, _cluster("0.1.0"))
    assert old is not None
    assert _apply(kube, JOBS, old).status_code == 200
    # the old naming (a hash of the model list only): an image change kept the name
    same_name = copy.deepcopy(old)
    same_name["spec"]["template"]["spec"]["containers"][0]["image"] = "ghcr.io/cosine-project/cosine:0.2.0"
    refused = _apply(kube, JOBS, same_name)
    assert refused.status_code == 422, refused.text
    assert "spec.template" in refused.text and "immutable" in refused.text
    # today's naming: the new template is a new Job
    new = build_model_job("img", NS, _cluster("0.2.0"))
    assert new is not None and new["metadata"]["name"] != old["metadata"]["name"]
    assert _apply(kube, JOBS, new).status_code == 200
    # the Job's own status and metadata still change
    labels = {"metadata": {"labels": {"extra": "yes"}}}
    assert kube.http.patch(kube.path(JOBS, NS, new["metadata"]["name"]), json=labels,
                           headers={"Content-Type": "application/merge-patch+json"}).status_code == 200


def _refused(kube: Kube, resource: str, name: str, body: dict[str, Any], field: str) -> None:
    r = kube.http.patch(kube.path(resource, NS, name), json=body,
                        headers={"Content-Type": "application/merge-patch+json"})
    assert r.status_code == 422, r.text
    assert field in r.json()["message"], r.text


def test_job_selector_deployment_selector_and_service_cluster_ip(kube: Kube) -> None:
    kube.create(JOBS, NS, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
                           "spec": {"selector": {"matchLabels": {"a": "1"}},
                                    "template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}})
    _refused(kube, JOBS, "j", {"spec": {"selector": {"matchLabels": {"a": "2"}}}}, "spec.selector")
    kube.create(DEPLOYMENTS, NS, {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
                                  "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "1"}},
                                           "template": {"metadata": {"labels": {"a": "1"}},
                                                        "spec": {"containers": [{"name": "c", "image": "i"}]}}}})
    _refused(kube, DEPLOYMENTS, "d", {"spec": {"selector": {"matchLabels": {"a": "2"}}}}, "spec.selector")
    # a Deployment's template and replicas change freely
    kube.patch(DEPLOYMENTS, NS, "d", {"spec": {"replicas": 3, "template": {"spec": {"containers": [
        {"name": "c", "image": "j"}]}}}})
    kube.create(SERVICES, NS, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "svc"},
                               "spec": {"clusterIP": "None", "ports": [{"port": 80}]}})
    _refused(kube, SERVICES, "svc", {"spec": {"clusterIP": "10.0.0.7"}}, "spec.clusterIP")
    kube.patch(SERVICES, NS, "svc", {"spec": {"ports": [{"port": 81}]}})


@pytest.mark.parametrize("change, allowed", [
    ({"resources": {"requests": {"storage": "30Gi"}}}, True),   # growing the request: allowed
    ({"resources": {"requests": {"storage": "10Gi"}}}, False),  # shrinking: refused
    ({"storageClassName": "premium"}, False),
    ({"accessModes": ["ReadWriteMany"]}, False),
])
def test_a_claims_spec_is_immutable_but_for_growing_its_storage(kube: Kube, change: dict[str, Any],
                                                                allowed: bool) -> None:
    name = f"pvc-{abs(hash(repr(change))) % 10**6}"
    kube.create(PVCS, NS, {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
                           "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "standard",
                                    "resources": {"requests": {"storage": "20Gi"}}}})
    if allowed:
        kube.patch(PVCS, NS, name, {"spec": change})
    else:
        _refused(kube, PVCS, name, {"spec": change}, "spec")


def test_a_deployment_turned_recreate_drops_the_rolling_update_the_server_defaulted(emulator: Any,
                                                                                    kube: Kube) -> None:
    """The endpoint picker's Deployment as operators before this one applied it (``RollingUpdate``,
    its surge defaulted by the server and owned by no manager), then as this one does
    (``Recreate``): a plain apply is refused, as on a real server (kubernetes#24198), and
    ``kube.apply`` drops the default and applies. Catches an upgrade whose every pass fails on the
    picker."""
    import asyncio
    import os

    from cosine_operator import kube as k
    from cosine_operator.builders.router import build_router

    spec = {"verifier": {"model": "qwen2.5-coder-1.5b-instruct"}, "drafterPools": [{"name": "lookup", "kind": "ngram"}],
            "router": {"enabled": True, "gatewayName": "gw"}}
    new = next(o for o in build_router("turn", NS, parse_cluster_spec(spec)) if o["kind"] == "Deployment")
    assert new["spec"]["strategy"] == {"type": "Recreate"}
    old = copy.deepcopy(new)
    old["spec"]["strategy"] = {"type": "RollingUpdate"}
    assert _apply(kube, DEPLOYMENTS, old).status_code == 200
    defaulted = kube.get(DEPLOYMENTS, NS, "turn-epp")
    assert defaulted is not None
    assert defaulted["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": "25%"}
    refused = _apply(kube, DEPLOYMENTS, new)
    assert refused.status_code == 422 and "rollingUpdate" in refused.text, refused.text

    async def apply() -> dict[str, Any]:
        api = await k.connect()
        try:
            return await k.apply(api, new)
        finally:
            await api.close()

    saved = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(emulator.kubeconfig)
    try:
        applied = asyncio.run(apply())
    finally:
        if saved is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = saved
    assert applied["spec"]["strategy"] == {"type": "Recreate"}
    assert _apply(kube, DEPLOYMENTS, new).status_code == 200  # and stays applied
