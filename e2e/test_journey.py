"""install → apply the example → Ready → completion through the gateway → scale → delete.

Real cluster when ``KUBECONFIG`` is set (``python -m pytest e2e``): the real operator, the real
verifier and drafter pods, a real completion. Otherwise :class:`EmulatedControlPlane`: the API
emulator and the real operator only. No pod runs there (no kubelet, no model): the test plays the
Deployment controller (it sets ``readyReplicas``), and the completion step is a routing check, not
a serving one: the request goes where the gateway Service's selector and ``targetPort`` lead, to a
:class:`_RouteProbe` that echoes it. Serving itself is tested against the real server in
``tests/runtime``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from journey import CLUSTERS, ROOT, Cluster, RealCluster, ready, wait

DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
POOLS = "cosine.dev/v1alpha1/cosinedrafterpools"
NS = "cosine-e2e"


class _RouteProbe(BaseHTTPRequestHandler):
    """Listens where the emulated verifier pod's ``http`` port is; answers with the request it got
    (path and body), so the test sees that the Service routing led here. Not a gateway."""

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answer = {"probe": {"path": self.path, "request": body}}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


class EmulatedControlPlane:
    """The emulator plus the real operator; the test plays kubelet, Deployment controller, kube-proxy.
    Nothing is served: :meth:`complete` returns the :class:`_RouteProbe`'s echo."""

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
        server = ThreadingHTTPServer(("127.0.0.1", 0), _RouteProbe)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        stack.callback(server.shutdown)
        self.probe_port = int(server.server_address[1])

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
                                    "ports": [{"name": "http", "containerPort": self.probe_port}],
                                }
                            ]
                        },
                        "status": {"phase": "Running", "podIP": "127.0.0.1"},
                    },
                )

    def complete(self, namespace: str, cluster: str, prompt: str) -> dict[str, Any]:
        """kube-proxy's job: the gateway Service's selector picks the verifier pod, its ``targetPort``
        names the pod's port; the request goes there (the probe's echo comes back)."""
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
        r = httpx.post(
            f"http://{pods[0]['status']['podIP']}:{port}/v1/completions",
            timeout=10,
            json={"model": "cosine", "prompt": prompt, "max_tokens": 16},
        )
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
    if real:
        assert answer["choices"][0]["text"]  # the verifier served it
    else:  # routing only: the gateway Service led to the verifier pod's http port
        assert answer["probe"] == {
            "path": "/v1/completions",
            "request": {"model": "cosine", "prompt": prompt, "max_tokens": 16},
        }

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
