"""CoSine's alerts as the chart renders them, run by Prometheus's own ``promtool`` (Debian's, cached:
``prometheus_tools.provision``): the rules parse, and every alert fires on one input series and
stays silent on another (``promtool test rules``). And the monitors carry the labels a
kube-prometheus-stack Prometheus selects them by."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from cosine_spec import metric_names
from prometheus_tools import provision
from test_chart import render

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = "https://example.com/runbooks.md"
VALUES = {"metrics": {"prometheusRule": {"enabled": True, "runbookUrl": RUNBOOK}}}
POOL = {"namespace": "prod", "pool": "code"}

# alert -> (interval, input series firing, input series silent, evaluation time, labels of the alert)
# Series values in promtool's expanding notation: "a+bxN" is a, a+b, ... N+1 samples at `interval`.
CASES: dict[str, tuple[str, dict[str, str], dict[str, str], str, dict[str, str]]] = {
    "CoSineAcceptanceCollapsed": (
        "1m",
        {'cosine_spec_decode_num_accepted_tokens_total{namespace="prod",pool="code",pod="v-1"}':
         "0+80x1440 115200+10x120",
         'cosine_spec_decode_num_draft_tokens_total{namespace="prod",pool="code",pod="v-1"}': "0+100x1560"},
        {'cosine_spec_decode_num_accepted_tokens_total{namespace="prod",pool="code",pod="v-1"}': "0+80x1560",
         'cosine_spec_decode_num_draft_tokens_total{namespace="prod",pool="code",pod="v-1"}': "0+100x1560"},
        "26h", POOL),
    "CoSineDraftsMostlyLate": (
        "1m",
        {'cosine_spec_decode_drafts_late_total{namespace="prod",pool="code",pod="v-1"}': "0+60x40",
         'cosine_spec_decode_num_drafts_total{namespace="prod",pool="code",pod="v-1"}': "0+20x40"},
        {'cosine_spec_decode_drafts_late_total{namespace="prod",pool="code",pod="v-1"}': "0+20x40",
         'cosine_spec_decode_num_drafts_total{namespace="prod",pool="code",pod="v-1"}': "0+60x40"},
        "35m", POOL),
    "CoSinePoolDown": (
        "1m",
        {'cosine_drafter_asks_skipped_total{namespace="prod",pool="code",reason="down",pod="v-1"}': "0+30x20"},
        {'cosine_drafter_asks_skipped_total{namespace="prod",pool="code",reason="yield",pod="v-1"}': "0+30x20"},
        "15m", POOL),
    "CoSinePoolTooSlow": (
        "1m",
        {'cosine_spec_decode_drafts_late_total{namespace="prod",pool="code",pod="v-1"}': "0+60x40",
         'cosine_spec_decode_num_drafts_total{namespace="prod",pool="code",pod="v-1"}': "0+20x40",
         'cosine_drafter_rounds_total{namespace="prod",pool="code",pod="d-1"}': "0+50x40",
         'cosine_drafter_batched_requests_total{namespace="prod",pool="code",pod="d-1"}': "0+55x40"},
        {'cosine_spec_decode_drafts_late_total{namespace="prod",pool="code",pod="v-1"}': "0+60x40",
         'cosine_spec_decode_num_drafts_total{namespace="prod",pool="code",pod="v-1"}': "0+20x40",
         'cosine_drafter_rounds_total{namespace="prod",pool="code",pod="d-1"}': "0+10x40",
         'cosine_drafter_batched_requests_total{namespace="prod",pool="code",pod="d-1"}': "0+80x40"},
        "35m", POOL),
    "CoSineVerifierQueueBuildingUp": (
        "1m",
        {'vllm:num_requests_waiting{namespace="prod",pod="v-1"}': "3+0x30"},
        {'vllm:num_requests_waiting{namespace="prod",pod="v-1"}': "3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3"},
        "20m", {"namespace": "prod", "pod": "v-1"}),
    "CoSineTPOTBudgetBurn": (
        "1m",
        {'vllm:inter_token_latency_seconds_bucket{namespace="prod",pod="v-1",le="0.1"}': "0+50x90",
         'vllm:inter_token_latency_seconds_count{namespace="prod",pod="v-1"}': "0+100x90"},
        {'vllm:inter_token_latency_seconds_bucket{namespace="prod",pod="v-1",le="0.1"}': "0+99.5x90",
         'vllm:inter_token_latency_seconds_count{namespace="prod",pod="v-1"}': "0+100x90"},
        "80m", {"namespace": "prod"}),
    "CoSineTPOTBudgetBurnSlow": (
        "5m",
        {'vllm:inter_token_latency_seconds_bucket{namespace="prod",pod="v-1",le="0.1"}': "0+460x100",
         'vllm:inter_token_latency_seconds_count{namespace="prod",pod="v-1"}': "0+500x100"},
        {'vllm:inter_token_latency_seconds_bucket{namespace="prod",pod="v-1",le="0.1"}': "0+498x100",
         'vllm:inter_token_latency_seconds_count{namespace="prod",pod="v-1"}': "0+500x100"},
        "7h", {"namespace": "prod"}),
    "CoSineOperatorDown": (
        "1m",
        {'up{job="other"}': "1+0x30"},
        {'cosine_operator_reconciles_total{event="resync",outcome="ok",pod="op-1"}': "0+1x30"},
        "20m", {}),
    "CoSineOperatorNotReconciling": (
        "1m",
        {'cosine_operator_reconciles_total{event="resync",outcome="ok",pod="op-1"}': "0+2x40 80+0x40"},
        {'cosine_operator_reconciles_total{event="resync",outcome="ok",pod="op-1"}': "0+2x80"},
        "75m", {}),
    "CoSineScrapeFailures": (
        "1m",
        {'cosine_operator_scrape_failures_total{role="drafter",pod="op-1"}': "0+2x40"},
        {'cosine_operator_scrape_failures_total{role="drafter",pod="op-1"}': "5+0x40"},
        "30m", {"role": "drafter"}),
}


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    return next(d for d in render(VALUES) if d["kind"] == "PrometheusRule")["spec"]["groups"]


def _alerts(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def _expand(template: str, labels: dict[str, str]) -> str:
    """Prometheus's expansion of the annotations' only template, ``{{ $labels.X }}``."""
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)


def test_every_alert_has_a_case_a_runbook_and_only_known_metrics(rules: list[dict[str, Any]]) -> None:
    """Catches: an alert with no promtool case, a runbook link to no section of docs/runbooks.md, a
    metric name that is neither CoSine's (cosine_spec.metric_names, the operator's) nor vLLM's."""
    alerts = _alerts(rules)
    assert set(alerts) == set(CASES)
    runbooks = (ROOT / "docs" / "runbooks.md").read_text().lower()
    known = {metric_names.total(v) for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}
    known |= {v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}
    known |= {"cosine_operator_reconciles_total", "cosine_operator_scrape_failures_total",
              "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_count"}
    for name, rule in alerts.items():
        url = rule["annotations"]["runbook_url"]
        assert url.startswith(RUNBOOK + "#"), url
        assert f"\n## {url.split('#')[1]}\n" in runbooks, name
        for metric in re.findall(r"\b(vllm:[a-z_:]+|cosine_[a-z_]+)", rule["expr"]):
            assert metric in known, (name, metric)


def test_promtool_fires_each_alert_on_its_case_and_never_on_the_other(rules: list[dict[str, Any]],
                                                                        tmp_path: Path) -> None:
    """Each alert against two inputs: one it must fire on (at the evaluation time, with the labels
    and annotations it is expected to carry), one it must not, in Prometheus's own rule-test
    runner."""
    tools = provision()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rules}))
    check = subprocess.run([str(tools.promtool), "check", "rules", str(tmp_path / "rules.yaml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    alerts = _alerts(rules)
    tests = []
    for name, (interval, firing, silent, at, labels) in CASES.items():
        rule = alerts[name]
        expected = {"exp_labels": {**labels, **rule["labels"]},
                    "exp_annotations": {k: _expand(v, labels) for k, v in rule["annotations"].items()}}
        for series, exp in ((firing, [expected]), (silent, [])):
            tests.append({"interval": interval, "input_series": [{"series": k, "values": v} for k, v in series.items()],
                          "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": exp}]})
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": tests}))
    run = subprocess.run([str(tools.promtool), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


def test_the_slo_and_its_burn_rates_come_from_the_values() -> None:
    """Catches: an SLO value that does not reach the expression (the alert watches another bucket)."""
    values = {"metrics": {"prometheusRule": {"enabled": True, "tpotSlo": {"seconds": "0.05", "objective": 0.999}}}}
    rule = next(d for d in render(values) if d["kind"] == "PrometheusRule")
    fast = _alerts(rule["spec"]["groups"])["CoSineTPOTBudgetBurn"]
    assert 'le="0.05"' in fast["expr"] and "> 0.0144" in fast["expr"] and "__" not in yaml.safe_dump(rule)
    assert "/blob/v" in _alerts(rule["spec"]["groups"])["CoSinePoolDown"]["annotations"]["runbook_url"]


def test_kube_prometheus_stacks_default_selector_picks_the_monitors_and_rules() -> None:
    """kube-prometheus-stack's Prometheus selects ServiceMonitors, PodMonitors and PrometheusRules by
    ``release: <its release name>`` (its values' *SelectorNilUsesHelmValues: true). With that label
    in the chart's values, every monitor and the rule carry it, and the operator's ServiceMonitor
    looks in the release's namespace only."""
    selector = {"release": "kps"}
    values = {"metrics": {key: {"enabled": True, "labels": selector}
                          for key in ("serviceMonitor", "podMonitor", "prometheusRule")}}
    objs = {d["kind"]: d for d in render(values)
            if d["kind"] in ("ServiceMonitor", "PodMonitor", "PrometheusRule")}
    assert set(objs) == {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    for obj in objs.values():
        labels = obj["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in selector.items()), obj["kind"]
    assert objs["ServiceMonitor"]["spec"]["namespaceSelector"] == {"matchNames": ["cosine-system"]}
    assert objs["PodMonitor"]["spec"]["namespaceSelector"] == {"any": True}


# The Prometheus Operator's objects (monitoring.coreos.com/v1), the fields the chart uses, from the
# operator's API reference for v0.80 (prometheus-operator.dev/docs/api-reference/api/): no package
# registry reachable here ships its CRDs, so this is written from the reference, not taken from it.
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"], "additionalProperties": False,
        "properties": {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                       "values": {"type": "array", "items": {"type": "string"}}}}}}}
_NAMESPACES = {"type": "object", "additionalProperties": False, "properties": {
    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}}
_DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                          "(([0-9]+)s)?(([0-9]+)ms)?)$"}
_ENDPOINT = {"type": "object", "additionalProperties": False, "properties": {
    "port": {"type": "string"}, "path": {"type": "string"}, "interval": _DURATION, "scheme": {"type": "string"},
    "honorLabels": {"type": "boolean"}}}
_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string"}, "namespace": {"type": "string"},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}}}}
PROMETHEUS_OPERATOR_0_80 = {
    "ServiceMonitor": {"type": "object", "required": ["spec"], "properties": {"metadata": _META, "spec": {
        "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
        "properties": {"namespaceSelector": _NAMESPACES, "selector": _SELECTOR,
                       "endpoints": {"type": "array", "items": _ENDPOINT}}}}},
    "PodMonitor": {"type": "object", "required": ["spec"], "properties": {"metadata": _META, "spec": {
        "type": "object", "required": ["selector"], "additionalProperties": False,
        "properties": {"namespaceSelector": _NAMESPACES, "selector": _SELECTOR,
                       "podMetricsEndpoints": {"type": "array", "items": _ENDPOINT}}}}},
    "PrometheusRule": {"type": "object", "required": ["spec"], "properties": {"metadata": _META, "spec": {
        "type": "object", "additionalProperties": False, "properties": {"groups": {"type": "array", "items": {
            "type": "object", "required": ["name", "rules"], "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "interval": _DURATION, "rules": {"type": "array", "items": {
                "type": "object", "required": ["expr"], "additionalProperties": False,
                "properties": {"alert": {"type": "string"}, "record": {"type": "string"}, "expr": {"type": "string"},
                               "for": _DURATION,
                               "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                               "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}}}}}}}}},
}


def test_the_monitors_and_the_rule_validate_against_the_prometheus_operators_api() -> None:
    """Catches: a field the Prometheus Operator's CRDs would prune or refuse (a typo, a wrong type,
    a duration Prometheus cannot parse) in what the chart renders with everything on."""
    import jsonschema

    kinds = ("serviceMonitor", "podMonitor", "prometheusRule")
    values = {"watchNamespaces": ["team-a"],
              "metrics": {key: {"enabled": True, "labels": {"release": "kps"}} for key in kinds}}
    for values_ in (values, {"metrics": {key: {"enabled": True} for key in ("serviceMonitor", "podMonitor")}}):
        objs = [d for d in render(values_) if d["kind"] in PROMETHEUS_OPERATOR_0_80]
        assert objs
        for obj in objs:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            jsonschema.validate(obj, PROMETHEUS_OPERATOR_0_80[obj["kind"]])
