"""The user's journey, written once for two back ends.

``RealCluster`` drives ``kubectl`` against ``$KUBECONFIG`` (kind/k3d on a workstation, GKE/EKS):
install the CRDs and the operator from ``manifests/``, apply an example cluster, wait for Ready,
send a completion through the gateway Service (``kubectl port-forward``), scale a pool, delete.
``EmulatedControlPlane`` (test_journey.py) runs the same steps against the in-process API
emulator with the real operator; the parts no emulator has (kubelet, Deployment controller,
Service routing) are played by the test: ready replicas are patched in, the verifier pod is a real
``cosine serve`` on the cluster's own ``cluster.yaml`` (from the ConfigMap the operator wrote), and
the completion goes where the gateway Service's selector and ``targetPort`` lead, as kube-proxy
would route it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Protocol

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = "cosine.dev/v1alpha1/cosineclusters"


class Cluster(Protocol):
    def install(self) -> None: ...
    def apply(self, doc: dict[str, Any]) -> None: ...
    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None: ...
    def patch(self, resource: str, namespace: str, name: str, body: dict[str, Any]) -> None: ...
    def delete(self, resource: str, namespace: str, name: str) -> None: ...
    def settle(self, namespace: str, cluster: str) -> None: ...
    def complete(self, namespace: str, cluster: str, prompt: str) -> dict[str, Any]: ...


def wait(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s: {what}")


def served_model(cluster: Cluster, namespace: str, name: str) -> str:
    """The model name the verifier serves: ``spec.verifier.model`` (vLLM's ``served_model_name``;
    any other name in a request is a 404)."""
    obj = cluster.get(CLUSTERS, namespace, name)
    assert obj is not None, name
    return str(obj["spec"]["verifier"]["model"])


def completion_request(model: str, prompt: str) -> dict[str, Any]:
    """The journey's completion: greedy, short, with the prompt's and the answer's token ids
    (vLLM's ``return_token_ids``) for the comparison with the target's own answer."""
    return {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}


def target_greedy(model: str, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """The target model's own greedy continuation of ``prompt_token_ids``: transformers in float32,
    no speculation, no server (the model pulled here, ``cosine models pull``). A lossless verifier
    answers the same tokens in float32 (docs: losslessness); a draft wrongly accepted does not."""
    import torch
    from transformers import AutoModelForCausalLM

    from cosine.model_store import pull

    path = pull(model, progress=False)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt_token_ids]), max_new_tokens=max_tokens, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt_token_ids), dtype=torch.long))
    return [int(t) for t in out[0, len(prompt_token_ids):]]


def ready(cluster: Cluster, namespace: str, name: str) -> bool:
    obj = cluster.get(CLUSTERS, namespace, name) or {}
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (obj.get("status") or {}).get("conditions") or []
    )


class RealCluster:
    """``kubectl`` on ``$KUBECONFIG``; the image must be pullable by the cluster."""

    def __init__(self, namespace: str = "cosine-e2e") -> None:
        if shutil.which("kubectl") is None:
            raise RuntimeError("kubectl is needed for the real-cluster journey")
        self.namespace = namespace

    def _kubectl(self, *args: str, stdin: str | None = None) -> str:
        done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True, check=True)
        return done.stdout

    def install(self) -> None:
        self._kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
        self._kubectl("create", "namespace", "cosine-system", "--dry-run=client", "-o", "yaml")
        subprocess.run(["kubectl", "create", "namespace", "cosine-system"], capture_output=True)
        subprocess.run(["kubectl", "create", "namespace", self.namespace], capture_output=True)
        self._kubectl("apply", "-f", str(ROOT / "manifests" / "cosine-operator.yaml"))
        self._kubectl(
            "-n", "cosine-system", "rollout", "status", "deployment/cosine-cosine-operator", "--timeout=300s"
        )

    def apply(self, doc: dict[str, Any]) -> None:
        self._kubectl("apply", "-n", self.namespace, "-f", "-", stdin=yaml.safe_dump(doc))

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        plural = resource.rsplit("/", 1)[1]
        group = resource.split("/")[0] if resource.count("/") == 2 else ""
        kind = f"{plural}.{group}" if group else plural
        done = subprocess.run(
            ["kubectl", "get", "-n", namespace, kind, name, "-o", "json"], capture_output=True, text=True
        )
        return json.loads(done.stdout) if done.returncode == 0 else None

    def patch(self, resource: str, namespace: str, name: str, body: dict[str, Any]) -> None:
        plural = resource.rsplit("/", 1)[1]
        group = resource.split("/")[0] if resource.count("/") == 2 else ""
        self._kubectl(
            "patch",
            "-n",
            namespace,
            f"{plural}.{group}" if group else plural,
            name,
            "--type=merge",
            "-p",
            json.dumps(body),
        )

    def delete(self, resource: str, namespace: str, name: str) -> None:
        plural = resource.rsplit("/", 1)[1]
        group = resource.split("/")[0] if resource.count("/") == 2 else ""
        self._kubectl(
            "delete", "-n", namespace, f"{plural}.{group}" if group else plural, name, "--wait=true"
        )

    def settle(self, namespace: str, cluster: str) -> None:
        """A real cluster needs no help: kubelets and controllers do the work."""

    def complete(self, namespace: str, cluster: str, prompt: str) -> dict[str, Any]:
        """A completion through the gateway Service (``kubectl port-forward`` to its port, which
        ``spec.gateway.port`` sets), for the model the cluster serves."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        svc = self.get("v1/services", namespace, f"{cluster}-gateway")
        assert svc is not None, "no gateway Service"
        body = completion_request(served_model(self, namespace, cluster), prompt)
        forward = subprocess.Popen(
            ["kubectl", "-n", namespace, "port-forward", f"svc/{cluster}-gateway",
             f"{port}:{svc['spec']['ports'][0]['port']}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:

            def post() -> dict[str, Any] | None:
                try:
                    r = httpx.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        timeout=300,
                        json=body,
                    )
                    return dict(r.json()) if r.status_code == 200 else None
                except httpx.HTTPError:
                    return None

            return dict(wait(post, 600, "a completion through the gateway"))
        finally:
            forward.terminate()
            forward.wait(timeout=10)
