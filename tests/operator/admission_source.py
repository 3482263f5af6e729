"""What the CRD server's ``ValidatingAdmissionWebhook`` plugin reads from the core API, served for
tests: Namespaces and ValidatingWebhookConfigurations, list and watch.

``apiextensions-apiserver`` runs Kubernetes' generic admission chain, webhooks included, but takes
its webhook configurations (and the namespaces their ``namespaceSelector`` matches) from informers
on the core API named by its ``--kubeconfig`` (``k8s.io/apiserver``
``pkg/admission/plugin/webhook/generic/webhook.go``: ready once both informers have synced). It
serves no core API itself. This server answers those two informers as kube-apiserver would: a
list with a ``resourceVersion``, then a watch that streams ``ADDED``/``MODIFIED`` events as
:meth:`AdmissionSource.set_webhooks` changes the configurations. A watch-list request
(``sendInitialEvents``) is refused with 400, so client-go falls back to list and watch (its
reflector does so for servers without watch-list). Anything else is a 404: the CRD server's other
core informers (API Priority and Fairness) then never sync, as with no core API at all.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

NAMESPACES = "/api/v1/namespaces"
WEBHOOKS = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
KINDS = {NAMESPACES: ("v1", "Namespace"), WEBHOOKS: ("admissionregistration.k8s.io/v1",
                                                     "ValidatingWebhookConfiguration")}


class AdmissionSource:
    """The server on loopback in a thread of its own; ``kubeconfig`` points at it (plain HTTP)."""

    def __init__(self, workdir: Path, namespaces: tuple[str, ...] = ("default",)) -> None:
        self.workdir = workdir
        self._version = 1
        self._objects: dict[str, dict[str, dict[str, Any]]] = {
            NAMESPACES: {n: self._stamp(NAMESPACES, {"metadata": {
                "name": n, "labels": {"kubernetes.io/metadata.name": n}}}) for n in namespaces},
            WEBHOOKS: {},
        }
        self._watchers: dict[str, list[asyncio.Queue[dict[str, Any]]]] = {NAMESPACES: [], WEBHOOKS: []}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()

    def _stamp(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        self._version += 1
        api_version, kind = KINDS[path]
        meta = obj.setdefault("metadata", {})
        meta.update(resourceVersion=str(self._version), uid=meta.get("uid") or f"uid-{meta['name']}")
        return {"apiVersion": api_version, "kind": kind, **obj}

    def set_webhooks(self, *configs: dict[str, Any]) -> None:
        """Replace the ValidatingWebhookConfigurations (watchers see ADDED, MODIFIED and DELETED)."""
        def change() -> None:
            old = self._objects[WEBHOOKS]
            new = {c["metadata"]["name"]: self._stamp(WEBHOOKS, copy.deepcopy(c)) for c in configs}
            events = [("MODIFIED" if n in old else "ADDED", o) for n, o in new.items()]
            events += [("DELETED", o) for n, o in old.items() if n not in new]
            self._objects[WEBHOOKS] = new
            for queue in self._watchers[WEBHOOKS]:
                for kind, obj in events:
                    queue.put_nowait({"type": kind, "object": obj})

        self._loop.call_soon_threadsafe(change)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path not in self._objects:
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
                                      "reason": "NotFound", "message": f"{path} is not served here"}, status=404)
        if request.query.get("watch") not in ("true", "1"):
            api_version, kind = KINDS[path]
            return web.json_response({"apiVersion": api_version, "kind": f"{kind}List",
                                      "metadata": {"resourceVersion": str(self._version)},
                                      "items": list(self._objects[path].values())})
        if request.query.get("sendInitialEvents") == "true":
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 400,
                                      "reason": "BadRequest", "message": "no watch-list here"}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._watchers[path].append(queue)
        try:
            while True:
                await response.write((json.dumps(await queue.get()) + "\n").encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers[path].remove(queue)
        return response

    def __enter__(self) -> AdmissionSource:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app)

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(runner.cleanup())

        self._thread = threading.Thread(target=serve, daemon=True, name="admission-source")
        self._thread.start()
        self._ready.wait(10)
        self.kubeconfig = self.workdir / "admission-source.kubeconfig"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "u", "user": {}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
