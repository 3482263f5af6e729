"""The chart's scrape objects against what they scrape and what reads them: every pod of a CoSineCluster
that serves metrics is selected (the endpoint picker among them), on the Prometheus Operator and on
GKE's Managed Service for Prometheus (GMP, prometheus-engine's monitoring.googleapis.com/v1), whose
objects are held to prometheus-engine's API and to its rules on protected labels."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import pytest
from cosine_spec.cluster_spec import parse_cluster_spec
from cosine_spec.contract import CLUSTER_LABEL, COMPONENT_LABEL, METRIC_CLUSTER_LABEL
from test_chart import render

from cosine_operator.builders.inventory import build_children

SPEC: dict[str, Any] = {
    "verifier": {"model": "qwen2.5-coder-1.5b-instruct"},
    "drafterPools": [{"name": "code", "model": "qwen2.5-coder-0.5b-instruct"}],
    "router": {"enabled": True, "gatewayName": "gw"},
}
ON = {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
GMP = {"metrics": {"provider": "gmp", **ON}}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes' label selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        if (op == "In" and value not in e["values"]) or (op == "NotIn" and value in e["values"]) or \
                (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


def _workloads_monitor(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The chart's monitor of the clusters' pods: its selector and the port names it scrapes."""
    (monitor,) = [d for d in render(values) if d["kind"] in ("PodMonitor", "ClusterPodMonitoring", "PodMonitoring")
                  and d["metadata"]["name"].endswith("-workloads")]
    endpoints = monitor["spec"].get("podMetricsEndpoints") or monitor["spec"]["endpoints"]
    return monitor["spec"]["selector"], [e["port"] for e in endpoints]


@pytest.mark.parametrize("values", [{"metrics": ON}, GMP], ids=["prometheus-operator", "gmp"])
def test_every_pod_that_serves_metrics_is_scraped(values: dict[str, Any]) -> None:
    """Catches: a component whose pods serve /metrics on a `metrics` port but which the workloads'
    monitor does not select, as the endpoint picker (component `router`) was: no picker series at
    all. Every Deployment the operator builds for a cluster with spec.router, against the chart's
    monitor: each with a `metrics` container port is selected, on a port the monitor scrapes."""
    selector, ports = _workloads_monitor(values)
    deployments = [c for c in build_children("demo", "ns", parse_cluster_spec(SPEC), {}) if c["kind"] == "Deployment"]
    serving = 0
    for d in deployments:
        template = d["spec"]["template"]
        named = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        if "metrics" in named:
            serving += 1
            assert _selects(selector, template["metadata"]["labels"]), d["metadata"]["name"]
            assert named & set(ports), (d["metadata"]["name"], named, ports)
    components = {d["spec"]["template"]["metadata"]["labels"][COMPONENT_LABEL] for d in deployments}
    assert serving == len(deployments) and components == {"verifier", "drafter", "router"}, components


# prometheus-engine's API (monitoring.googleapis.com/v1), the fields the chart uses, written from
# pkg/operator/apis/monitoring/v1/pod_types.go and rules_types.go at commit 2ffde4ec7 (July 2026):
# no package registry reachable here ships its CRDs. Its CEL and webhook checks are below, as code.
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"], "additionalProperties": False,
        "properties": {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                       "values": {"type": "array", "items": {"type": "string"}}}}}}}
_ENDPOINT = {"type": "object", "required": ["port", "interval"], "additionalProperties": False, "properties": {
    "port": {"type": ["string", "integer"]}, "scheme": {"enum": ["http", "https"]}, "path": {"type": "string"},
    "interval": {"type": "string", "pattern": r"^((\d+)(y|w|d|h|m|s|ms))+$"}}}
_METADATA = ["container", "node", "pod", "top_level_controller_name", "top_level_controller_type"]
_MAPPING = {"type": "object", "required": ["from"], "additionalProperties": False, "properties": {
    "from": {"type": "string"}, "to": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}}}


def _scrape(metadata: list[str]) -> dict[str, Any]:
    return {"type": "object", "required": ["spec"], "properties": {"spec": {
        "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False, "properties": {
            "selector": _SELECTOR, "endpoints": {"type": "array", "minItems": 1, "maxItems": 10, "items": _ENDPOINT},
            "targetLabels": {"type": "object", "additionalProperties": False, "properties": {
                "metadata": {"type": "array", "uniqueItems": True, "items": {"enum": metadata}},
                "fromPod": {"type": "array", "items": _MAPPING}}}}}}}


_RULE = {"type": "object", "required": ["expr"], "additionalProperties": False, "properties": {
    "record": {"type": "string", "pattern": "^[a-zA-Z_:][a-zA-Z0-9_:]*$"}, "alert": {"type": "string"},
    "expr": {"type": "string"}, "for": {"type": "string"},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}
PROMETHEUS_ENGINE = {
    "PodMonitoring": _scrape(_METADATA),
    "ClusterPodMonitoring": _scrape(sorted([*_METADATA, "namespace"])),
    "ClusterRules": {"type": "object", "required": ["spec"], "properties": {"spec": {
        "type": "object", "required": ["groups"], "additionalProperties": False, "properties": {"groups": {
            "type": "array", "items": {"type": "object", "required": ["name", "rules"], "additionalProperties": False,
                                       "properties": {"name": {"type": "string"}, "interval": {"type": "string"},
                                                      "rules": {"type": "array", "minItems": 1, "items": _RULE}}}}}}}},
}
# pod_config.go's protectedLabel: no relabelling (fromPod's `to` among them) may write these
PROTECTED = {"project_id", "location", "cluster", "namespace", "job", "instance", "__address__"}


@pytest.mark.parametrize("watch", [[], ["team-a", "team-b"]], ids=["cluster-wide", "namespaced"])
def test_gmp_objects_hold_to_prometheus_engines_api(watch: list[str]) -> None:
    """Catches: a Managed Prometheus object its CRD or webhook refuses: a field it prunes, a metadata
    label the kind does not allow (`namespace` on a PodMonitoring, which always sets it), a pod label
    relabelled onto a protected label (`cluster`: GMP stamps the GKE cluster's name there), a scrape
    of the clusters' pods that would not reach every watched namespace (a PodMonitoring selects its
    own namespace's pods only). And no monitoring.coreos.com object on that provider."""
    objs = render({**GMP, "watchNamespaces": watch})
    assert not [d for d in objs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    gmp = [d for d in objs if d["apiVersion"] == "monitoring.googleapis.com/v1"]
    for obj in gmp:
        jsonschema.validate(obj, PROMETHEUS_ENGINE[obj["kind"]])
        for mapping in obj["spec"].get("targetLabels", {}).get("fromPod", []):
            assert mapping["to"] not in PROTECTED, mapping
    workloads = [d for d in gmp if d["metadata"]["name"] == "cosine-cosine-operator-workloads"]
    if watch:
        assert [(d["kind"], d["metadata"]["namespace"]) for d in workloads] == [("PodMonitoring", n) for n in watch]
    else:
        assert [d["kind"] for d in workloads] == ["ClusterPodMonitoring"]
        assert "namespace" not in workloads[0]["metadata"]  # cluster-scoped
        assert "namespace" in workloads[0]["spec"]["targetLabels"]["metadata"]  # else no `namespace` on its series
    for d in workloads:
        assert {(m["from"], m["to"]) for m in d["spec"]["targetLabels"]["fromPod"]} == {
            (CLUSTER_LABEL, METRIC_CLUSTER_LABEL), (COMPONENT_LABEL, "component")}
        assert "pod" in d["spec"]["targetLabels"]["metadata"]  # the runbooks and alerts name pods
    (operator,) = [d for d in gmp if d["kind"] == "PodMonitoring" and d["metadata"]["name"] == "cosine-cosine-operator"]
    assert operator["metadata"]["namespace"] == "cosine-system"
    assert operator["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "cosine"


def test_gmp_rules_are_the_prometheus_rules_and_watch_its_jobs() -> None:
    """Catches: ClusterRules that differ from the PrometheusRule's groups, or watch the Prometheus
    Operator's job names (a PodMonitor's <namespace>/<name>) where GMP names a target's job after its
    PodMonitoring or ClusterPodMonitoring; a rule on `cluster`, which ClusterRules' scoping sets to the
    GKE cluster on every query and every result (prometheus-engine's rules_config.go)."""
    (rules,) = [d for d in render(GMP) if d["kind"] == "ClusterRules"]
    (coreos,) = [d for d in render({"metrics": ON}) if d["kind"] == "PrometheusRule"]
    text = str(rules["spec"])
    assert 'up{job="cosine-cosine-operator", namespace="cosine-system"}' in text
    assert 'up{job="cosine-cosine-operator-workloads", component="verifier"}' in text
    expected = str(coreos["spec"]).replace("cosine-system/cosine-cosine-operator-workloads",
                                           "cosine-cosine-operator-workloads")
    assert text == expected
    exprs = [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]]
    assert exprs and not [e for e in exprs if re.search(r"(?<![\w])cluster\b", e)]
