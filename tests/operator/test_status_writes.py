"""Status has one write per writer per pass, and concurrent writers both land (``handlers._write_status``)
against the API emulator's resourceVersion preconditions. No operator runs in this module: the
two writers below are the only ones."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from k8s_emulator import CLUSTERS, DEPLOYMENTS, EmulatorThread, Kube
from test_handlers import NS, cluster_body, condition, mark_ready


def with_api(emulator: EmulatorThread, body: Callable[[Any], Awaitable[None]]) -> None:
    """Run ``body(api)`` on a client of the emulator (``KUBECONFIG`` set for it, then restored)."""
    import asyncio
    import os

    from cosine_operator import kube as k

    async def run() -> None:
        api = await k.connect()
        try:
            await body(api)
        finally:
            await api.close()

    saved = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(emulator.kubeconfig)
    try:
        asyncio.run(run())
    finally:
        if saved is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = saved


def test_concurrent_status_writers_both_land(emulator: EmulatorThread, kube: Kube) -> None:
    """Reconcile (children conditions) and the autoscaler (``ScalingActive``) write status at once,
    each from the status it read: both land, one after the other's conflict (HTTP 409 on the
    resourceVersion it read) and a retry. Catches: a status patch without the precondition, which
    keeps the last writer's conditions list and loses the other's."""
    import asyncio

    from cosine_operator import handlers, status

    kube.create(CLUSTERS, NS, cluster_body("kappa"))  # no operator runs here: only the two writers
    start = len(emulator.emulator.patches)  # type: ignore[union-attr]

    def writer(type_: str):  # noqa: ANN202
        def update(live: dict[str, Any]) -> dict[str, Any]:
            mine = status.condition(type_, True, "Test", type_, 1, "2026-01-01T00:00:00Z")
            return {"conditions": status.merge_conditions(live.get("conditions"), [mine])}
        return update

    async def both(api: Any) -> None:
        await asyncio.gather(handlers._write_status(api, "kappa", NS, writer("Ready")),
                             handlers._write_status(api, "kappa", NS, writer("ScalingActive")))

    with_api(emulator, both)
    assert condition(kube, "kappa", "Ready") and condition(kube, "kappa", "ScalingActive")
    status_patches = [p for p in emulator.emulator.patches[start:] if p[1] == "kappa" and p[2] == "status"]
    assert len(status_patches) == 3, "the second writer conflicted once, then landed"


def test_a_status_write_says_what_the_children_say_when_it_lands(emulator: EmulatorThread, kube: Kube) -> None:
    """Two Deployment events' status writers: the first builds its update while the ngram pool is not
    ready, the pool becomes ready, the second writes, then the first: the status still says 2/2 and
    Ready. Catches: the children read once, before the write (CI saw a cluster left at ``1/2``
    drafters and not Ready, both pools ready, until the next resync)."""

    from cosine_spec.cluster_spec import parse_cluster_spec

    from cosine_operator import handlers

    body = cluster_body("lambda")
    kube.create(CLUSTERS, NS, body)  # no operator runs here: the Deployments are made by hand
    for name in ("lambda-verifier", "lambda-drafter-code", "lambda-drafter-ngram"):
        kube.create(DEPLOYMENTS, NS, {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "metadata": {"name": name, "namespace": NS}, "spec": {"replicas": 1}})
    for name in ("lambda-verifier", "lambda-drafter-code"):
        mark_ready(kube, name)
    cluster = parse_cluster_spec(body["spec"])

    async def interleaved(api: Any) -> None:
        first = handlers._children_status(api, "lambda", NS, 1, cluster)
        mark_ready(kube, "lambda-drafter-ngram")
        await handlers._write_status(api, "lambda", NS, handlers._children_status(api, "lambda", NS, 1, cluster))
        await handlers._write_status(api, "lambda", NS, first)

    with_api(emulator, interleaved)
    assert kube.get(CLUSTERS, NS, "lambda")["status"]["drafters"]["ready"] == "2/2"
    assert condition(kube, "lambda", "Ready")["status"] == "True"
