"""install → apply the example → Ready → completion through the gateway → scale → delete.

Real cluster when ``KUBECONFIG`` is set (``python -m pytest e2e``): the real operator, the real
verifier and drafter pods, a real completion. Otherwise :class:`EmulatedControlPlane`: the API
emulator and the real operator, no kubelet: the test plays the Deployment controller (it sets
``readyReplicas``) and the kubelet of the verifier pod, which is a real ``cosine serve`` on the
ConfigMap's ``cluster.yaml`` with the example's models swapped for SmolLM2-135M (it serves on a
CPU in seconds); the completion goes where the gateway Service's selector and ``targetPort`` lead,
for the model the spec names, and the answer is the verifier's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from journey import CLUSTERS, ROOT, Cluster, RealCluster, completion_request, ready, served_model, wait

DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
POOLS = "cosine.dev/v1alpha1/cosinedrafterpools"
NS = "cosine-e2e"


SMALL_MODEL = "smollm2-135m-instruct"  # what the emulated journey serves (a CPU, in seconds)


class EmulatedControlPlane:
    """The emulator plus the real operator; the test plays kubelet, Deployment controller, kube-proxy.
    The verifier pod is a real ``cosine serve`` (pools off: ``--placement lookup``) on the
    ``cluster.yaml`` the operator wrote into the cluster's ConfigMap, on a loopback port that the
    pod's ``http`` port stands for."""

    def __init__(self, stack: ExitStack, tmp: Path) -> None:
        from k8s_emulator import EmulatorThread, Kube
        from kopf.testing import KopfRunner

        from cosine_operator.__main__ import kopf_args

        self.emulator = stack.enter_context(EmulatorThread(tmp))
        self.kube = Kube(self.emulator.url)
        with socket.socket() as sock:  # the admission webhook, on plain HTTP (kopf's registry is global:
            sock.bind(("127.0.0.1", 0))  # once imported, its handler needs a server in every run)
            webhook_port = sock.getsockname()[1]
        self._stack, self._env = (
            stack,
            {
                "KUBECONFIG": str(self.emulator.kubeconfig),
                "COSINE_OPERATOR_WEBHOOK_PORT": str(webhook_port),
                "COSINE_OPERATOR_WEBHOOK_INSECURE": "1",
            },
        )
        self._runner = (KopfRunner, kopf_args)
        self._tmp = tmp
        self.server: subprocess.Popen[bytes] | None = None
        stack.callback(self._stop_server)

    def _serve(self, namespace: str, cluster: str) -> int:
        """Start ``cosine serve`` on the cluster's ConfigMap (what the verifier pod mounts); its port."""
        from cosine.model_store import pull
        from cosine.processes import free_port

        config = self.kube.get("v1/configmaps", namespace, f"{cluster}-config")
        assert config is not None, "no ConfigMap"
        manifest = self._tmp / "cluster.yaml"
        manifest.write_text(config["data"]["cluster.yaml"])
        pull(SMALL_MODEL, progress=False)
        port = free_port()
        self.server = subprocess.Popen(
            [sys.executable, "-m", "cosine", "serve", "--cluster", str(manifest), "--port", str(port),
             "--metrics-port", "0", "--pools-metrics-port", "0", "--placement", "lookup"], start_new_session=True)
        return port

    def _stop_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()

    def install(self) -> None:
        """The operator Deployment cannot run here: run the same program in-process instead."""
        runner_cls, kopf_args = self._runner
        saved = {key: os.environ.get(key) for key in self._env}
        os.environ.update(self._env)

        def restore() -> None:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

        self._stack.callback(restore)
        self._stack.enter_context(runner_cls(kopf_args(["--standalone", "-A"], self._env), timeout=30))
        # kmock's list carries no real resourceVersion, so an object created between kopf's initial
        # list and its watch would be missed (a real API server replays from the list's version):
        # let the watches start first, as a running operator's would have.
        time.sleep(1.5)

    def apply(self, doc: dict[str, Any]) -> None:
        doc = {**doc, "metadata": {**doc["metadata"], "namespace": NS}}
        self.kube.create(CLUSTERS, NS, doc)

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.kube.get(resource, namespace, name)

    def patch(self, resource: str, namespace: str, name: str, body: dict[str, Any]) -> None:
        self.kube.patch(resource, namespace, name, body)

    def delete(self, resource: str, namespace: str, name: str) -> None:
        self.kube.delete(resource, namespace, name)

    def settle(self, namespace: str, cluster: str) -> None:
        """Play the Deployment controller and kubelet: replicas become ready, pods exist."""
        for d in self.kube.list(DEPLOYMENTS, namespace):
            if d["metadata"].get("labels", {}).get("cosine.dev/cluster") != cluster:
                continue
            want = d["spec"]["replicas"]
            if (d.get("status") or {}).get("readyReplicas") != want:
                self.kube.patch(
                    DEPLOYMENTS,
                    namespace,
                    d["metadata"]["name"],
                    {"status": {"replicas": want, "readyReplicas": want}},
                    sub="status",
                )
            pod_name = f"{d['metadata']['name']}-0"
            if (
                d["metadata"]["name"].endswith("-verifier")
                and self.kube.get("v1/pods", namespace, pod_name) is None
            ):
                labels = d["spec"]["template"]["metadata"]["labels"]
                port = self._serve(namespace, cluster)
                self.kube.create(
                    "v1/pods",
                    namespace,
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {"name": pod_name, "namespace": namespace, "labels": labels},
                        "spec": {
                            "containers": [
                                {
                                    "name": "verifier",
                                    "ports": [{"name": "http", "containerPort": port}],
                                }
                            ]
                        },
                        "status": {"phase": "Running", "podIP": "127.0.0.1"},
                    },
                )

    def complete(self, namespace: str, cluster: str, prompt: str) -> dict[str, Any]:
        """kube-proxy's job: the gateway Service's selector picks the verifier pod, its ``targetPort``
        names the pod's port; the request goes there, for the model the spec names."""
        import httpx

        svc = self.kube.get(SERVICES, namespace, f"{cluster}-gateway")
        assert svc is not None
        selector = svc["spec"]["selector"]
        pods = [
            p
            for p in self.kube.list("v1/pods", namespace)
            if selector.items() <= (p["metadata"].get("labels") or {}).items()
        ]
        assert pods, f"no pod matches the gateway Service selector {selector}"
        target = svc["spec"]["ports"][0]["targetPort"]
        port = next(
            p["containerPort"] for p in pods[0]["spec"]["containers"][0]["ports"] if p["name"] == target
        )
        base = f"http://{pods[0]['status']['podIP']}:{port}"

        def healthy() -> bool:
            assert self.server is not None and self.server.poll() is None, "cosine serve exited"
            try:
                return httpx.get(f"{base}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait(healthy, 400, "the verifier serving")
        r = httpx.post(f"{base}/v1/completions", timeout=120,
                       json=completion_request(served_model(self, namespace, cluster), prompt))
        r.raise_for_status()
        return dict(r.json())


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    if os.environ.get("KUBECONFIG"):
        yield RealCluster(NS)
        return
    with ExitStack() as stack:
        yield EmulatedControlPlane(stack, tmp_path)


def test_user_journey(cluster: Cluster) -> None:
    real = isinstance(cluster, RealCluster)
    budget_s = 1800.0 if real else 15.0  # model downloads on a real cluster
    cluster.install()
    example = yaml.safe_load((ROOT / "manifests" / "examples" / "embedded.yaml").read_text())
    if not real:  # a small model of one tokenizer family serves here in seconds
        example["spec"]["verifier"]["model"] = SMALL_MODEL
        for pool in example["spec"]["drafterPools"]:
            if "model" in pool:
                pool["model"] = SMALL_MODEL
    name = example["metadata"]["name"]
    cluster.apply(example)

    wait(lambda: cluster.get(DEPLOYMENTS, NS, f"{name}-drafter-ngram"), budget_s, "children created")

    def settled_ready() -> bool:
        cluster.settle(NS, name)
        return ready(cluster, NS, name)

    wait(settled_ready, budget_s, "CoSineCluster Ready")
    status = cluster.get(CLUSTERS, NS, name)["status"]  # type: ignore[index]
    assert status["verifier"]["ready"] == "1/1"
    if not real and shutil.which("kubectl"):
        # kubectl talks to the emulator too (raw API reads need no discovery or OpenAPI).
        kubeconfig = os.environ["KUBECONFIG"]
        raw = subprocess.run(
            [
                "kubectl",
                "--kubeconfig",
                kubeconfig,
                "get",
                "--raw",
                f"/apis/cosine.dev/v1alpha1/namespaces/{NS}/cosineclusters/{name}",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert json.loads(raw)["status"]["phase"] == "Ready"

    prompt = "def fibonacci(n):"
    answer = cluster.complete(NS, name, prompt)
    # the verifier served it, as the model the spec names
    assert answer["choices"][0]["text"] and answer["model"] == example["spec"]["verifier"]["model"]
    assert answer["usage"]["completion_tokens"] == 16

    # Scale the code pool by hand: the pool's scale target, then its Deployment, follow.
    spec = cluster.get(CLUSTERS, NS, name)["spec"]  # type: ignore[index]
    pools = [dict(p, replicas=2) if p["name"] == "code" else p for p in spec["drafterPools"]]
    cluster.patch(CLUSTERS, NS, name, {"spec": {"drafterPools": pools}})
    wait(
        lambda: (
            (cluster.get(DEPLOYMENTS, NS, f"{name}-drafter-code") or {}).get("spec", {}).get("replicas") == 2
        ),
        budget_s,
        "code pool scaled to 2",
    )
    assert cluster.get(POOLS, NS, f"{name}-code")["spec"]["replicas"] == 2  # type: ignore[index]

    cluster.delete(CLUSTERS, NS, name)
    wait(lambda: cluster.get(CLUSTERS, NS, name) is None, budget_s, "cluster deleted")
    wait(
        lambda: cluster.get(DEPLOYMENTS, NS, f"{name}-verifier") is None,
        budget_s,
        "children garbage-collected",
    )
