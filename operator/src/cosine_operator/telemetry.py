"""The operator's own Prometheus metrics (reconciles, scale decisions, scrapes).

Kept in a registry of their own, created at start-up and held in kopf's ``memo`` (no module
globals). Served on ``COSINE_OPERATOR_METRICS_PORT`` when set; liveness is kopf's ``--liveness``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cosine_spec import metric_names as names
from cosine_spec.contract import METRIC_CLUSTER_LABEL as CLUSTER
from cosine_spec.contract import METRIC_NAMESPACE_LABEL as NAMESPACE
from cosine_spec.scaling_loop import STAGES
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

SCRAPE_ROLES = ("verifier", "drafter", "prometheus")
RECONCILE_EVENTS = ("create", "update", "resume", "resync")  # what the autoscaler scrapes: pods by role, or Prometheus


@dataclass(frozen=True)
class OperatorMetrics:
    """Counters and gauges; ``cosine_operator_`` prefix."""

    registry: CollectorRegistry
    reconciles: Counter  # labels: event (create/update/resume), outcome (ok/error)
    # per-cluster series: cosine_namespace and cosine_cluster (contract.METRIC_*_LABEL), not namespace
    # and cluster, which a scrape sets to the operator pod's own (and GKE's Managed Prometheus forbids)
    scale_decisions: Counter  # labels: cosine_namespace, cosine_cluster, pool, direction (up/down)
    scrape_failures: Counter  # labels: role
    desired_replicas: Gauge  # labels: cosine_namespace, cosine_cluster, pool
    autoscaler_errors: Counter  # labels: stage (observe/actuate/report): passes that failed and went on
    pool_price: Gauge  # cosine_drafter_pool_price_usd_per_hour{cosine_namespace, cosine_cluster, pool}: spec's
    cluster_info: Gauge  # cosine_namespace, cosine_cluster; 1 per CoSineCluster reconciled (CoSineVerifierDown's)

    @classmethod
    def create(cls) -> OperatorMetrics:
        """The metrics in a fresh registry of their own."""
        registry = CollectorRegistry()
        metrics = cls(
            registry=registry,
            reconciles=Counter(
                "cosine_operator_reconciles",
                "CoSineCluster reconciliations.",
                ["event", "outcome"],
                registry=registry,
            ),
            scale_decisions=Counter(
                "cosine_operator_scale_decisions",
                "Drafter pool replica changes by the autoscaler.",
                [NAMESPACE, CLUSTER, "pool", "direction"],
                registry=registry,
            ),
            scrape_failures=Counter(
                "cosine_operator_scrape_failures",
                "Pods whose /metrics could not be read.",
                ["role"],
                registry=registry,
            ),
            desired_replicas=Gauge(
                "cosine_operator_desired_replicas",
                "The autoscaler's latest desired replicas per pool.",
                [NAMESPACE, CLUSTER, "pool"],
                registry=registry,
            ),
            autoscaler_errors=Counter(
                "cosine_operator_autoscaler_errors",
                "Autoscaler stages that failed (the loop goes on to the next interval).",
                ["stage"],
                registry=registry,
            ),
            pool_price=Gauge(
                names.POOL_PRICE,
                "One drafter replica's price per hour from the spec, USD (spotPricePerHourUsd on spot).",
                [NAMESPACE, CLUSTER, "pool"],
                registry=registry,
            ),
            cluster_info=Gauge(
                "cosine_operator_cluster_info",
                "1 for each CoSineCluster this replica has reconciled (and not seen deleted).",
                [NAMESPACE, CLUSTER],
                registry=registry,
            ),
        )
        # failure-only counters exist at 0 from the start (Prometheus's advice against missing
        # series): a panel or alert over them sees the healthy operator, and rate() its first failure
        for role in SCRAPE_ROLES:
            metrics.scrape_failures.labels(role)
        for stage in STAGES:
            metrics.autoscaler_errors.labels(stage)
        for event in RECONCILE_EVENTS:
            metrics.reconciles.labels(event, "ok")
            metrics.reconciles.labels(event, "error")
        return metrics

    def pool_reconciled(self, namespace: str, cluster: str, pool: str) -> None:
        """A pool's scale-decision series at 0 (up and down) once its cluster is reconciled."""
        for direction in ("up", "down"):
            self.scale_decisions.labels(namespace, cluster, pool, direction)

    def serve(self, port: int) -> None:
        """Serve ``/metrics`` on ``port`` (a daemon thread)."""
        start_http_server(port, registry=self.registry)
