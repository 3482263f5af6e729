"""The kopf handlers: thin wiring of builders, the status builders and the scaling policy.

Run with ``cosine-operator`` (or ``kopf run -m cosine.operator.handlers``). Handlers are named
``<kind>_<event>``; each reads the object, calls pure ``build_*``/``desired_replicas``, adopts the
children (owner references, so deleting a cluster deletes them: no finalizer is needed) and
applies them with create-or-patch, then writes status with conditions.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import kopf

from cosine.operator import builders, kube, status
from cosine.operator import settings as s
from cosine.operator.autoscaling import PoolLimits, ScalerState, ScalingPolicy, desired_replicas
from cosine.operator.metrics_scrape import Scrape, ScrapeTarget, observe, scrape_pods, scrape_prometheus
from cosine.operator.telemetry import OperatorMetrics

CLUSTER = (s.GROUP, s.VERSION, s.CLUSTER_PLURAL)
POOL = (s.GROUP, s.VERSION, s.POOL_PLURAL)
MANAGED = {"app.kubernetes.io/managed-by": builders.MANAGED_BY}


@dataclass
class _AutoscalerMemory:
    """Per-cluster autoscaler memory between timer ticks (lives in ``memo.autoscalers``)."""

    last_scrape_s: float = float("-inf")
    previous: Scrape | None = None
    state: ScalerState = field(default_factory=ScalerState)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@kopf.on.login()
def operator_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, else ``KUBECONFIG`` (explicit: kubernetes_asyncio is installed)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
async def operator_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Typed config from the environment, API client, progress storage, webhook server, metrics."""
    config = s.OperatorConfig.from_env(os.environ)
    memo.config = config
    memo.api = await kube.connect()
    memo.autoscalers = {}
    memo.metrics = OperatorMetrics.create()
    # Handler progress in annotations only: status stays ours (and schema-valid).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="cosine.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="cosine.dev", key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    # A deleted cluster keeps kopf's finalizer until its autoscaler timer has exited; kopf re-checks
    # a timer caught mid-pass every `cancellation_polling` s (default 60): deletion would hang a minute.
    settings.background.cancellation_polling = 1.0
    if config.webhook_port is not None:
        cert_dir = config.webhook_cert_dir
        settings.admission.server = kopf.WebhookServer(
            addr="0.0.0.0",
            port=config.webhook_port,
            insecure=config.webhook_insecure,
            certfile=os.path.join(cert_dir, "tls.crt") if cert_dir else None,
            pkeyfile=os.path.join(cert_dir, "tls.key") if cert_dir else None,
        )
    if config.metrics_port is not None:
        memo.metrics.serve(config.metrics_port)
    logger.info("cosine-operator started", extra={"config": repr(config)})


@kopf.on.cleanup()
async def operator_cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Close the API client's connection pool."""
    api = getattr(memo, "api", None)
    if api is not None:
        await api.close()


async def _pool_replicas(
    api: Any, name: str, namespace: str, cluster: s.ClusterSpec, old_spec: Any
) -> dict[str, int]:
    """Each pool's scale: its scale target's ``spec.replicas`` (autoscaler or HPA wrote it),
    unless this update changed ``drafterPools[].replicas`` (the user scaled by hand), or it is new."""
    old_replicas: dict[str, int] = {}
    if old_spec:
        try:
            old_replicas = {p.name: p.replicas for p in s.parse_cluster_spec(old_spec).drafter_pools}
        except ValueError:
            old_replicas = {}
    out: dict[str, int] = {}
    for pool in cluster.drafter_pools:
        current = await kube.get(api, s.POOL_KIND, namespace, builders.pool_object_name(name, pool.name))
        user_scaled = pool.name in old_replicas and old_replicas[pool.name] != pool.replicas
        if current is None or user_scaled:
            out[pool.name] = pool.clamp(pool.replicas)
        else:
            out[pool.name] = pool.clamp(int(current["spec"].get("replicas", pool.replicas)))
    return out


async def _prune(api: Any, name: str, namespace: str, pools: set[str], logger: Any) -> list[str]:
    """Delete the children of drafter pools no longer in the spec; returns the pools removed."""
    removed: set[str] = set()
    for kind in (s.POOL_KIND, "Deployment", "Service"):
        for obj in await kube.list_owned(api, kind, namespace, name):
            meta = obj["metadata"]
            pool = (meta.get("labels") or {}).get(builders.POOL_LABEL)
            if pool is not None and pool not in pools:
                await kube.delete(api, kind, namespace, meta["name"])
                removed.add(pool)
                logger.info(f"deleted {kind} {meta['name']} of removed pool {pool}")
    return sorted(removed)


async def _refresh_status(
    api: Any, name: str, namespace: str, generation: int | None, cluster: s.ClusterSpec, previous: Any
) -> dict[str, Any]:
    names = [builders.verifier_name(name)] + [
        builders.drafter_name(name, p.name) for p in cluster.drafter_pools
    ]
    deployments = {n: await kube.get(api, "Deployment", namespace, n) for n in names}
    return status.build_status(name, namespace, generation, cluster, deployments, previous, _now())


async def _reconcile(
    event: str,
    body: kopf.Body,
    spec: Any,
    name: str,
    namespace: str,
    old_spec: Any,
    memo: kopf.Memo,
    patch: kopf.Patch,
    logger: Any,
) -> None:
    try:
        cluster = s.parse_cluster_spec(spec)
    except ValueError as e:
        memo.metrics.reconciles.labels(event, "invalid").inc()
        raise kopf.PermanentError(f"invalid spec: {e}") from e
    api = memo.api
    replicas = await _pool_replicas(api, name, namespace, cluster, old_spec)
    for child in builders.build_children(name, namespace, cluster, replicas):
        kopf.adopt(child, owner=body)
        await kube.apply(api, child)
    removed = await _prune(api, name, namespace, {p.name for p in cluster.drafter_pools}, logger)
    if removed:
        kopf.info(body, reason="PoolsRemoved", message=f"deleted drafter pool(s) {', '.join(removed)}")
    generation = body.metadata.get("generation")
    patch.status.update(await _refresh_status(api, name, namespace, generation, cluster, body.status))
    memo.metrics.reconciles.labels(event, "ok").inc()
    logger.info(f"reconciled: {len(cluster.drafter_pools)} pool(s), replicas {replicas}")


@kopf.on.create(*CLUSTER)
async def cosinecluster_create(
    body: kopf.Body,
    spec: Any,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    patch: kopf.Patch,
    logger: Any,
    **_: Any,
) -> None:
    """Create the children of a new CoSineCluster."""
    await _reconcile("create", body, spec, name, namespace, None, memo, patch, logger)


@kopf.on.update(*CLUSTER, field="spec")
async def cosinecluster_update(
    body: kopf.Body,
    spec: Any,
    old: Any,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    patch: kopf.Patch,
    logger: Any,
    **_: Any,
) -> None:
    """Roll out a changed spec (new pod templates, scaled or removed pools)."""
    await _reconcile("update", body, spec, name, namespace, old, memo, patch, logger)


@kopf.on.resume(*CLUSTER)
async def cosinecluster_resume(
    body: kopf.Body,
    spec: Any,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    patch: kopf.Patch,
    logger: Any,
    **_: Any,
) -> None:
    """Re-apply the children when the operator restarts (drift repair)."""
    await _reconcile("resume", body, spec, name, namespace, None, memo, patch, logger)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def deployment_event(body: kopf.Body, namespace: str, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """A child Deployment changed (ready replicas): refresh the owner's status and its pool's status."""
    labels = body.metadata.labels
    cluster_name = labels.get(builders.CLUSTER_LABEL)
    if not cluster_name or body.metadata.get("deletionTimestamp"):
        return
    api = memo.api
    owner = await kube.get(api, s.CLUSTER_KIND, namespace, cluster_name)
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return
    try:
        cluster = s.parse_cluster_spec(owner.get("spec") or {})
    except ValueError:
        return
    new = await _refresh_status(
        api, cluster_name, namespace, owner["metadata"].get("generation"), cluster, owner.get("status")
    )
    await kube.patch(api, s.CLUSTER_KIND, namespace, cluster_name, {"status": new}, subresource="status")
    pool = labels.get(builders.POOL_LABEL)
    if pool:
        replicas, ready = status._counts(body)
        selector = ",".join(
            f"{k}={v}" for k, v in builders.selector_labels(cluster_name, "drafter", pool).items()
        )
        pool_status = {"status": {"replicas": replicas, "readyReplicas": ready, "selector": selector}}
        await kube.patch(
            api,
            s.POOL_KIND,
            namespace,
            builders.pool_object_name(cluster_name, pool),
            pool_status,
            subresource="status",
        )


@kopf.on.field(*POOL, field="spec.replicas")
async def cosinedrafterpool_replicas(
    spec: Any, namespace: str, memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    """The scale target changed (autoscaler, HPA/KEDA via ``/scale``): resize the pool's Deployment."""
    lo, hi = int(spec.get("minReplicas", 0)), int(spec.get("maxReplicas", 1 << 20))
    replicas = s.clamp_replicas(int(spec.get("replicas", lo)), lo, hi)
    deployment = builders.drafter_name(spec["clusterName"], spec["pool"])
    await kube.patch(memo.api, "Deployment", namespace, deployment, {"spec": {"replicas": replicas}})
    logger.info(f"pool {spec['pool']}: Deployment {deployment} scaled to {replicas}")


async def _scrape(
    api: Any, name: str, namespace: str, cluster: s.ClusterSpec, config: s.OperatorConfig
) -> Scrape:
    now_s = time.monotonic()
    if cluster.autoscaling.prometheus_url:
        return await scrape_prometheus(
            cluster.autoscaling.prometheus_url,
            namespace,
            name,
            [p.name for p in cluster.drafter_pools],
            config.scrape_timeout_s,
            now_s,
        )
    targets = []
    for pod in await kube.list_owned(api, "Pod", namespace, name):
        meta, pod_status = pod["metadata"], pod.get("status") or {}
        ip = pod_status.get("podIP")
        if not ip or pod_status.get("phase", "Running") != "Running" or meta.get("deletionTimestamp"):
            continue
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        role = labels.get(builders.COMPONENT_LABEL)
        if role not in ("verifier", "drafter"):
            continue
        default_port = s.VERIFIER_METRICS_PORT if role == "verifier" else s.DRAFTER_METRICS_PORT
        port = annotations.get("prometheus.io/port", str(default_port))
        path = annotations.get("prometheus.io/path", "/metrics")
        targets.append(
            ScrapeTarget(meta["name"], role, labels.get(builders.POOL_LABEL), f"http://{ip}:{port}{path}")
        )
    return await scrape_pods(targets, config.scrape_timeout_s, now_s)


@kopf.timer(*CLUSTER, interval=1.0, initial_delay=1.0)
async def cosinecluster_autoscale(
    body: kopf.Body,
    spec: Any,
    name: str,
    namespace: str,
    uid: str,
    memo: kopf.Memo,
    patch: kopf.Patch,
    logger: Any,
    **_: Any,
) -> None:
    """Every ``spec.autoscaling.intervalSeconds``: scrape, decide with ``desired_replicas``, scale."""
    try:
        cluster = s.parse_cluster_spec(spec)
    except ValueError:
        return
    generation = body.metadata.get("generation")
    previous_status = dict(body.status)
    if not cluster.autoscaling.enabled:
        memo.autoscalers.pop(uid, None)
        conds = {c.get("type"): c for c in previous_status.get("conditions") or ()}
        if (conds.get("ScalingActive") or {}).get("reason") != "Disabled":
            patch.status.update(
                status.autoscaler_status(
                    previous_status,
                    None,
                    (),
                    False,
                    "Disabled",
                    "spec.autoscaling.enabled is false: replicas come from the spec or the pools' "
                    "scale subresource",
                    generation,
                    _now(),
                )
            )
        return
    mem: _AutoscalerMemory = memo.autoscalers.setdefault(uid, _AutoscalerMemory())
    now_s = time.monotonic()
    if now_s - mem.last_scrape_s < cluster.autoscaling.interval_s:
        return
    mem.last_scrape_s = now_s
    api = memo.api
    scrape = await _scrape(api, name, namespace, cluster, memo.config)
    previous, mem.previous = mem.previous, scrape
    if previous is None:
        return  # rates need two scrapes
    pool_replicas: dict[str, tuple[int, int]] = {}
    for pool in cluster.drafter_pools:
        scaler = await kube.get(api, s.POOL_KIND, namespace, builders.pool_object_name(name, pool.name))
        deployment = await kube.get(api, "Deployment", namespace, builders.drafter_name(name, pool.name))
        if scaler is None:
            continue
        ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
        pool_replicas[pool.name] = (int(scaler["spec"].get("replicas", pool.replicas)), ready)
    observations = observe(previous, scrape, pool_replicas)
    policy = ScalingPolicy(
        pools=tuple(PoolLimits(p.name, p.min_replicas, p.max_replicas) for p in cluster.drafter_pools),
        target_utilization=cluster.autoscaling.target_drafter_utilization,
        stabilization_s=float(cluster.autoscaling.stabilization_s),
        max_scale_down_step=cluster.autoscaling.max_scale_down_step,
    )
    decisions, mem.state = desired_replicas(observations, policy, mem.state, now_s)
    for d in decisions:
        memo.metrics.desired_replicas.labels(namespace, name, d.pool).set(d.desired)
        if not d.changed:
            continue
        direction = "up" if d.desired > d.current else "down"
        memo.metrics.scale_decisions.labels(d.pool, direction).inc()
        await kube.patch(
            api,
            s.POOL_KIND,
            namespace,
            builders.pool_object_name(name, d.pool),
            {"spec": {"replicas": d.desired}},
        )
        await kube.patch(
            api,
            "Deployment",
            namespace,
            builders.drafter_name(name, d.pool),
            {"spec": {"replicas": d.desired}},
        )
        kopf.info(
            body,
            reason=f"Scaled{direction.capitalize()}",
            message=f"drafter pool {d.pool}: {d.current} → {d.desired} replicas: {d.reason}",
        )
        logger.info(f"pool {d.pool}: {d.current} -> {d.desired}: {d.reason}")
    measured = observations.verifier is not None
    patch.status.update(
        status.autoscaler_status(
            previous_status,
            observations,
            decisions,
            measured,
            "Measuring" if measured else "NoMetrics",
            "balancing drafting to verification throughput" if measured else "verifier /metrics not readable",
            generation,
            _now(),
        )
    )
