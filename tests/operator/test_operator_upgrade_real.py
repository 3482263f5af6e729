"""An upgrade from the previous release's chart never has two operators acting: operator processes
started with the previous chart's arguments (one ``--standalone`` replica:
``data/chart-previous/operator-deployment.yaml``) and this chart's (``--peering``, two replicas), in
the order Kubernetes' Deployment controller runs the new Deployment's ``strategy``, on Kubernetes'
CRD server (children on the emulator).

A standalone operator never looks for peers, so a peering replica started beside it (a rolling
update's surge) acts too: both reconcile every cluster. After each step of the rollout a new
CoSineCluster is created and exactly one process may handle it. Both run this release's code: what
changes between the releases here is the arguments and the strategy, which is what decides the
overlap. Ports, the webhook certificate and the downward API's values are set as in
``test_peering_real.py``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kube_api
import pytest
import yaml
from api_router import ApiRouter
from k8s_emulator import DEPLOYMENTS, Kube, wait_for
from test_chart import render
from test_crds_real import apply_crds
from test_handlers import cluster_body
from test_peering_real import _peers, _Replica

from cosine_operator.__main__ import peering_priority

pytestmark = pytest.mark.real_apiserver

NS = "default"
PREVIOUS = Path(__file__).parent / "data" / "chart-previous" / "operator-deployment.yaml"


def _operator(deployment: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """A Deployment's operator container: command + args, env by name."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return [*container["command"], *container["args"]], {e["name"]: e for e in container["env"]}


def rollout(strategy: dict[str, Any], old: list[str], new: list[str]) -> list[tuple[str, str]]:
    """``("stop" | "start", pod)`` in the order the Deployment controller replaces ``old`` pods by
    ``new`` ones under ``strategy`` (apps/v1 DeploymentStrategy): ``Recreate`` stops every old pod
    before it starts a new one; ``RollingUpdate`` first starts as many new pods as ``maxSurge``
    allows beyond the new replica count (``maxUnavailable: 0``: none old stops before), then stops
    the old ones and starts the rest."""
    if strategy["type"] == "Recreate":
        return [("stop", p) for p in old] + [("start", p) for p in new]
    surge = int((strategy.get("rollingUpdate") or {}).get("maxSurge", 1))
    first = max(0, min(len(new), len(new) + surge - len(old)))
    return [("start", p) for p in new[:first]] + [("stop", p) for p in old] + [("start", p) for p in new[first:]]


def test_rollout_order_follows_the_strategy() -> None:
    assert rollout({"type": "Recreate"}, ["a"], ["b", "c"]) == [("stop", "a"), ("start", "b"), ("start", "c")]
    assert rollout({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                   ["a"], ["b", "c"]) == [("start", "b"), ("start", "c"), ("stop", "a")]


@pytest.fixture(scope="module")
def router(routed: ApiRouter) -> ApiRouter:
    apply_crds(routed)
    kube_api.wait_established(routed, "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev")
    return routed


@pytest.fixture
def processes(router: ApiRouter, tmp_path: Path) -> Iterator[dict[str, _Replica]]:
    """The operator processes started so far, by pod name; all stopped after the test."""
    running: dict[str, _Replica] = {}
    try:
        yield running
    finally:
        for replica in running.values():
            replica.stop()


def _acting(replica: _Replica, standalone: bool) -> bool:
    """A standalone operator acts while it runs; a peering one while kopf has not paused it."""
    return replica.proc.poll() is None and (standalone or replica.acting())


def _created(replica: _Replica, name: str) -> bool:
    """Whether ``replica`` ran the create handler of cluster ``name`` (kopf's JSON log lines carry the
    object's reference)."""
    for line in replica.text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (record.get("message", "").startswith("Handler 'cosinecluster_create' succeeded")
                and (record.get("object") or {}).get("name") == name):
            return True
    return False


def test_an_upgrade_from_the_previous_chart_never_has_two_operators_acting(router: ApiRouter, tmp_path: Path,
                                                                          processes: dict[str, _Replica]) -> None:
    """Catches: a strategy that starts the new release's peering replicas while the previous
    release's standalone one still runs (the chart's RollingUpdate before 0.2: both reconciled)."""
    previous = yaml.safe_load(PREVIOUS.read_text())
    docs = render()
    current = next(d for d in docs if d["kind"] == "Deployment")
    peering = next(d for d in docs if d["kind"] == "ClusterKopfPeering")
    kube_api.apply(router, peering, validation="Ignore")
    certs = tmp_path / "webhook"
    certs.mkdir()
    shutil.copy(router.real.certs["server.crt"], certs / "tls.crt")
    shutil.copy(router.real.certs["server.key"], certs / "tls.key")
    old_command, old_env = _operator(previous)
    new_command, new_env = _operator(current)
    assert "--standalone" in old_command and previous["spec"]["replicas"] == 1
    assert any(a.startswith("--peering=") for a in new_command) and current["spec"]["replicas"] == 2
    standalone = {"cosine-cosine-operator-5c8f7-00000"}
    new = sorted((f"cosine-cosine-operator-7d4b9-{i:05d}" for i in range(2)), key=peering_priority, reverse=True)

    def start(pod: str) -> None:
        command, env = (old_command, old_env) if pod in standalone else (new_command, new_env)
        processes[pod] = _Replica(pod, command, env, router.kubeconfig, certs, tmp_path / f"{pod}.log")

    def settled() -> bool:
        """Every running peering replica registered, the highest-priority one acting, the others not."""
        peers = [p for p in new if p in processes and processes[p].proc.poll() is None]
        if not peers:
            return True
        return (set(peers) <= _peers(router, peering["metadata"]["name"]) and processes[peers[0]].acting()
                and not any(processes[p].acting() for p in peers[1:]))

    kube = Kube(router.url)
    handled: dict[str, list[str]] = {}
    steps = [("start", next(iter(standalone))), *rollout(current["spec"]["strategy"], sorted(standalone), new)]
    for i, (action, pod) in enumerate(steps):
        if action == "start":
            start(pod)
        else:
            processes[pod].stop()
        if not any(r.proc.poll() is None for r in processes.values()):
            continue  # no operator at all: nothing can act
        wait_for(settled, timeout_s=60, what=f"peering settled after {action} {pod}")
        acting = [p for p, r in processes.items() if _acting(r, p in standalone)]
        name = f"upgrade{i}"
        kube_api.apply(router, cluster_body(name), validation="Ignore")
        wait_for(lambda name=name: kube.get(DEPLOYMENTS, NS, f"{name}-verifier")
                 and any(_created(r, name) for r in processes.values()), timeout_s=60,
                 what=f"{name} reconciled after {action} {pod}")
        time.sleep(5)  # a second operator acting has handled it by now too
        handled[name] = [p for p, r in processes.items() if _created(r, name)]
        assert len(acting) == 1 and len(handled[name]) == 1, (action, pod, acting, handled)
    print(f"rollout {[f'{a} {p}' for a, p in steps]}: handled by {handled}")
    for name in handled:
        kube_api.delete(router, f"{kube_api.resource_path(router, 'cosine.dev/v1alpha1', 'CoSineCluster')}/{name}")
