"""CoSine's alerts as the chart renders them, run by Prometheus's own ``promtool`` (Debian's 2.42 and
3.x, cached: ``prometheus_tools.provision_all``): the rules parse, and every alert fires on one input series and
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
from cosine_spec.contract import CLUSTER_LABEL, COMPONENT_LABEL, METRIC_CLUSTER_LABEL
from prometheus_tools import provision_all
from test_chart import render

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = "https://example.com/runbooks.md"
# every rule ships with both monitors on (each group only with the scrape its series come from:
# test_each_wiring_ships_the_alerts_its_scrapes_can_fire_and_fires_none_when_healthy)
MONITORS = {"operator": "serviceMonitor", "workloads": "podMonitor"}
VALUES = {"metrics": {"prometheusRule": {"enabled": True, "runbookUrl": RUNBOOK},
                      **{key: {"enabled": True} for key in MONITORS.values()}}}
POOL = {"namespace": "prod", "cosine_cluster": "demo", "pool": "code"}
CLUSTER = {"namespace": "prod", "cosine_cluster": "demo"}
# The scrape jobs of the chart's monitors for release "cosine" in "cosine-system" (test_chart.render):
# a ServiceMonitor's targets take its Service's name, a PodMonitor's <namespace>/<name> (the
# Prometheus Operator's defaults; test_the_rules_watch_the_jobs_the_monitors_make holds them to the chart).
OPERATOR_UP = 'up{job="cosine-cosine-operator",namespace="cosine-system",pod="op-1"}'
VERIFIER_UP = ('up{job="cosine-system/cosine-cosine-operator-workloads",namespace="prod",cosine_cluster="demo",'
               'component="verifier",pod="demo-verifier-1"}')
# the operator's series of cluster "demo" in "prod", as its ServiceMonitor stores them: the target's
# namespace is the operator pod's, the cluster's is cosine_namespace
CLUSTER_INFO = ('cosine_operator_cluster_info{cosine_namespace="prod",cosine_cluster="demo",'
                'job="cosine-cosine-operator",namespace="cosine-system",pod="op-1"}')
V1 = 'namespace="prod",cosine_cluster="demo",pod="v-1"'  # a verifier pod's series of cluster "demo"
# the operator's series on a healthy operator before any CoSineCluster: none of its labelled ones yet
NO_CLUSTERS = {OPERATOR_UP: "1+0x90"}


def _v(name: str, labels: str, values: str) -> dict[str, str]:
    """One input series of pool "code" of cluster "demo" in "prod" (pod and other labels in `labels`)."""
    return {f'{name}{{namespace="prod",cosine_cluster="demo",pool="code",{labels}}}': values}


# alert -> (interval, input series firing, input series silent, evaluation time, labels of the alert)
# Series values in promtool's expanding notation: "a+bxN" is a, a+b, ... N+1 samples at `interval`.
CASES: dict[str, tuple[str, dict[str, str], dict[str, str], str, dict[str, str]]] = {
    "CoSineAcceptanceCollapsed": (
        "1m",
        {**_v("cosine_spec_decode_num_accepted_tokens_total", 'pod="v-1"', "0+80x1440 115200+10x120"),
         **_v("cosine_spec_decode_num_draft_tokens_total", 'pod="v-1"', "0+100x1560")},
        {**_v("cosine_spec_decode_num_accepted_tokens_total", 'pod="v-1"', "0+80x1560"),
         **_v("cosine_spec_decode_num_draft_tokens_total", 'pod="v-1"', "0+100x1560")},
        "26h", POOL),
    "CoSineDraftsMostlyLate": (
        "1m",
        {**_v("cosine_spec_decode_drafts_late_total", 'pod="v-1"', "0+60x40"),
         **_v("cosine_spec_decode_num_drafts_total", 'pod="v-1"', "0+20x40")},
        {**_v("cosine_spec_decode_drafts_late_total", 'pod="v-1"', "0+20x40"),
         **_v("cosine_spec_decode_num_drafts_total", 'pod="v-1"', "0+60x40")},
        "35m", POOL),
    "CoSinePoolDown": (
        "1m",
        _v("cosine_drafter_asks_skipped_total", 'reason="down",pod="v-1"', "0+30x20"),
        _v("cosine_drafter_asks_skipped_total", 'reason="yield",pod="v-1"', "0+30x20"),
        "15m", POOL),
    "CoSinePoolTooSlow": (
        "1m",
        {**_v("cosine_spec_decode_drafts_late_total", 'pod="v-1"', "0+60x40"),
         **_v("cosine_spec_decode_num_drafts_total", 'pod="v-1"', "0+20x40"),
         **_v("cosine_drafter_rounds_total", 'pod="d-1"', "0+50x40"),
         **_v("cosine_drafter_batched_requests_total", 'pod="d-1"', "0+55x40")},
        {**_v("cosine_spec_decode_drafts_late_total", 'pod="v-1"', "0+60x40"),
         **_v("cosine_spec_decode_num_drafts_total", 'pod="v-1"', "0+20x40"),
         **_v("cosine_drafter_rounds_total", 'pod="d-1"', "0+10x40"),
         **_v("cosine_drafter_batched_requests_total", 'pod="d-1"', "0+80x40")},
        "35m", POOL),
    # a cluster the operator reconciles with no verifier series at all fires; one whose verifier
    # target is up does not
    "CoSineVerifierDown": (
        "1m",
        {**NO_CLUSTERS, CLUSTER_INFO: "1+0x30"},
        {**NO_CLUSTERS, CLUSTER_INFO: "1+0x30", VERIFIER_UP: "1+0x30"},
        "20m", CLUSTER),
    "CoSineVerifierQueueBuildingUp": (
        "1m",
        {f'vllm:num_requests_waiting{{{V1}}}': "3+0x30"},
        {f'vllm:num_requests_waiting{{{V1}}}':
         "3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3"},
        "20m", {**CLUSTER, "pod": "v-1"}),
    "CoSineTPOTBudgetBurn": (
        "1m",
        {f'vllm:inter_token_latency_seconds_bucket{{{V1},le="0.1"}}': "0+50x90",
         f'vllm:inter_token_latency_seconds_count{{{V1}}}': "0+100x90"},
        {f'vllm:inter_token_latency_seconds_bucket{{{V1},le="0.1"}}': "0+99.5x90",
         f'vllm:inter_token_latency_seconds_count{{{V1}}}': "0+100x90"},
        "80m", CLUSTER),
    "CoSineTPOTBudgetBurnSlow": (
        "5m",
        {f'vllm:inter_token_latency_seconds_bucket{{{V1},le="0.1"}}': "0+460x100",
         f'vllm:inter_token_latency_seconds_count{{{V1}}}': "0+500x100"},
        {f'vllm:inter_token_latency_seconds_bucket{{{V1},le="0.1"}}': "0+498x100",
         f'vllm:inter_token_latency_seconds_count{{{V1}}}': "0+500x100"},
        "7h", CLUSTER),
    # no operator target up (another job's does not count) fires; a healthy operator with no
    # CoSineCluster yet, so none of its labelled series, does not
    "CoSineOperatorDown": (
        "1m",
        {'up{job="other",namespace="cosine-system"}': "1+0x30",
         'up{job="cosine-cosine-operator",namespace="cosine-system",pod="op-1"}': "0+0x30"},
        NO_CLUSTERS,
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


def _recorded(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["record"]: r for g in groups for r in g["rules"] if "record" in r}


def _metrics(expr: str) -> set[str]:
    """The metric names an expression selects (PromQL's keywords, functions and labels left out)."""
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", expr)  # matchers, ranges, strings (label_replace's)
    expr = re.sub(r"\b(?:by|on|ignoring|without|group_left|group_right)\s*\([^)]*\)", "", expr)
    words = re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*\b(?!\s*\()", expr)  # not a function's name
    return set(words) - {"and", "or", "unless", "bool", "offset"}


def test_every_alert_has_a_case_a_runbook_and_only_known_metrics(rules: list[dict[str, Any]]) -> None:
    """Catches: an alert with no promtool case, a runbook link to no section of docs/runbooks.md, a
    metric name that is neither CoSine's (cosine_spec.metric_names, the operator's), nor vLLM's, nor
    `up`, nor recorded here; a recorded series without the level:metric:operations colons, or one
    that drops `cosine_cluster` (two clusters in a namespace would add up)."""
    alerts, recorded = _alerts(rules), _recorded(rules)
    assert set(alerts) == set(CASES)
    runbooks = (ROOT / "docs" / "runbooks.md").read_text().lower()
    known = {metric_names.total(v) for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}
    known |= {v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}
    known |= {"cosine_operator_reconciles_total", "cosine_operator_scrape_failures_total",
              "cosine_operator_cluster_info", "up",
              "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_count"}
    for name, rule in recorded.items():
        assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", name) and "cosine_cluster" in name.split(":")[0], name
        assert "(namespace, cosine_cluster" in rule["expr"], name
        assert _metrics(rule["expr"]) <= known, (name, _metrics(rule["expr"]) - known)
    for name, rule in alerts.items():
        url = rule["annotations"]["runbook_url"]
        assert url.startswith(RUNBOOK + "#"), url
        assert f"\n## {url.split('#')[1]}\n" in runbooks, name
        used = _metrics(rule["expr"])
        assert used and used <= known | set(recorded), (name, used - known - set(recorded))


def _promtool(rules: list[dict[str, Any]], tests: list[dict[str, Any]], tmp_path: Path) -> None:
    """``promtool check rules`` and ``promtool test rules`` on the rendered groups, with Prometheus
    2.42's promtool (Debian bookworm) and 3.x's (sid)."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rules}))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": tests}))
    versions = []
    for tools in provision_all():
        check = subprocess.run([str(tools.promtool), "check", "rules", "rules.yaml"], cwd=tmp_path,
                               capture_output=True, text=True)
        assert check.returncode == 0, (tools.version, check.stdout + check.stderr)
        run = subprocess.run([str(tools.promtool), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, (tools.version, run.stdout[-4000:] + run.stderr[-4000:])
        versions.append(tools.major)
    assert versions == [2, 3]


def _expected(rule: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    """The alert promtool must see from `rule` with `labels`: its own labels and annotations too."""
    return {"exp_labels": {**labels, **rule["labels"]},
            "exp_annotations": {k: _expand(v, labels) for k, v in rule["annotations"].items()}}


def _series(series: dict[str, str]) -> list[dict[str, str]]:
    return [{"series": k, "values": v} for k, v in series.items()]


def test_promtool_fires_each_alert_on_its_case_and_never_on_the_other(rules: list[dict[str, Any]],
                                                                        tmp_path: Path) -> None:
    """Each alert against two inputs: one it must fire on (at the evaluation time, with the labels
    and annotations it is expected to carry), one it must not, in Prometheus's own rule-test
    runner. Among them: CoSineVerifierDown fires for a cluster with no verifier series at all, and
    CoSineOperatorDown stays silent for a healthy operator with no clusters."""
    alerts = _alerts(rules)
    tests = []
    for name, (interval, firing, silent, at, labels) in CASES.items():
        expected = _expected(alerts[name], labels)
        for series, exp in ((firing, [expected]), (silent, [])):
            tests.append({"interval": interval, "input_series": _series(series),
                          "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": exp}]})
    _promtool(rules, tests, tmp_path)


def test_a_healthy_operator_with_no_clusters_fires_nothing(rules: list[dict[str, Any]], tmp_path: Path) -> None:
    """Catches: an alert that reads a series' absence as trouble when the absence is the normal
    state of a fresh install (the operator up, no CoSineCluster yet, so no labelled operator series,
    no verifier, no pool), as `absent(cosine_operator_reconciles_total)` did."""
    tests = [{"interval": "1m", "input_series": _series(NO_CLUSTERS),
              "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": []}
                                  for name in _alerts(rules) for at in ("15m", "80m")]}]
    _promtool(rules, tests, tmp_path)


def _sources(series: dict[str, str]) -> set[str]:
    """The scrapes input series come from: the operator's (its own series, its targets' `up`) and the
    workloads' (the clusters' pods: CoSine's and vLLM's series, their targets' `up`)."""
    out = set()
    for name in series:
        if name.startswith("cosine_operator_") or 'job="cosine-cosine-operator"' in name:
            out.add("operator")
        elif name.startswith(("cosine_", "vllm:")) or "-workloads" in name:
            out.add("workloads")
    return out


@pytest.mark.parametrize("scraped", [("operator",), ("workloads",), ("operator", "workloads")])
def test_each_wiring_ships_the_alerts_its_scrapes_can_fire_and_fires_none_when_healthy(
        scraped: tuple[str, ...], tmp_path: Path) -> None:
    """Catches: an alert shipped without the scrape its series come from. CoSineOperatorDown with
    no monitor on the operator sees no operator target up and fires for ever on a healthy install;
    CoSineVerifierDown without it reads cosine_operator_cluster_info, which nothing scrapes, and
    never fires. Per wiring of the chart's monitors (the operator's ServiceMonitor, the workloads'
    PodMonitor, both): a healthy install, as those monitors scrape it, fires no alert; each alert
    shipped fires on its case; and every alert whose series those monitors scrape is shipped."""
    values = {"metrics": {"prometheusRule": {"enabled": True, "runbookUrl": RUNBOOK},
                          **{MONITORS[s]: {"enabled": True} for s in scraped}}}
    groups = next(d for d in render(values) if d["kind"] == "PrometheusRule")["spec"]["groups"]
    alerts = _alerts(groups)
    healthy = {OPERATOR_UP: "1+0x90"} if "operator" in scraped else {}
    if "workloads" in scraped:
        healthy[VERIFIER_UP] = "1+0x90"
        if "operator" in scraped:
            healthy[CLUSTER_INFO] = "1+0x90"
    tests = [{"interval": "1m", "input_series": _series(healthy),
              "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": []}
                                  for name in alerts for at in ("15m", "80m")]}]
    for name in alerts:
        interval, firing, _, at, labels = CASES[name]
        tests.append({"interval": interval, "input_series": _series(firing), "alert_rule_test": [
            {"eval_time": at, "alertname": name, "exp_alerts": [_expected(alerts[name], labels)]}]})
    _promtool(groups, tests, tmp_path)
    assert set(alerts) == {name for name, case in CASES.items() if _sources({**case[1], **case[2]}) <= set(scraped)}


def test_rules_with_nothing_scraped_refuse_to_render() -> None:
    """Catches: a PrometheusRule shipped with neither monitor nor a job of the user's own scrape:
    every alert in it would be silent for ever or, read as absence, fire for ever."""
    with pytest.raises(Exception, match="needs a scrape to alert on"):
        render({"metrics": {"prometheusRule": {"enabled": True}}})


def test_two_clusters_in_one_namespace_are_two_series_of_every_recorded_rule(rules: list[dict[str, Any]],
                                                                              tmp_path: Path) -> None:
    """Catches: a recording rule that sums two CoSineClusters of one namespace into one series (the
    alerts on it would speak for neither). Every runtime series an input here, twice: clusters "a"
    and "b" in "prod"; every recorded series comes out once per cluster."""
    per_cluster = {
        "cosine_spec_decode_num_accepted_tokens_total": "0+80x100",
        "cosine_spec_decode_num_draft_tokens_total": "0+100x100",
        "cosine_spec_decode_drafts_late_total": "0+10x100", "cosine_spec_decode_num_drafts_total": "0+20x100",
        "cosine_drafter_rounds_total": "0+10x100", "cosine_drafter_batched_requests_total": "0+20x100",
    }
    series: dict[str, str] = {}
    for cluster in ("a", "b"):
        for name, values in per_cluster.items():
            series[f'{name}{{namespace="prod",cosine_cluster="{cluster}",pool="code",pod="{cluster}-1"}}'] = values
        series[f'cosine_drafter_asks_skipped_total{{namespace="prod",cosine_cluster="{cluster}",pool="code",'
               f'reason="down",pod="{cluster}-1"}}'] = "0+1x100"
        for le, values in (("0.1", "0+90x100"), ("+Inf", "0+100x100")):
            series[f'vllm:inter_token_latency_seconds_bucket{{namespace="prod",cosine_cluster="{cluster}",'
                   f'pod="{cluster}-1",le="{le}"}}'] = values
        series[f'vllm:inter_token_latency_seconds_count{{namespace="prod",cosine_cluster="{cluster}",'
               f'pod="{cluster}-1"}}'] = "0+100x100"
        series[VERIFIER_UP.replace('"demo', f'"{cluster}')] = "1+0x100"
    exprs = []
    for name in _recorded(rules):
        pool = "pool" in name.split(":")[0]
        exprs.append({"expr": f"count by (namespace, cosine_cluster) ({name})",
                      "eval_time": "90m",
                      "exp_samples": [{"labels": f'{{namespace="prod",cosine_cluster="{c}"}}', "value": 1}
                                      for c in "ab"]})
        assert pool or name.startswith("namespace_cosine_cluster:"), name
    _promtool(rules, [{"interval": "1m", "input_series": _series(series), "promql_expr_test": exprs}], tmp_path)


def test_the_rules_watch_the_jobs_and_labels_the_monitors_make() -> None:
    """Catches: CoSineOperatorDown or CoSineVerifierDown watching a job no monitor of the chart
    makes (silent forever, or firing forever), and a PodMonitor whose relabelling reads pod labels
    the operator does not set (no `cosine_cluster` on any series)."""
    from cosine_operator.builders.names import labels

    values = {"metrics": {key: {"enabled": True} for key in ("serviceMonitor", "podMonitor", "prometheusRule")}}
    objs = render(values)
    service = next(d for d in objs if d["kind"] == "Service" and d["spec"]["ports"][0]["name"] == "metrics")
    pod_monitor = next(d for d in objs if d["kind"] == "PodMonitor")
    groups = next(d for d in objs if d["kind"] == "PrometheusRule")["spec"]["groups"]
    operator_job = f'job="{service["metadata"]["name"]}", namespace="{service["metadata"]["namespace"]}"'
    workloads_job = f'job="{pod_monitor["metadata"]["namespace"]}/{pod_monitor["metadata"]["name"]}"'
    assert operator_job in _alerts(groups)["CoSineOperatorDown"]["expr"]
    verifier_up = _recorded(groups)["namespace_cosine_cluster:cosine_verifier_up:max"]["expr"]
    assert f'{workloads_job}, component="verifier"' in verifier_up
    assert OPERATOR_UP.startswith(f'up{{{operator_job.replace(", ", ",")}')
    assert VERIFIER_UP.startswith(f"up{{{workloads_job}")

    def meta(label: str) -> str:  # Kubernetes service discovery's name for a pod label
        return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)

    relabelled = {(meta(CLUSTER_LABEL), METRIC_CLUSTER_LABEL), (meta(COMPONENT_LABEL), "component")}
    assert labels("demo", "verifier")[COMPONENT_LABEL] == "verifier"
    assert labels("demo", "verifier")[CLUSTER_LABEL] == "demo"
    for endpoint in pod_monitor["spec"]["podMetricsEndpoints"]:
        assert {(r["sourceLabels"][0], r["targetLabel"]) for r in endpoint["relabelings"]} == relabelled, endpoint
    overridden = {"metrics": {"prometheusRule": {"enabled": True, "operatorJob": "op", "workloadsJob": "pods"}}}
    rule = next(d for d in render(overridden) if d["kind"] == "PrometheusRule")
    assert 'up{job="op", namespace="cosine-system"}' in _alerts(rule["spec"]["groups"])["CoSineOperatorDown"]["expr"]
    assert 'up{job="pods", component="verifier"}' in yaml.safe_dump(rule)


def test_the_slo_and_its_burn_rates_come_from_the_values() -> None:
    """Catches: an SLO value that does not reach the expression (the alert watches another bucket)."""
    values = {"metrics": {"prometheusRule": {"enabled": True, "tpotSlo": {"seconds": "0.05", "objective": 0.999}},
                          "podMonitor": {"enabled": True}}}
    rule = next(d for d in render(values) if d["kind"] == "PrometheusRule")
    fast = _alerts(rule["spec"]["groups"])["CoSineTPOTBudgetBurn"]
    assert "> 0.0144" in fast["expr"] and "__" not in yaml.safe_dump(rule)
    windows = {name: r["expr"] for name, r in _recorded(rule["spec"]["groups"]).items() if "tpot_slo" in name}
    assert len(windows) == 4 and all('le="0.05"' in expr for expr in windows.values()), windows
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
_RELABEL = {"type": "object", "additionalProperties": False, "properties": {
    "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
    "separator": {"type": "string"}, "targetLabel": {"type": "string"}, "regex": {"type": "string"},
    "modulus": {"type": "integer"}, "replacement": {"type": "string"},
    "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod", "labelmap",
                        "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep", "lowercase", "Lowercase",
                        "uppercase", "Uppercase", "keepequal", "KeepEqual", "dropequal", "DropEqual"]}}}
_ENDPOINT = {"type": "object", "additionalProperties": False, "properties": {
    "port": {"type": "string"}, "path": {"type": "string"}, "interval": _DURATION, "scheme": {"type": "string"},
    "honorLabels": {"type": "boolean"}, "relabelings": {"type": "array", "items": _RELABEL}}}
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
