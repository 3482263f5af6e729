"""High availability: two operator processes, started with the arguments the chart renders, on
Kubernetes' CRD server (``KopfPeering`` is a CRD there like ours; children on the emulator).

kopf pauses every operator that sees a live peer of higher *or equal* priority
(``kopf/_core/engines/peering.py``): the chart's replicas share their arguments, so each takes its
priority from its pod's name (``POD_ID``, :func:`cosine_operator.__main__.peering_priority`).
Asserted: exactly one process reconciles (the other logs that it pauses in its favour and handles
nothing); when the active one stops cleanly the standby reconciles a new cluster at once (kopf
removes a stopping replica's peering record); a replica of higher priority that joins takes over;
and after it is SIGKILLed (its record stays until its lifetime runs out) the standby reconciles a
new cluster within the chart's peering lifetime plus a margin. Only what cannot run on one machine
is changed from the chart: the ports (processes on one host), the webhook certificate's path and
the downward API's values; and the chart is rendered with a shorter peering lifetime (a value).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kube_api
import pytest
from api_router import ApiRouter
from k8s_emulator import CONFIGMAPS, DEPLOYMENTS, Kube, wait_for
from test_chart import render
from test_crds_real import apply_crds
from test_handlers import cluster_body

from cosine_operator.__main__ import peering_priority

pytestmark = pytest.mark.real_apiserver

NS = "default"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The chart's peering lifetime (`peering.lifetimeSeconds`), set lower than its default 30 s: the
# SIGKILL hand-over waits it out, and nothing else here depends on it.
PEERING_LIFETIME_S = 15


def _chart_operator() -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """The chart's operator container (command + args, env) and its peering object."""
    docs = render({"peering": {"lifetimeSeconds": PEERING_LIFETIME_S}})
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    peering = next(d for d in docs if d["kind"] == "ClusterKopfPeering")
    return [*container["command"], *container["args"]], {e["name"]: e for e in container["env"]}, peering


class _Replica:
    """One operator process as the chart runs it, as pod ``pod``."""

    def __init__(self, pod: str, command: list[str], env: dict[str, Any], kubeconfig: Path, certs: Path,
                 log: Path) -> None:
        self.pod, self.log = pod, log
        values = {"POD_ID": pod, "COSINE_OPERATOR_NAMESPACE": "cosine-system"}
        own = {}
        for name, entry in env.items():
            own[name] = values[name] if "valueFrom" in entry else str(entry["value"])
        self.metrics_port = _free_port()
        own.update(COSINE_OPERATOR_METRICS_PORT=str(self.metrics_port), COSINE_OPERATOR_WEBHOOK_PORT=str(_free_port()),
                   COSINE_OPERATOR_WEBHOOK_CERT_DIR=str(certs))
        args = [f"--liveness=http://127.0.0.1:{_free_port()}/healthz" if a.startswith("--liveness=") else a
                for a in command[1:]]
        exe = str(Path(sys.executable).with_name(command[0]))
        full_env = {**os.environ, **own, "KUBECONFIG": str(kubeconfig)}
        full_env.pop("KUBERNETES_SERVICE_HOST", None)
        self.proc = subprocess.Popen([exe, *args], env=full_env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def handled(self, handler: str) -> bool:
        return f"Handler '{handler}' succeeded" in self.text()

    def acting(self) -> bool:
        """Whether kopf has let this replica act. kopf starts every peered operator paused and logs
        only transitions (``kopf/_core/engines/peering.py``): "Resuming …" when it finds no peer of
        higher or equal priority, "Pausing operations in favour of …" when one appears after that. A
        replica that sees its superior in its first peering event pauses silently."""
        text = self.text()
        return text.rfind("Resuming operations after the pause") > text.rfind("Pausing operations in favour of")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def router(routed: ApiRouter) -> ApiRouter:
    apply_crds(routed)
    kube_api.wait_established(routed, "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev")
    return routed


@pytest.fixture
def chart(router: ApiRouter, tmp_path: Path) -> Iterator[Any]:
    """Starts operator processes as the chart's pods (``chart(pod_name)``); stops them all after."""
    command, env, peering = _chart_operator()
    kube_api.apply(router, peering, validation="Ignore")
    certs = tmp_path / "webhook"
    certs.mkdir()
    shutil.copy(router.real.certs["server.crt"], certs / "tls.crt")
    shutil.copy(router.real.certs["server.key"], certs / "tls.key")
    started: list[_Replica] = []

    def start(pod: str) -> _Replica:
        started.append(_Replica(pod, command, env, router.kubeconfig, certs, tmp_path / f"{pod}.log"))
        return started[-1]

    start.lifetime_s = int(env["COSINE_OPERATOR_PEERING_LIFETIME_S"]["value"])  # type: ignore[attr-defined]
    start.peering = peering["metadata"]["name"]  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        for replica in started:
            replica.stop()


def _pods_by_priority(n: int) -> list[str]:
    """``n`` pod names of the chart's Deployment, highest peering priority first."""
    names = [f"cosine-cosine-operator-7c9d5-{i:05d}" for i in range(n)]
    return sorted(names, key=peering_priority, reverse=True)


def _peers(router: ApiRouter, peering: str) -> set[str]:
    """The live peers' ids (``POD_ID``) in the cluster's peering object."""
    out = kube_api.get(router, f"/apis/kopf.dev/v1/clusterkopfpeerings/{peering}")
    assert out is not None, peering
    return set(out.get("status") or {})


def _settled(router: ApiRouter, peering: str, acting: _Replica, paused: list[_Replica]) -> bool:
    """Every replica's record is in the peering object, ``acting`` acts and the others do not."""
    pods = {acting.pod, *(p.pod for p in paused)}
    return pods <= _peers(router, peering) and acting.acting() and not any(p.acting() for p in paused)


def _create(router: ApiRouter, name: str) -> None:
    kube_api.apply(router, cluster_body(name), validation="Ignore")


def test_one_replica_acts_and_the_standby_takes_over(chart: Any, router: ApiRouter) -> None:
    kube = Kube(router.url)
    first, second, third = _pods_by_priority(3)  # third < second < first
    active, standby = chart(first), chart(third)
    wait_for(lambda: _settled(router, chart.peering, active, [standby]), timeout_s=60,
             what=f"one replica acting, the standby paused; logs: {active.log}, {standby.log}")
    time.sleep(1)  # peering events arrive in order: a standby that would act has logged it by now
    assert not standby.acting(), standby.text()[-3000:]
    _create(router, "ha1")
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "ha1-verifier"), timeout_s=60, what="ha1 reconciled")
    wait_for(lambda: active.handled("cosinecluster_create"), what="the active one's handler")
    time.sleep(3)
    # exactly one acted: the standby ran no handler, wrote no status, created nothing
    assert not standby.handled("cosinecluster_create"), standby.text()[-3000:]
    assert "Pausing all operators, including self" not in active.text() + standby.text()
    assert kube.get(CONFIGMAPS, NS, "ha1-config")["metadata"]["resourceVersion"]

    # a clean stop (rollout, drain): the replica removes its peering record; the standby acts at once
    active.stop()
    stopped_s = time.monotonic()
    _create(router, "ha2")
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "ha2-verifier"), timeout_s=20, what="hand-over on a clean stop")
    assert standby.acting()
    print(f"failover after a clean stop: {time.monotonic() - stopped_s:.1f} s")

    # a replica with a higher priority joins (a rollout's new pod) and takes over; SIGKILL it: the
    # standby waits out its peering record's lifetime
    newer = chart(second)
    wait_for(lambda: _settled(router, chart.peering, newer, [standby]), timeout_s=60,
             what=f"the standby pausing for the newer replica; logs: {newer.log}, {standby.log}")
    _create(router, "ha3")
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "ha3-verifier"), timeout_s=60, what="ha3 reconciled")
    wait_for(lambda: newer.handled("cosinecluster_create"), what="the newer replica's handler")
    newer.proc.send_signal(signal.SIGKILL)
    newer.proc.wait()
    killed_s = time.monotonic()
    _create(router, "ha4")
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "ha4-verifier"), timeout_s=chart.lifetime_s + 30,
             what=f"the standby taking over; its log: {standby.log}")
    took_s = time.monotonic() - killed_s
    wait_for(lambda: standby.text().count("Handler 'cosinecluster_create' succeeded") >= 2,
             what="the standby's handler")
    print(f"failover after SIGKILL: {took_s:.1f} s (peering lifetime {chart.lifetime_s} s)")
    assert took_s <= chart.lifetime_s + 15


def test_prometheus_2_and_3_read_every_operator_panel_and_alert_series(chart: Any, router: ApiRouter,
                                                                      tmp_path: Path) -> None:
    """A real operator process, as the chart runs it, reconciling a cluster, scraped by Debian's
    Prometheus 2.42 and 3.x side by side (`prometheus_tools`), as the chart's ServiceMonitor labels
    it (its job, namespace), with the chart's rules loaded: every query of the operator dashboard
    returns a series on both, every operator series an alert reads exists (failure-only counters
    at zero), no CoSine series is stored under a `cosine:` name, and the operator-down alert is
    silent while the operator is up. Catches: a name a server's scrape rewrites, a counter that
    exists only once something failed (an empty panel or a silent alert on a healthy operator)."""
    import importlib.util
    import re

    import httpx
    import yaml
    from prometheus_tools import chart_rules, servers_2_and_3

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("dashboards", root / "tools" / "dashboards.py")
    dashboards = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("dashboards", dashboards)
    spec.loader.exec_module(dashboards)
    (pod,) = _pods_by_priority(1)
    operator = chart(pod)
    kube = Kube(router.url)
    _create(router, "prom1")
    wait_for(lambda: kube.get(DEPLOYMENTS, NS, "prom1-verifier"), timeout_s=90, what=f"reconciled; log {operator.log}")
    job = "operator"
    groups = chart_rules(job, "cosine-system/cosine-workloads")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "rules.yaml")],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{operator.metrics_port}"]}],
                            "relabel_configs": [{"target_label": "namespace", "replacement": "cosine-system"}]}]}))
    try:
        with servers_2_and_3(tmp_path) as servers:
            def scraped(api: str) -> bool:
                try:
                    targets = httpx.get(f"{api}/targets", timeout=2).json()["data"]["activeTargets"]
                except (httpx.HTTPError, ValueError, KeyError):
                    return False
                return bool(targets) and all(t["health"] == "up" for t in targets)

            for _, api, _ in servers:
                wait_for(lambda api=api: scraped(api), timeout_s=60, what="the operator scraped")
            time.sleep(4)  # a few scrapes, and the rules evaluated on them
            checks = [(title, q.replace("$namespace", ".*").replace("$cluster", ".*").replace("$pool", ".*"))
                      for title, q in dashboards.queries("cosine-operator")]
            operator_rules = [r for g in groups for r in g["rules"] if "cosine_operator_" in r.get("expr", "")
                              or "__OPERATOR" in r.get("expr", "") or r.get("alert", "").startswith("CoSineOperator")]
            named = set(re.findall(r"cosine_operator_[a-z_]+", "\n".join(r["expr"] for r in operator_rules)))
            empty = []
            for version, api, _ in servers:
                for title, q in checks:
                    result = httpx.get(f"{api}/query", params={"query": q}).json()
                    assert result["status"] == "success", (version, title, result)
                    if not result["data"]["result"]:
                        empty.append((version, title, q))
                names = set(httpx.get(f"{api}/label/__name__/values").json()["data"])
                missing = {n for n in named if n not in names and f"{n}_total" not in names
                           and not any(x.startswith(n + "_") for x in names)}
                assert not missing, (version, sorted(missing))
                assert not {n for n in names if n.startswith("cosine:")}, version
                firing = httpx.get(f"{api}/alerts").json()["data"]["alerts"]
                assert not [a for a in firing if a["labels"]["alertname"] == "CoSineOperatorDown"], (version, firing)
            assert not empty, empty
    finally:
        kube_api.delete(router, f"/apis/cosine.dev/v1alpha1/namespaces/{NS}/cosineclusters/prom1")
