"""CoSine's Grafana dashboards as code (grafana-foundation-sdk, Grafana 11.6's schema), written as JSON
into `manifests/observability/` and the chart's `files/dashboards/` (shipped as ConfigMaps for
Grafana's sidecar). Every metric name comes from `cosine_spec.metric_names` (CoSine's) or is
vLLM's / the operator's own, named once below.

    python3 tools/dashboards.py          # make dashboards

`PANELS` lists every panel's queries; `tests/operator/test_dashboards.py` holds the committed files
equal to what this writes, and `tests/runtime/test_serve.py` evaluates every query of the
speculation dashboard on a real Prometheus scraping a real `cosine serve`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from cosine_spec import metric_names as n
from cosine_spec.contract import METRIC_CLUSTER_LABEL

ROOT = Path(__file__).resolve().parents[1]
OUT_DIRS = (ROOT / "manifests" / "observability", ROOT / "charts" / "cosine-operator" / "files" / "dashboards")

# The operator's own series (cosine_operator.telemetry), with their `_total` sample names.
OPERATOR_RECONCILES = "cosine_operator_reconciles_total"
OPERATOR_AUTOSCALER_ERRORS = "cosine_operator_autoscaler_errors_total"
OPERATOR_SCRAPE_FAILURES = "cosine_operator_scrape_failures_total"
OPERATOR_SCALE_DECISIONS = "cosine_operator_scale_decisions_total"
OPERATOR_DESIRED_REPLICAS = "cosine_operator_desired_replicas"

# A series' CoSineCluster is `cosine_cluster` (cosine_spec.contract.METRIC_CLUSTER_LABEL): the chart's
# monitors copy it from the pod's label; the operator's per-cluster series carry it themselves, with
# the cluster's namespace as `cosine_namespace` (their `namespace` is the operator pod's).
C = METRIC_CLUSTER_LABEL  # cosine_cluster
NS = f'namespace=~"$namespace", {C}=~"$cluster"'
POOL = f'{NS}, pool=~"$pool"'
OPERATOR_POOL = 'cosine_namespace=~"$namespace", cosine_cluster=~"$cluster", pool=~"$pool"'
# a pool's price: the operator's series per cluster, or `cosine serve`'s (scraped with `namespace`);
# matched on cluster and pool, as the per-pool queries it divides are grouped
PRICE = 'cosine_cluster=~"$cluster", pool=~"$pool"'
W = "[5m]"


def _t(name: str) -> str:
    return n.total(name)


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    """One time-series panel: its title, unit, and queries (PromQL over the dashboard's variables)."""

    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""


def _rate(name: str, labels: str, by: str) -> str:
    return f"sum by ({by}) (rate({name}{{{labels}}}{W}))"


# every query keeps `cosine_cluster`: two CoSineClusters in one namespace are two series, never one sum
BY_POOL = "cosine_cluster, pool"


SPECULATION: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    ("Drafter pools", (
        PanelSpec("Acceptance rate", "percentunit", (Query(
            f"{_rate(_t(n.ACCEPTED_TOKENS), POOL, BY_POOL)} / {_rate(_t(n.DRAFT_TOKENS), POOL, BY_POOL)}",
            "{{cosine_cluster}}/{{pool}}"),),
            "Share of a source's draft tokens the target accepted (pool=lookup: prompt lookup)."),
        PanelSpec("Mean acceptance length", "short", (Query(
            f"1 + {_rate(_t(n.ACCEPTED_TOKENS), POOL, BY_POOL)} / {_rate(_t(n.DRAFTS), POOL, BY_POOL)}",
            "{{cosine_cluster}}/{{pool}}"),),
            "Tokens a verification with the source's draft emits: accepted draft tokens plus the bonus token."),
        PanelSpec("Drafts used and late", "ops", (
            Query(_rate(_t(n.DRAFTS), POOL, BY_POOL), "{{cosine_cluster}}/{{pool}} used"),
            Query(_rate(_t(n.DRAFTS_LATE), POOL, BY_POOL), "{{cosine_cluster}}/{{pool}} late")),
            "Per second: verifications that carried the pool's draft, and steps its draft was still in flight."),
        PanelSpec("Asks skipped by reason", "ops", (Query(
            _rate(_t(n.POOL_ASKS_SKIPPED), POOL, f"{BY_POOL}, reason"), "{{cosine_cluster}}/{{pool}} {{reason}}"),),
            "Draft asks not made: late (drafts would arrive too late to pay), yield (too rarely accepted), "
            "down (no replica answers)."),
        PanelSpec("Round time and round trip", "s", (
            Query(f"{_rate(_t(n.DRAFTER_BUSY_SECONDS), POOL, BY_POOL)} / {_rate(_t(n.DRAFTER_ROUNDS), POOL, BY_POOL)}",
                  "{{cosine_cluster}}/{{pool}} round"),
            Query(f"avg by ({BY_POOL}) ({n.POOL_RTT_SECONDS}{{{POOL}}})", "{{cosine_cluster}}/{{pool}} round trip")),
            "A drafter's seconds per batched round, and a draft call's wall time seen from the verifier."),
        PanelSpec("Replicas: serving and desired", "short", (
            Query(f"count by ({BY_POOL}) ({n.DRAFTER_CONTEXTS}{{{POOL}}})", "{{cosine_cluster}}/{{pool}} serving"),
            Query(f"max by ({BY_POOL}) ({OPERATOR_DESIRED_REPLICAS}{{{OPERATOR_POOL}}}) "
                  f"or max by ({BY_POOL}) ({n.EMBEDDED_REPLICAS}{{{POOL}}})", "{{cosine_cluster}}/{{pool}} desired")),
            "Drafter replicas reporting metrics, against the autoscaler's desired count (the operator's, or "
            "cosine serve's). A pool held with PoolTooSlow or MetricsMissing says why in `kubectl get cdp`."),
    )),
    ("Verifier", (
        PanelSpec("Tokens per verification step", "short", (Query(
            f"{_rate(_t(n.VERIFIER_TOKENS_VERIFIED), NS, C)} / {_rate(_t(n.VERIFIER_STEPS), NS, C)}",
            "{{cosine_cluster}}"),)),
        PanelSpec("Steps with a draft", "percentunit", (Query(
            f"{_rate(_t(n.VERIFIER_STEPS_WITH_DRAFT), NS, C)} / {_rate(_t(n.VERIFIER_STEPS), NS, C)}",
            "{{cosine_cluster}}"),)),
        PanelSpec("TTFT", "s", tuple(Query(
            f"histogram_quantile({q}, {_rate(n.VLLM_TTFT_SECONDS + '_bucket', NS, f'{C}, le')})",
            f"{{{{cosine_cluster}}}} p{int(q * 100)}")
            for q in (0.5, 0.99))),
        PanelSpec("TPOT", "s", tuple(Query(
            f"histogram_quantile({q}, {_rate(n.VLLM_ITL_SECONDS + '_bucket', NS, f'{C}, le')})",
            f"{{{{cosine_cluster}}}} p{int(q * 100)}")
            for q in (0.5, 0.99)), "vLLM's inter-token latency."),
        PanelSpec("Requests running and waiting", "short", (
            Query(f"sum by (cosine_cluster) ({n.VLLM_REQUESTS_RUNNING}{{{NS}}})", "{{cosine_cluster}} running"),
            Query(f"sum by (cosine_cluster) ({n.VLLM_REQUESTS_WAITING}{{{NS}}})", "{{cosine_cluster}} waiting"))),
        PanelSpec("KV cache usage", "percentunit", (Query(
            f"max by (cosine_cluster, pod) ({n.VLLM_KV_CACHE_USAGE}{{{NS}}})", "{{cosine_cluster}}/{{pod}}"),)),
    )),
    ("Cost", (
        PanelSpec("Accepted draft tokens per pool dollar", "short", (Query(
            f"{_rate(_t(n.ACCEPTED_TOKENS), POOL, BY_POOL)} * 3600 / (max by ({BY_POOL}) ({n.POOL_PRICE}{{{PRICE}}}) "
            f"* count by ({BY_POOL}) ({n.DRAFTER_CONTEXTS}{{{POOL}}}))", "{{cosine_cluster}}/{{pool}}"),),
            "Accepted draft tokens per second of each pool, per dollar its replicas cost per hour (the spec's "
            "pricePerHourUsd, spotPricePerHourUsd on spot capacity)."),
        PanelSpec("Accepted draft tokens per dollar", "short", (Query(
            f"sum by ({C}) (rate({_t(n.ACCEPTED_TOKENS)}{{{POOL}}}{W})) * 3600 / $usd_per_hour",
            "{{cosine_cluster}}"),),
            "Accepted draft tokens per second, per dollar of the cluster's hourly price (the usd_per_hour "
            "variable: verifier plus pools at your prices)."),
    )),
)

OPERATOR: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    ("Operator", (
        PanelSpec("Reconciles", "ops", (Query(
            f"sum by (event, outcome) (rate({OPERATOR_RECONCILES}{W}))", "{{event}} {{outcome}}"),)),
        PanelSpec("Leading replica", "short", (Query(
            f'sum by (pod) (increase({OPERATOR_RECONCILES}{{event="resync"}}{W}))', "{{pod}}"),),
            "Resyncs per operator pod: only the replica that leads (kopf peering) resyncs clusters."),
        PanelSpec("Autoscaler errors", "ops", (Query(
            f"sum by (stage) (rate({OPERATOR_AUTOSCALER_ERRORS}{W}))", "{{stage}}"),)),
        PanelSpec("Scrape failures", "ops", (Query(
            f"sum by (role) (rate({OPERATOR_SCRAPE_FAILURES}{W}))", "{{role}}"),)),
        PanelSpec("Scale decisions", "short", (Query(
            f"sum by (cosine_namespace, cosine_cluster, pool, direction) (increase({OPERATOR_SCALE_DECISIONS}[1h]))",
            "{{cosine_namespace}}/{{cosine_cluster}}/{{pool}} {{direction}}"),)),
    )),
)

DASHBOARDS = {"cosine-speculation": ("CoSine / Speculation", SPECULATION, True),
              "cosine-operator": ("CoSine / Operator", OPERATOR, False)}


def build(uid: str) -> dict:
    """One dashboard as Grafana's JSON model."""
    from grafana_foundation_sdk.builders.dashboard import Dashboard as Builder
    from grafana_foundation_sdk.builders.dashboard import DatasourceVariable, QueryVariable, Row, TextBoxVariable
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    from grafana_foundation_sdk.builders.timeseries import Panel
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos

    title, rows, workload = DASHBOARDS[uid]
    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (Builder(title).uid(uid).tags(["cosine"]).refresh("30s").time("now-1h", "now").timezone("browser")
             .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus")))
    if workload:
        board = (board
                 .with_variable(QueryVariable("namespace").label("Namespace").datasource(ds).include_all(True)
                                .all_value(".*").multi(True).query(f"label_values({_t(n.VERIFIER_STEPS)}, namespace)"))
                 .with_variable(QueryVariable("cluster").label("CoSineCluster").datasource(ds).include_all(True)
                                .all_value(".*").multi(True)
                                .query(f'label_values({_t(n.VERIFIER_STEPS)}{{namespace=~"$namespace"}}, {C})'))
                 .with_variable(QueryVariable("pool").label("Pool").datasource(ds).include_all(True).all_value(".*")
                                .multi(True)
                                .query(f"label_values({_t(n.DRAFTS)}{{{NS}}}, pool)"))
                 .with_variable(TextBoxVariable("usd_per_hour").label("Cluster USD per hour").default_value("20")))
    y = 0
    for row_title, panels in rows:
        board = board.with_row(Row(row_title).grid_pos(GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        for i, p in enumerate(panels):
            panel = (Panel().title(p.title).unit(p.unit).datasource(ds).description(p.description)
                     .grid_pos(GridPos(h=8, w=12, x=12 * (i % 2), y=y + 8 * (i // 2))))
            for j, q in enumerate(p.queries):
                panel = panel.with_target(Dataquery().expr(q.expr).legend_format(q.legend).ref_id("ABCD"[j]))
            board = board.with_panel(panel)
        y += 8 * ((len(panels) + 1) // 2)
    return board.build()


def render(uid: str) -> str:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    return json.dumps(build(uid), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def queries(uid: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of a dashboard."""
    return [(p.title, q.expr) for _, panels in DASHBOARDS[uid][1] for p in panels for q in p.queries]


def main() -> int:
    for out in OUT_DIRS:
        out.mkdir(parents=True, exist_ok=True)
        for uid in DASHBOARDS:
            (out / f"{uid}.json").write_text(render(uid))
            print(f"wrote {out / f'{uid}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
