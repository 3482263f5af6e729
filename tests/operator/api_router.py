"""Test harness: one URL for the operator, two API servers behind it.

The real ``apiextensions-apiserver`` (real_apiserver.py) serves only CRDs, our group and kopf's peering; the
operator also needs core and apps objects (ConfigMaps, Services, Deployments, Events) and kopf
waits for a core ``namespaces`` resource in discovery. So requests for ``cosine.dev``, ``kopf.dev`` and
``apiextensions.k8s.io`` go to the real server (with the test client certificate), everything
else to the emulator (k8s_emulator.py), and the ``/apis`` group list is merged from both.
Responses are streamed, so watches pass through unchanged. Not a product: a test fixture.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

REAL_PREFIXES = ("/apis/cosine.dev", "/apis/kopf.dev", "/apis/apiextensions.k8s.io",
                 # other projects' CRDs the operator creates objects of (data/external-crds)
                 "/apis/inference.networking.k8s.io", "/apis/gateway.networking.k8s.io",
                 "/apis/leaderworkerset.x-k8s.io", "/apis/networking.gke.io", "/apis/networking.istio.io")
# kubectl validates manifests against the OpenAPI document; only the real server has one (with
# our CRDs' schemas in it; no core types, which these tests never apply through kubectl).
REAL_ONLY = (*REAL_PREFIXES, "/openapi")
# Hop-by-hop and length headers are the proxy's own business.
# accept-encoding too: the body is relayed as it comes, so ask upstream for it uncompressed.
_SKIP = {"content-length", "transfer-encoding", "connection", "content-encoding", "host", "accept-encoding"}


class ApiRouter:
    """Runs on 127.0.0.1 in a thread; ``url`` and ``kubeconfig`` for clients (plain HTTP)."""

    def __init__(self, emulator_url: str, real: Any, workdir: Path) -> None:
        self.emulator_url, self.real = emulator_url, real
        self.kubeconfig = workdir / "router.kubeconfig"
        self.requests: list[tuple[str, str]] = []  # (method, path) sent to the real server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _start(self) -> None:
        ctx = self.real.tls_context()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx), timeout=aiohttp.ClientTimeout(total=None)
        )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._route)
        # Watches never end by themselves: do not wait for them at shutdown.
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        await self._session.close()  # ends the relayed watches first
        await self._runner.cleanup()

    async def _route(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == "/apis" and request.method == "GET":
            return await self._merged_groups()
        real = path.startswith(REAL_ONLY)
        base = self.real.url if real else self.emulator_url
        if real:
            self.requests.append((request.method, path))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        if real:
            headers.pop("Authorization", None)  # the client certificate authenticates
        body = await request.read()
        async with self._session.request(
            request.method, base + path, params=request.query, headers=headers, data=body or None
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _SKIP},
            )
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def _merged_groups(self) -> web.Response:
        """The emulator's APIGroupList with its cosine.dev/apiextensions entries replaced by the
        real server's (which serves no ``/apis`` list, only ``/apis/<group>``). Plain
        APIGroupList only: clients asking for aggregated discovery fall back to it."""
        async with self._session.get(self.emulator_url + "/apis", headers={"Accept": "application/json"}) as r:
            groups = await r.json(content_type=None)
        real_names = {p.split("/")[2] for p in REAL_PREFIXES}
        groups["groups"] = [g for g in groups.get("groups", []) if g["name"] not in real_names]
        for name in sorted(real_names):
            async with self._session.get(f"{self.real.url}/apis/{name}", headers={"Accept": "application/json"}) as r:
                if r.status == 200:
                    groups["groups"].append(await r.json(content_type=None))
        return web.Response(text=json.dumps(groups), content_type="application/json")

    def __enter__(self) -> ApiRouter:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "router",
            "clusters": [{"name": "router", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "test-token"}}],
            "contexts": [{"name": "router",
                          "context": {"cluster": "router", "user": "tester", "namespace": "default"}}],
        }))
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
