"""The chart's sample CoSineCluster Job (cosine_operator.sample): it waits out a webhook the API
server cannot call yet, stops at once on a refusal, and against Kubernetes' CRD server applies the
sample (updated in place on upgrade) and deletes it."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client.exceptions import ApiException

from cosine_operator import kube, sample

ROOT = Path(__file__).resolve().parents[2]
# What the API server answers while the operator has no Ready pod behind the webhook's Service
# (failurePolicy Fail): an InternalError naming the webhook.
NO_ENDPOINTS = (
    'Internal error occurred: failed calling webhook "validate.cosineclusters.cosine.dev": failed to '
    'call webhook: Post "https://cosine-cosine-operator.cosine-system.svc:443/validate-cosinecluster'
    '?timeout=10s": no endpoints available for service "cosine-cosine-operator"'
)
BODY = {
    "apiVersion": "cosine.dev/v1alpha1",
    "kind": "CoSineCluster",
    "metadata": {"name": "demo", "namespace": "default"},
    "spec": {"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}]},
}


def _refused(status: int, message: str) -> ApiException:
    e = ApiException(status=status, reason="refused")
    e.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status})
    return e


def test_apply_waits_for_the_webhook_and_stops_on_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: the Job failing on the first "no endpoints available" (the install fails as if the
    sample were a release object), or retrying a spec the webhook refused until Helm times out."""
    answers: list[Any] = [_refused(500, NO_ENDPOINTS), _refused(500, NO_ENDPOINTS), {"metadata": {}}]
    calls: list[tuple[dict[str, Any], str]] = []

    async def fake_apply(api: Any, body: dict[str, Any], manager: str = "", force: bool = True) -> Any:
        calls.append((body, manager))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def nothing_there(*_: Any) -> None:
        return None

    monkeypatch.setattr(kube, "apply", fake_apply)
    monkeypatch.setattr(kube, "get", nothing_there)
    monkeypatch.setattr(sample, "RETRY_S", 0.0)
    log: list[str] = []
    asyncio.run(sample.apply(None, BODY, timeout_s=60, log=log.append))
    assert [c[1] for c in calls] == [sample.MANAGER] * 3 and calls[0][0] == BODY
    assert sum("no endpoints available" in line for line in log) == 2

    refusal = 'admission webhook "validate.cosineclusters.cosine.dev" denied the request: spec.verifier.model'
    answers[:] = [_refused(422, refusal), {"metadata": {}}]
    with pytest.raises(ApiException) as e:
        asyncio.run(sample.apply(None, BODY, timeout_s=60, log=log.append))
    assert e.value.status == 422 and len(answers) == 1  # not tried again

    answers[:] = [_refused(500, NO_ENDPOINTS)] * 3
    with pytest.raises(ApiException):  # past its deadline: the last error, for the Job's log
        asyncio.run(sample.apply(None, BODY, timeout_s=0, log=log.append))


def test_transient_statuses() -> None:
    assert all(sample.transient(s) for s in (500, 503, 504, 403, 404, 429))
    assert not any(sample.transient(s) for s in (400, 409, 422))


def _install_crds(server: Any) -> None:
    for path in sorted((ROOT / "crds").glob("cosine.dev_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        name = crd["metadata"]["name"]
        r = server.http.patch(
            f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}",
            params={"fieldManager": "test", "force": "true"},
            content=json.dumps(crd),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        assert r.status_code in (200, 201), r.text
    deadline = time.monotonic() + 30
    while server.http.get("/apis/cosine.dev/v1alpha1").status_code != 200:
        assert time.monotonic() < deadline, "CRDs not served"
        time.sleep(0.2)


@pytest.mark.real_apiserver
def test_apply_then_update_in_place_then_delete_on_the_real_server(
    real_apiserver: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the hook Jobs run (``python -m cosine_operator.sample``), against Kubernetes' CRD
    server: install creates the sample; an upgrade with a changed spec updates the same object (its
    uid kept: the serving cluster is not torn down); pre-delete removes it and returns once gone."""
    _install_crds(real_apiserver)
    monkeypatch.setenv("KUBECONFIG", str(real_apiserver.kubeconfig))
    for key in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(key, raising=False)
    path = f"/apis/cosine.dev/v1alpha1/namespaces/default/cosineclusters/{BODY['metadata']['name']}"

    def run(action: str, body: dict[str, Any]) -> None:
        env = {**os.environ, "COSINE_SAMPLE": json.dumps(body), "COSINE_SAMPLE_TIMEOUT_S": "20"}
        asyncio.run(sample._main(action, env))

    run("apply", BODY)
    first = real_apiserver.http.get(path).json()
    assert first["spec"]["verifier"]["model"] == "m"
    changed = json.loads(json.dumps(BODY))
    changed["spec"]["verifier"]["model"] = "m2"
    run("apply", changed)
    second = real_apiserver.http.get(path).json()
    assert second["spec"]["verifier"]["model"] == "m2"
    assert second["metadata"]["uid"] == first["metadata"]["uid"]
    assert [f["manager"] for f in second["metadata"]["managedFields"]] == [sample.MANAGER]
    run("delete", changed)
    assert real_apiserver.http.get(path).status_code == 404
    run("delete", changed)  # already gone: nothing to do


def test_apply_waits_out_a_sample_still_being_deleted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upgrading from a chart whose sample was a release object: Helm deletes that object, then runs
    the hooks. Applied to while its finalizer is pending, the sample would still go. Catches: the
    Job applying to the terminating object (the upgrade ends with no sample)."""
    terminating = {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}
    live: list[Any] = [terminating, terminating, None]
    order: list[str] = []

    async def fake_get(*_: Any) -> Any:
        order.append("get")
        return live.pop(0)

    async def fake_apply(*_: Any, **__: Any) -> Any:
        order.append("apply")
        return {}

    monkeypatch.setattr(kube, "get", fake_get)
    monkeypatch.setattr(kube, "apply", fake_apply)
    monkeypatch.setattr(sample, "RETRY_S", 0.0)
    asyncio.run(sample.apply(None, BODY, timeout_s=60, log=lambda _: None))
    assert order == ["get", "get", "get", "apply"]
    live[:] = [{"metadata": {}}]  # there and not being deleted: applied at once
    order.clear()
    asyncio.run(sample.apply(None, BODY, timeout_s=60, log=lambda _: None))
    assert order == ["get", "apply"]
