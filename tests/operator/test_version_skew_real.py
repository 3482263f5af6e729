"""Version skew on the real admission path: a CRD server of its own whose
``ValidatingAdmissionWebhook`` plugin (Kubernetes' code) calls the operator's webhook, with the
chart's ValidatingWebhookConfiguration, for every write: kopf's own PATCHes included
(``admission_source.py`` serves the plugin its configuration and namespaces).

What a release must never block: kopf's finalizer removal and annotation patches on a cluster
stored under rules this release refuses (one an earlier, laxer release admitted: here a llama.cpp
pool on a model with no GGUF, a rule newer than the previous release's CRDs); and, once a later
release's CRDs add a defaulted field (the CRD step of an upgrade done, the operator not yet, or a
rollback), the operator's reconcile, the pods' reading of the ConfigMap it writes, and the edits
and deletion of every cluster, all of which now carry that field. What it still refuses: a
person's write of a spec that fails today's rules or brings a field this release does not know.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from admission_source import AdmissionSource
from api_router import ApiRouter
from conftest import run_operator
from k8s_emulator import CONFIGMAPS, DEPLOYMENTS, EmulatorThread, Kube, wait_for
from test_chart import render
from test_crds_real import ROOT, apply_crds
from test_handlers import cluster_body

from cosine.manifest import load_manifest

pytestmark = pytest.mark.real_apiserver

NS = "default"
CLUSTERS = f"/apis/cosine.dev/v1alpha1/namespaces/{NS}/cosineclusters"
# A pool the "llama.cpp needs a GGUF" rule refuses, a rule newer than the previous release's CRDs
NO_GGUF = {"name": "p", "model": "Qwen/Qwen2.5-Coder-3B-Instruct"}


def chart_webhook(port: int, ca: bytes) -> dict[str, Any]:
    """The chart's ValidatingWebhookConfiguration pointed at ``127.0.0.1:port`` (a URL for the Service),
    with the defaults kube-apiserver fills on create (the plugin reads it as stored)."""
    config = copy.deepcopy(next(d for d in render() if d["kind"] == "ValidatingWebhookConfiguration"))
    for hook in config["webhooks"]:
        path = hook["clientConfig"]["service"]["path"]
        hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": base64.b64encode(ca).decode()}
        for key, default in (("matchPolicy", "Equivalent"), ("namespaceSelector", {}), ("objectSelector", {}),
                             ("timeoutSeconds", 10)):
            hook.setdefault(key, default)
    return config


@pytest.fixture(scope="module")
def admitting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiRouter, AdmissionSource]]:
    """A CRD server running the ValidatingAdmissionWebhook plugin, behind a router with an emulator."""
    from real_apiserver import RealApiServer, provision

    with (AdmissionSource(tmp_path_factory.mktemp("admission-source")) as source,
          RealApiServer(provision(), tmp_path_factory.mktemp("admitting-apiserver"), core=source.kubeconfig) as server,
          EmulatorThread(tmp_path_factory.mktemp("admitting-emulator")) as emu,
          ApiRouter(emu.url, server, tmp_path_factory.mktemp("admitting-router")) as router):
        router.emulator = emu
        apply_crds(router)
        yield router, source


@pytest.fixture
def operator(admitting: tuple[ApiRouter, AdmissionSource], webhook_port: int,
             tmp_path: Path) -> Callable[[], AbstractContextManager[Any]]:
    """Starts the operator (kopf run) through the router, its webhook on TLS with a certificate for
    127.0.0.1: ``with operator(): ...``. Started by the test: where it starts matters (a running
    operator's watches go on serving what the CRD server decoded under the CRD they began with)."""
    router, _ = admitting
    certs = tmp_path / "webhook-certs"
    certs.mkdir()
    shutil.copy(router.real.certs["server.crt"], certs / "tls.crt")
    shutil.copy(router.real.certs["server.key"], certs / "tls.key")
    env = {"COSINE_OPERATOR_WEBHOOK_PORT": str(webhook_port), "COSINE_OPERATOR_WEBHOOK_CERT_DIR": str(certs)}
    return lambda: run_operator(router.kubeconfig, env)


def _write(router: ApiRouter, method: str, path: str, body: Any = None, patch: str = "merge") -> httpx.Response:
    """A write to the real server as a person's client makes it (no router: its own admission path)."""
    content = {"merge": "application/merge-patch+json", "json": "application/json-patch+json"}[patch]
    headers = {"Content-Type": content if method == "PATCH" else "application/json"}
    return router.real.http.request(method, path, content=json.dumps(body) if body is not None else None,
                                    headers=headers)


def _admission_on(router: ApiRouter, source: AdmissionSource, port: int) -> None:
    """The chart's webhook configuration served to the plugin, and in force: a write it refuses is refused."""
    source.set_webhooks(chart_webhook(port, router.real.certs["ca.crt"].read_bytes()))

    def refused() -> httpx.Response | None:
        answer = _write(router, "POST", f"{CLUSTERS}?dryRun=All",
                        cluster_body("probe", drafterPools=[NO_GGUF]))
        return answer if answer.status_code == 422 and "validate.cosineclusters.cosine.dev" in answer.text else None

    answer = wait_for(refused, timeout_s=60, what="the webhook in force on the CRD server")
    assert "spec.drafterPools[0].model" in answer.json()["message"]


def _admission_off(router: ApiRouter, source: AdmissionSource) -> None:
    """No webhook configuration served, and none in force: a write the webhook would refuse passes."""
    source.set_webhooks()
    wait_for(lambda: _write(router, "POST", f"{CLUSTERS}?dryRun=All",
                            cluster_body("probe", drafterPools=[NO_GGUF])).status_code == 201,
             timeout_s=60, what="no webhook in force")


def _gone(router: ApiRouter, name: str) -> bool:
    return _write(router, "GET", f"{CLUSTERS}/{name}").status_code == 404


def test_kopfs_patches_pass_the_real_admission_path_and_a_persons_bad_spec_does_not(
        operator: Any, admitting: tuple[ApiRouter, AdmissionSource], webhook_port: int) -> None:
    """Catches: the webhook refusing an UPDATE that keeps the spec (kopf's annotations, a label) or
    one of an object being deleted (kopf removing its finalizer): the cluster never finishes deleting."""
    router, source = admitting
    kube = Kube(router.url)
    _admission_off(router, source)  # none yet: stored as an earlier, laxer release admitted it
    with operator():
        assert _write(router, "POST", CLUSTERS, cluster_body("legacy", drafterPools=[NO_GGUF])).status_code == 201
        wait_for(lambda: kube.get(DEPLOYMENTS, NS, "legacy-verifier"), timeout_s=60, what="legacy reconciled")
        wait_for(lambda: _write(router, "GET", f"{CLUSTERS}/legacy").json()["metadata"].get("finalizers"),
                 what="kopf's finalizer")
        _admission_on(router, source, webhook_port)
        labelled = _write(router, "PATCH", f"{CLUSTERS}/legacy", {"metadata": {"labels": {"team": "ml"}}})
        assert labelled.status_code == 200, labelled.text  # metadata only: admitted whatever the spec
        scaled = _write(router, "PATCH", f"{CLUSTERS}/legacy",
                        {"spec": {"drafterPools": [{**NO_GGUF, "replicas": 2}]}})
        assert scaled.status_code == 422 and "spec.drafterPools[0].model" in scaled.json()["message"], scaled.text
        assert _write(router, "DELETE", f"{CLUSTERS}/legacy").status_code == 200
        # kopf removes its finalizer with a PATCH of the object: through the webhook, admitted
        wait_for(lambda: _gone(router, "legacy"), timeout_s=60, what="legacy deleted (kopf's finalizer removed)")


def _later_release_crd() -> dict[str, Any]:
    """This release's CoSineCluster CRD with a field a later release adds, with a default."""
    crd = yaml.safe_load((ROOT / "crds" / "cosine.dev_cosineclusters.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["speculation"]["properties"]["futureKnob"] = {
        "type": "integer", "default": 3, "description": "A later release's setting."}
    return dict(crd)


def test_a_later_releases_defaulted_field_is_read_with_a_warning_and_refused_only_where_written(
        operator: Any, admitting: tuple[ApiRouter, AdmissionSource], webhook_port: int, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """The CRD step of an upgrade done, the operator not yet (or rolled back): the server fills the
    new field into every object it reads. Catches: the operator refusing to reconcile (``invalid
    spec``), a pod refusing the ConfigMap the operator wrote, every write refused ("unknown
    field"), kopf's and a person's edit of another field alike, so nothing can change or be deleted;
    and a write that brings the field admitted (this release would ignore it)."""
    router, source = admitting
    caplog.set_level(logging.WARNING)
    kube = Kube(router.url)
    _admission_off(router, source)  # stored before the CRD step (no operator answers a webhook yet)
    assert _write(router, "POST", CLUSTERS, cluster_body("skew", speculation={"maxDraftLen": 4})).status_code == 201
    crd = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/cosineclusters.cosine.dev"
    later = _later_release_crd()
    later["metadata"]["resourceVersion"] = _write(router, "GET", crd).json()["metadata"]["resourceVersion"]
    assert _write(router, "PUT", crd, later).status_code == 200
    wait_for(lambda: _write(router, "GET", f"{CLUSTERS}/skew").json()["spec"]["speculation"].get("futureKnob"),
             timeout_s=30, what="the later release's default on read")
    with operator():
        # the operator reconciles it, saying what it ignored; the ConfigMap keeps the spec as stored
        wait_for(lambda: kube.get(DEPLOYMENTS, NS, "skew-verifier"), timeout_s=60, what="skew reconciled")
        wait_for(lambda: any("spec.speculation.futureKnob" in r.getMessage() for r in caplog.records),
                 timeout_s=60, what="the operator's warning")
        _admission_on(router, source, webhook_port)
        # admission: a change that keeps the field passes, with a warning
        edited = _write(router, "PATCH", f"{CLUSTERS}/skew", {"spec": {"speculation": {"maxDraftLen": 6}}})
        assert edited.status_code == 200, edited.text
        assert "spec.speculation.futureKnob" in edited.headers.get("Warning", ""), edited.headers

        def config() -> str | None:
            text = str(kube.get(CONFIGMAPS, NS, "skew-config")["data"]["cluster.yaml"])
            return text if "futureKnob" in text and "maxDraftLen: 6" in text else None

        written = wait_for(config, timeout_s=60, what="the ConfigMap written from the edited spec")
        # a pod reads the ConfigMap with a warning; a person's file with the field is refused
        manifest = tmp_path / "cluster.yaml"
        manifest.write_text(written)
        caplog.clear()
        read = load_manifest(manifest, strict=False)
        assert read.unknown == ("spec.speculation.futureKnob",) and read.spec.speculation.max_draft_len == 6
        assert any("spec.speculation.futureKnob" in r.getMessage() for r in caplog.records)
        with pytest.raises(ValueError, match=r"spec.speculation.futureKnob: unknown field"):
            load_manifest(manifest)
        # a write that brings the field is refused: a new cluster (the server defaults it in)
        created = _write(router, "POST", CLUSTERS, cluster_body("skew2"))
        assert created.status_code == 422, created.text
        assert "spec.speculation.futureKnob: unknown field" in created.json()["message"]
        assert _write(router, "DELETE", f"{CLUSTERS}/skew").status_code == 200
        wait_for(lambda: _gone(router, "skew"), timeout_s=60, what="skew deleted (kopf's finalizer removed)")
