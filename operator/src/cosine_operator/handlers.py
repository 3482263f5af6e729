"""The kopf handlers: thin wiring of builders, the status builders and the scaling policy.

Run with ``cosine-operator`` (or ``kopf run -m cosine_operator.handlers``). Handlers are named
``<kind>_<event>``; each parses the spec once, calls pure ``build_*``/``desired_replicas``, adopts
the children (owner references: deleting a cluster deletes them through Kubernetes' garbage
collector, so the operator adds no finalizer of its own) and server-side applies them (a field
dropped from the spec leaves the child), then writes status with conditions. kopf puts its own
finalizer on each CoSineCluster while the cluster's autoscaler daemon and resync timer run, so
that it can stop them before the object goes.

One writer per field:
- **Replicas.** A Deployment is created with the spec's replicas (a pool's: its
  ``CoSineDrafterPool``'s) and from then on applied without them (:func:`kube.apply_scale_free`):
  whoever owns its scale writes them, and reconcile never reads-then-writes them back. A drafter
  pool's size has one writer chain: whatever scales the pool (the autoscaler daemon, an HPA or
  KEDA through the ``CoSineDrafterPool``'s scale subresource, ``kubectl scale``, or a changed
  ``spec.drafterPools[].replicas``) writes the pool's ``spec.replicas``;
  :func:`cosinedrafterpool_follow` alone resizes the pool's Deployment to it. The verifier's is
  written by an HPA on its Deployment, or through the CoSineCluster's scale subresource
  (``spec.verifier.replicas``), which :func:`cosinecluster_scale_verifier` alone follows. A spot
  pool's on-demand sibling (``N-drafter-P-ondemand``) is sized by reconcile alone
  (:func:`_spot_fallbacks`, the pure rule ``cosine_spec.capacity.on_demand_fallback``).
- **Children.** One inventory says which exist (``builders.inventory.build_children``); each is
  applied as :func:`cosine_operator.apply_plan.apply_step` plans for its kind, and whatever the
  cluster owns beyond them is deleted (``builders.inventory.leftovers``: owned minus desired).
- **Status.** Each writer (reconcile and its resync, the Deployment watch, the autoscaler)
  computes its part against the live object and writes it once, with the live
  ``resourceVersion`` as a precondition, retried on conflict (:func:`_write_status`): conditions
  are merged by type, so no writer's update is lost to another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import inspect
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import kopf
from cosine_spec.autoscaling import Observations, ScaleDecision, policy_from_spec
from cosine_spec.capacity import on_demand_fallback
from cosine_spec.cluster_spec import ClusterSpec, clamp_replicas, read_stored_spec
from cosine_spec.contract import (
    CAPACITY_LABEL,
    CLUSTER_KIND,
    CLUSTER_LABEL,
    CLUSTER_PLURAL,
    COMPONENT_LABEL,
    DRAFTER_METRICS_PORT,
    GROUP,
    POOL_KIND,
    POOL_LABEL,
    POOL_PLURAL,
    VERIFIER_METRICS_PORT,
    VERSION,
)
from cosine_spec.metrics_scrape import Rates, Scrape, ScrapeTarget, rates, scrape_pods, scrape_prometheus
from cosine_spec.metrics_scrape import observations as observations_of
from cosine_spec.scaling_loop import ScalingLoop
from cosine_spec.verifier_spec import engine_args_problems
from kubernetes_asyncio.client.exceptions import ApiException

from cosine_operator import kube, status
from cosine_operator.apply_plan import ApplyStep, apply_step
from cosine_operator.builders.inventory import CHILD_KINDS, build_children, leftovers
from cosine_operator.builders.names import (
    MANAGED_BY,
    drafter_name,
    pool_object_name,
    verifier_name,
)
from cosine_operator.builders.networking import operator_peer
from cosine_operator.builders.workloads import build_fallback_deployment
from cosine_operator.config import OperatorConfig
from cosine_operator.telemetry import OperatorMetrics

CLUSTER = (GROUP, VERSION, CLUSTER_PLURAL)
POOL = (GROUP, VERSION, POOL_PLURAL)
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
# The resync timer's interval (``COSINE_OPERATOR_RESYNC_S``): kopf takes a timer's interval when
# its handler is registered, at import, so it is read from the environment then; the rest of the
# operator's config at startup.
RESYNC_S = OperatorConfig.from_env(os.environ).resync_s


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@kopf.on.login()
def operator_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, else ``KUBECONFIG`` (explicit: kubernetes_asyncio is installed)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
async def operator_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Typed config from the environment, API client, progress storage, webhook server, metrics."""
    config = OperatorConfig.from_env(os.environ)
    memo.config = config
    memo.api = await kube.connect()
    memo.metrics = OperatorMetrics.create()
    # Handler progress in annotations only: status stays ours (and schema-valid).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="cosine.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="cosine.dev", key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    # A deleted cluster keeps kopf's finalizer until its resync timer has stopped. A timer caught
    # mid-pass is not cancelled: kopf looks again after `background.cancellation_polling`, 60 s by
    # default, so a deletion landing during a pass took a minute. A pass takes well under a second.
    settings.background.cancellation_polling = 1.0
    if config.peering_lifetime_s is not None:
        settings.peering.lifetime = config.peering_lifetime_s
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


async def _creation_replicas(api: Any, name: str, namespace: str, cluster: ClusterSpec,
                             hand_scaled: set[str]) -> dict[str, int]:
    """Each pool's replicas for a child created now: its ``CoSineDrafterPool``'s ``spec.replicas``
    if the pool exists and was not just scaled by hand, else the spec's; within its bounds. Only a
    Deployment or pool object created by this pass takes them (:func:`kube.apply_scale_free`)."""
    out: dict[str, int] = {}
    for pool in cluster.drafter_pools:
        current = None
        if pool.name not in hand_scaled:
            current = await kube.get(api, POOL_KIND, namespace, pool_object_name(name, pool.name))
        replicas = pool.replicas if current is None else int(current["spec"].get("replicas", pool.replicas))
        out[pool.name] = pool.clamp(replicas)
    return out


def _hand_scaled(cluster: ClusterSpec, old_spec: Any) -> set[str]:
    """Pools whose ``spec.drafterPools[].replicas`` this update changed (the user scaled by hand)."""
    if not old_spec:
        return set()
    try:
        old = {p.name: p.replicas for p in read_stored_spec(old_spec)[0].drafter_pools}
    except ValueError:
        return set()
    return {p.name for p in cluster.drafter_pools if p.name in old and old[p.name] != p.replicas}


async def _prune(api: Any, name: str, namespace: str, cluster: ClusterSpec, children: list[dict[str, Any]],
                 logger: Any) -> list[str]:
    """Delete what the cluster owns and its spec no longer implies (:func:`leftovers`: owned minus
    desired); returns the drafter pools whose children went."""
    pools = {p.name for p in cluster.drafter_pools}
    removed: set[str] = set()
    for kind in CHILD_KINDS:  # kind by kind: a leftover goes as soon as it is seen
        try:
            owned = [(kind, obj) for obj in await kube.list_owned(api, kind, namespace, name)]
        except ApiException as e:
            # another project's API: not installed (403, 404: nothing of it to delete), or its
            # CRD's storage still starting (429) or unavailable (503): its leftovers wait a pass
            if kind not in kube.FOREIGN_KINDS or e.status not in (403, 404, 429, 503):
                raise
            continue
        for _, obj in leftovers(name, cluster, children, owned):
            meta = obj["metadata"]
            if await kube.delete(api, kind, namespace, meta["name"]):
                logger.info(f"deleted {kind} {meta['name']} (no longer in the spec)")
            pool = (meta.get("labels") or {}).get(POOL_LABEL)
            if pool is not None and pool not in pools:
                removed.add(pool)
    return sorted(removed)


async def _replace_resized_group(api: Any, child: dict[str, Any], logger: Any) -> None:
    """A LeaderWorkerSet's group size cannot change in place (LWS's webhook refuses it, and Kueue's
    keeps it immutable): a new ``parallelism.nodes`` deletes the set, and this pass creates it
    anew at the new size. Every group restarts either way: vLLM's world size changed."""
    meta = child["metadata"]
    live = await kube.get(api, "LeaderWorkerSet", meta["namespace"], meta["name"])
    want = child["spec"]["leaderWorkerTemplate"]["size"]
    size = ((live or {}).get("spec") or {}).get("leaderWorkerTemplate", {}).get("size")
    if live is not None and size != want:
        await kube.delete(api, "LeaderWorkerSet", meta["namespace"], meta["name"])
        for _ in range(50):  # the real server removes it at once (no finalizer of ours); wait for that
            if await kube.get(api, "LeaderWorkerSet", meta["namespace"], meta["name"]) is None:
                break
            await asyncio.sleep(0.1)
        logger.info(f"LeaderWorkerSet {meta['name']}: group size {size} -> {want}, recreated")


def _age_s(pod: dict[str, Any], now: datetime.datetime) -> float:
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    if not created:
        return 0.0
    return (now - datetime.datetime.fromisoformat(str(created).replace("Z", "+00:00"))).total_seconds()


def _unscheduled(pod: dict[str, Any]) -> bool:
    """A Pending pod no node took (its ``PodScheduled`` condition is not True): no capacity."""
    st = pod.get("status") or {}
    if st.get("phase", "Pending") != "Pending":
        return False
    return not any(c.get("type") == "PodScheduled" and c.get("status") == "True" for c in st.get("conditions") or ())


async def _spot_fallbacks(api: Any, body: kopf.Body, name: str, namespace: str, cluster: ClusterSpec,
                          drafters: dict[str, dict[str, Any]], generation: int | None,
                          logger: Any) -> list[dict[str, Any]]:
    """Size each spot pool's on-demand sibling (``cosine_spec.capacity.on_demand_fallback``: the
    shortfall once a spot replica is Pending past ``spec.spot.pendingTimeoutSeconds``, back to
    none as spot replicas become Ready); delete a sibling no longer needed (its pods drain on
    SIGTERM). Returns the ``SpotFallback`` condition (none without spot pools)."""
    spot_pools = [p for p in cluster.drafter_pools if p.capacity == "spot" and cluster.spot is not None]
    siblings = {(o["metadata"].get("labels") or {}).get(POOL_LABEL): o
                for o in await kube.list_owned(api, "Deployment", namespace, name)
                if (o["metadata"].get("labels") or {}).get(CAPACITY_LABEL) == "onDemand"}
    for pool, obj in siblings.items():  # a pool back on demand, or gone: its sibling goes
        if pool not in {p.name for p in spot_pools}:
            await kube.delete(api, "Deployment", namespace, obj["metadata"]["name"])
    if not spot_pools:
        return []
    assert cluster.spot is not None
    pods = await kube.list_owned(api, "Pod", namespace, name)
    now = datetime.datetime.now(datetime.UTC)
    messages, standing_in = [], 0
    for pool in spot_pools:
        primary = drafters.get(pool.name) or await kube.get(api, "Deployment", namespace,
                                                             drafter_name(name, pool.name))
        if primary is None:
            continue
        mine = [p for p in pods if (p["metadata"].get("labels") or {}).get(POOL_LABEL) == pool.name
                and (p["metadata"].get("labels") or {}).get(CAPACITY_LABEL) == "spot"]
        sibling = siblings.get(pool.name)
        current = int((sibling or {}).get("spec", {}).get("replicas") or 0)
        fallback = on_demand_fallback(
            int(primary["spec"].get("replicas") or 0), int((primary.get("status") or {}).get("readyReplicas") or 0),
            [_age_s(p, now) for p in mine if _unscheduled(p)], float(cluster.spot.pending_timeout_s), current)
        if fallback.replicas > 0:
            child = build_fallback_deployment(name, namespace, cluster, pool.name, fallback.replicas)
            kopf.adopt(child, owner=body)
            await kube.apply(api, child)
            if fallback.replicas != current:
                logger.info(f"pool {pool.name}: {fallback.replicas} on demand ({fallback.reason})")
        elif sibling is not None:
            await kube.delete(api, "Deployment", namespace, sibling["metadata"]["name"])
            logger.info(f"pool {pool.name}: on-demand fallback removed ({fallback.reason})")
        standing_in += fallback.replicas
        messages.append(f"{pool.name}: {fallback.reason}")
    return [status.condition("SpotFallback", standing_in > 0, "OnDemandStandingIn" if standing_in else "OnSpot",
                             "; ".join(messages), generation, _now())]


def _children_status(
    api: Any, name: str, namespace: str, generation: int | None, cluster: ClusterSpec
) -> Any:
    """The status's part that comes from the children's Deployments, as an async function of the
    live status (``status.build_status``: the autoscaler's fields and conditions are kept).

    The children are read when it is called, i.e. by :func:`_write_status` after each read of the
    live object: a write whose precondition holds then says what the children said no earlier than
    the write before it. Read once beforehand, two Deployment events' writes could land in the
    other order, the earlier view last (CI saw a cluster left at ``1/2`` drafters, not Ready, after
    both pools were: until the next resync)."""
    async def update(live: dict[str, Any]) -> dict[str, Any]:
        names = [drafter_name(name, p.name) for p in cluster.drafter_pools]
        deployments = {n: await kube.get(api, "Deployment", namespace, n) for n in names}
        # a LeaderWorkerSet's replicas and readyReplicas count groups as a Deployment's count pods
        verifier_kind = "LeaderWorkerSet" if cluster.verifier.nodes > 1 else "Deployment"
        deployments[verifier_name(name)] = await kube.get(api, verifier_kind, namespace, verifier_name(name))
        return status.build_status(name, namespace, generation, cluster, deployments, live, _now())
    return update


async def _write_status(api: Any, name: str, namespace: str, update: Any, attempts: int = 5) -> None:
    """Write ``update(live status)`` onto the live CoSineCluster once, with its ``resourceVersion``
    as a precondition; on a conflict (another writer landed first) read it again and retry, as
    controller-runtime's ``RetryOnConflict`` does. ``update`` may be async (it then reads what it
    needs after the live object: :func:`_children_status`). Conditions merge by type in ``update``
    (``status.merge_conditions``), so concurrent writers each keep their own. Gone: nothing to do.
    Raises ``kopf.TemporaryError`` after ``attempts`` conflicts in a row, ``ApiException`` on
    any other failure."""
    for _ in range(attempts):
        live = await kube.get(api, CLUSTER_KIND, namespace, name)
        if live is None or live["metadata"].get("deletionTimestamp"):
            return
        new = update(dict(live.get("status") or {}))
        if inspect.isawaitable(new):
            new = await new
        body = {"metadata": {"resourceVersion": live["metadata"]["resourceVersion"]}, "status": new}
        try:
            await kube.patch(api, CLUSTER_KIND, namespace, name, body, subresource="status")
            return
        except ApiException as e:
            if e.status != 409:
                raise
    raise kopf.TemporaryError(f"status of {namespace}/{name}: {attempts} conflicts in a row", delay=1)


def _stored_cluster(event: str, spec: Any, name: str, namespace: str, memo: kopf.Memo, logger: Any) -> ClusterSpec:
    """The cluster's stored spec, read past fields a later release's CRDs default (version skew: said
    once per event, counted), with the operator's default image for what ``spec.image`` leaves unset.

    Raises:
        kopf.PermanentError: an invalid spec, or ``engineArgs`` that set a flag CoSine sets itself (the
            webhook's check, for installs without it: vLLM takes a flag's last value).
    """
    try:
        cluster, unknown = read_stored_spec(spec)
        problems = engine_args_problems(cluster.verifier)
        if problems:
            raise ValueError("; ".join(problems))
    except ValueError as e:
        memo.metrics.reconciles.labels(event, "invalid").inc()
        raise kopf.PermanentError(f"invalid spec: {e}") from e
    memo.metrics.spec_unknown_fields.labels(namespace, name).set(len(unknown))
    if unknown and event != "resync":
        logger.warning(f"spec fields this operator does not know, ignored (are the CRDs newer than the "
                       f"operator?): {', '.join(sorted(unknown))}")
    return dataclasses.replace(cluster, image=cluster.image.under(memo.config.runtime_image))


async def _reconcile(
    event: str,
    body: kopf.Body,
    spec: Any,
    name: str,
    namespace: str,
    old_spec: Any,
    memo: kopf.Memo,
    logger: Any,
) -> None:
    """One pass: every child applied (scale-free: see the module docstring), the status written once."""
    cluster = _stored_cluster(event, spec, name, namespace, memo, logger)
    api = memo.api
    memo.metrics.cluster_info.labels(namespace, name).set(1)  # a cluster whose verifier must be up
    for pool in cluster.drafter_pools:  # the dashboards' accepted tokens per pool dollar
        memo.metrics.pool_price.labels(namespace, name, pool.name).set(pool.replica_price_per_hour_usd)
        memo.metrics.pool_reconciled(namespace, name, pool.name)
    hand_scaled = _hand_scaled(cluster, old_spec)
    created = await _creation_replicas(api, name, namespace, cluster, hand_scaled)
    drafters: dict[str, dict[str, Any]] = {}  # pool -> its Deployment as applied
    operator = operator_peer(memo.config.namespace, memo.config.pod_labels)
    generation = body.metadata.get("generation")
    models: dict[str, Any] | None = None  # ModelsReady, with spec.modelCache
    claim: dict[str, Any] | None = None  # ModelCacheReady, with a claim the operator makes
    children = build_children(name, namespace, cluster, created, operator)
    for child in children:
        kopf.adopt(child, owner=body)
        step = apply_step(child, hand_scaled, None if models is None else models["status"] == "True")
        if step.how == "skip":
            continue  # no pod that loads a model before the cache holds it
        if step.how == "scale_target":
            await _apply_scale_target(api, name, child, step, drafters)
            continue
        if step.how == "claim":
            claim = await _apply_claim(api, child, generation)
            continue
        if step.replace_if_resized:
            await _replace_resized_group(api, child, logger)
        scale_free = step.how == "apply_scale_free"
        applied = await (kube.apply_scale_free(api, child) if scale_free else kube.apply(api, child))
        if step.drafter_of:
            drafters[step.drafter_of] = applied
        elif step.models_job:
            models = status.models_condition(applied, generation, _now())
    fallbacks = [] if models is not None and models["status"] != "True" else await _spot_fallbacks(
        api, body, name, namespace, cluster, drafters, generation, logger)
    removed = await _prune(api, name, namespace, cluster, children, logger)
    if removed:
        kopf.info(body, reason="PoolsRemoved", message=f"deleted drafter pool(s) {', '.join(removed)}")
    children_status = _children_status(api, name, namespace, generation, cluster)
    extra = [c for c in (models, claim) if c is not None] + fallbacks

    async def update(live: dict[str, Any]) -> dict[str, Any]:
        new = await children_status(live)
        new["conditions"] = status.merge_conditions(new["conditions"], extra)
        return new

    await _write_status(api, name, namespace, update)
    if models is not None and models["status"] != "True":
        memo.metrics.reconciles.labels(event, "waiting").inc()
        # looked at again every 10 s: a running Job finishing, a failed one deleted (and re-created)
        raise kopf.TemporaryError(f"models not in the cache yet: {models['message']}", delay=10)
    memo.metrics.reconciles.labels(event, "ok").inc()
    log = logger.debug if event == "resync" else logger.info
    log(f"reconciled: {len(cluster.drafter_pools)} pool(s), hand-scaled {sorted(hand_scaled)}")


async def _apply_scale_target(api: Any, name: str, child: dict[str, Any], step: ApplyStep,
                              drafters: dict[str, dict[str, Any]]) -> None:
    """A pool's ``CoSineDrafterPool``: applied without its scale (its scaler's after creation), its
    replicas set to the spec's when they changed by hand (``step.rescale``), and its status (the
    selector, which HPA needs before any pod) written from the start."""
    meta = child["metadata"]
    pool = meta["labels"][POOL_LABEL]
    applied = await kube.apply_scale_free(api, child)
    if step.rescale:  # spec.drafterPools[].replicas changed: the pool's new scale
        await kube.patch(api, POOL_KIND, meta["namespace"], meta["name"],
                         {"spec": {"replicas": child["spec"]["replicas"]}})
    await kube.patch(api, POOL_KIND, meta["namespace"], applied["metadata"]["name"],
                     {"status": status.pool_status(name, pool, drafters.get(pool))}, subresource="status")


async def _apply_claim(api: Any, claim: dict[str, Any], generation: int | None) -> dict[str, Any]:
    """Apply the model cache's claim; ``ModelCacheReady``. A claim's spec is immutable once created
    but for growing its storage request: the API server refuses any other change (422), which
    becomes ``ModelCacheReady=False`` naming the field, while the rest of the cluster reconciles on
    the claim as it is (delete the claim, or set the spec back, to resolve)."""
    name = claim["metadata"]["name"]
    try:
        await kube.apply(api, claim)
    except ApiException as e:
        if e.status != 422:
            raise
        message = kube.error_message(e)
        return status.condition("ModelCacheReady", False, "ClaimImmutable",
                                f"spec.modelCache: the claim {name} cannot change as asked ({message}); the "
                                "cluster runs on the claim as it is: restore spec.modelCache or delete the claim",
                                generation, _now())
    return status.condition("ModelCacheReady", True, "Applied", f"claim {name} as spec.modelCache asks",
                            generation, _now())


@kopf.on.create(*CLUSTER)
async def cosinecluster_create(
    body: kopf.Body,
    spec: Any,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    logger: Any,
    **_: Any,
) -> None:
    """Create the children of a new CoSineCluster."""
    await _reconcile("create", body, spec, name, namespace, None, memo, logger)


@kopf.on.update(*CLUSTER, field="spec")
async def cosinecluster_update(
    body: kopf.Body,
    spec: Any,
    old: Any,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    logger: Any,
    **_: Any,
) -> None:
    """Roll out a changed spec (new pod templates, pools scaled by hand or removed)."""
    await _reconcile("update", body, spec, name, namespace, old, memo, logger)


@kopf.on.resume(*CLUSTER)
async def cosinecluster_resume(
    body: kopf.Body,
    spec: Any,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    logger: Any,
    **_: Any,
) -> None:
    """Re-apply the children when the operator restarts (drift repair; scales are the pools')."""
    await _reconcile("resume", body, spec, name, namespace, None, memo, logger)


@kopf.on.update(*CLUSTER, field="spec.verifier.replicas")
async def cosinecluster_scale_verifier(
    new: Any, body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    """``spec.verifier.replicas`` changed (``kubectl scale csc``, an HPA or KEDA on the
    CoSineCluster's scale subresource, an edit): the verifier Deployment follows. The operator's
    only write of that Deployment's replicas after creation; retried while it is absent."""
    replicas = int(new) if new is not None else 1
    deployment = verifier_name(name)
    nodes = int(((body.get("spec") or {}).get("verifier") or {}).get("parallelism", {}).get("nodes") or 1)
    kind = "LeaderWorkerSet" if nodes > 1 else "Deployment"  # a group's replicas are groups
    if await kube.patch(memo.api, kind, namespace, deployment, {"spec": {"replicas": replicas}}) is None:
        raise kopf.TemporaryError(f"{kind} {deployment} does not exist (yet)", delay=2)
    logger.info(f"verifier: {kind} {deployment} scaled to {replicas} (spec.verifier.replicas)")


@kopf.on.delete(*CLUSTER, optional=True)
async def cosinecluster_delete(spec: Any, name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Forget the cluster's own series (the children go with it: owner references). ``optional``:
    no finalizer of its own; kopf's, held for the daemons, is what lets this run."""
    for gauge in (memo.metrics.cluster_info, memo.metrics.spec_unknown_fields):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)
    for pool in (spec or {}).get("drafterPools") or ():
        for gauge in (memo.metrics.desired_replicas, memo.metrics.pool_price):
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name, pool.get("name"))
        for direction in ("up", "down"):
            with contextlib.suppress(KeyError):
                memo.metrics.scale_decisions.remove(namespace, name, pool.get("name"), direction)


@kopf.timer(*CLUSTER, interval=RESYNC_S, initial_delay=RESYNC_S)
async def cosinecluster_resync(
    body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    """Drift repair, kopf's timer on each CoSineCluster: every ``RESYNC_S`` seconds re-apply
    every child from the live spec, as reconcile does (server-side apply: a deleted child is
    created again, a field the operator owns and someone edited is restored, fields other managers
    own, such as an HPA's replicas, stay), and write status. Without it a child changed by hand
    stays changed until the next spec edit or operator restart (controller-runtime's
    ``SyncPeriod`` serves the same end). A failed pass (an invalid spec, models still pulling, an
    API error) is logged and counted; the next one tries again. kopf stops the timer when the
    cluster goes."""
    try:
        await _reconcile("resync", body, body.spec, name, namespace, None, memo, logger)
    except (kopf.TemporaryError, kopf.PermanentError) as e:
        logger.info(f"resync: {e}")
    except Exception as e:  # noqa: BLE001 - one failed pass must not end the cluster's resync
        memo.metrics.reconciles.labels("resync", "error").inc()
        logger.warning(f"resync failed: {e!r}")


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def deployment_event(body: kopf.Body, namespace: str, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """A child Deployment changed (its pods): refresh the owner's status and its pool's status."""
    labels = body.metadata.labels
    cluster_name = labels.get(CLUSTER_LABEL)
    if not cluster_name or body.metadata.get("deletionTimestamp"):
        return
    api = memo.api
    owner = await kube.get(api, CLUSTER_KIND, namespace, cluster_name)
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return
    try:
        cluster, _ = read_stored_spec(owner.get("spec") or {})
    except ValueError:
        return
    update = _children_status(api, cluster_name, namespace, owner["metadata"].get("generation"), cluster)
    await _write_status(api, cluster_name, namespace, update)
    pool = labels.get(POOL_LABEL)
    if pool and body.metadata.name == drafter_name(cluster_name, pool):  # not a spot pool's sibling
        await kube.patch(
            api,
            POOL_KIND,
            namespace,
            pool_object_name(cluster_name, pool),
            {"status": status.pool_status(cluster_name, pool, body)},
            subresource="status",
        )


@kopf.on.resume(*POOL)
@kopf.on.create(*POOL)
@kopf.on.update(*POOL, field="spec")
async def cosinedrafterpool_follow(
    spec: Any, namespace: str, memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    """The pool's ``spec.replicas`` (or its bounds) changed: resize its Deployment to
    ``spec.replicas`` within ``[minReplicas, maxReplicas]``, the only write of that Deployment's
    replicas after its creation. Retried (``kopf.TemporaryError``) while the Deployment is absent."""
    lo, hi = int(spec.get("minReplicas", 0)), int(spec.get("maxReplicas", 1 << 20))
    replicas = clamp_replicas(int(spec.get("replicas", lo)), lo, hi)
    deployment = drafter_name(spec["clusterName"], spec["pool"])
    done = await kube.patch(memo.api, "Deployment", namespace, deployment, {"spec": {"replicas": replicas}})
    if done is None:
        raise kopf.TemporaryError(f"Deployment {deployment} does not exist (yet)", delay=2)
    logger.info(f"pool {spec['pool']}: Deployment {deployment} scaled to {replicas}")


async def _scrape(
    api: Any, name: str, namespace: str, cluster: ClusterSpec, config: OperatorConfig
) -> Scrape:
    """Every Running verifier and drafter pod's ``/metrics`` (failures listed, not raised)."""
    targets = []
    for pod in await kube.list_owned(api, "Pod", namespace, name):
        meta, pod_status = pod["metadata"], pod.get("status") or {}
        ip = pod_status.get("podIP")
        if not ip or pod_status.get("phase", "Running") != "Running" or meta.get("deletionTimestamp"):
            continue
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        role = labels.get(COMPONENT_LABEL)
        if role not in ("verifier", "drafter"):
            continue
        default_port = VERIFIER_METRICS_PORT if role == "verifier" else DRAFTER_METRICS_PORT
        port = annotations.get("prometheus.io/port", str(default_port))
        path = annotations.get("prometheus.io/path", "/metrics")
        targets.append(
            ScrapeTarget(meta["name"], role, labels.get(POOL_LABEL), f"http://{ip}:{port}{path}")
        )
    return await scrape_pods(targets, config.scrape_timeout_s, time.monotonic())


async def _measure(
    api: Any, name: str, namespace: str, cluster: ClusterSpec, previous: Scrape | None, memo: kopf.Memo,
    logger: Any,
) -> tuple[Rates | None, Scrape | None]:
    """This interval's rates (``None``: a first scrape, rates need two) and the scrape to keep:
    from Prometheus (``rate()`` over two intervals) with ``spec.autoscaling.prometheusUrl``, else
    from the pods' own ``/metrics``, two scrapes apart. Unreadable targets are counted and logged;
    an unreadable Prometheus reads as no verifier measured (the rule holds)."""
    url = cluster.autoscaling.prometheus_url
    if url:
        try:
            window_s = max(60.0, 2.0 * cluster.autoscaling.interval_s)
            return await scrape_prometheus(url, namespace, name, window_s, memo.config.scrape_timeout_s), None
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            memo.metrics.scrape_failures.labels("prometheus").inc()
            logger.warning(f"could not query Prometheus at {url}: {type(e).__name__}: {e}")
            return Rates(None), None
    scrape = await _scrape(api, name, namespace, cluster, memo.config)
    for target, why in scrape.failures:
        memo.metrics.scrape_failures.labels(target.role).inc()
        logger.warning(f"could not read {target.role} pod {target.pod}'s metrics at {target.url}: {why}")
    return (rates(previous, scrape) if previous is not None else None), scrape


class _ClusterScaling:
    """One CoSineCluster's autoscaling: the operator's observe, actuate and report around the one
    loop (:class:`~cosine_spec.scaling_loop.ScalingLoop`). Observe scrapes (rates need two
    scrapes, so the first observes nothing); actuate writes a pool's ``spec.replicas`` (nothing
    else: the pool handler resizes the Deployment) with an Event; report writes the
    ``ScalingActive`` condition, each pool's ``PoolTooSlow``/``MetricsMissing`` and its desired
    replicas."""

    def __init__(self, api: Any, body: kopf.Body, name: str, namespace: str, cluster: ClusterSpec,
                 memo: kopf.Memo, logger: Any) -> None:
        self.api, self.body, self.name, self.namespace = api, body, name, namespace
        self.memo, self.logger, self.cluster = memo, logger, cluster
        self.previous: Scrape | None = None
        self.loop = ScalingLoop(policy_from_spec(cluster), self.observe, self.actuate, self.report,
                                on_error=lambda stage, _: memo.metrics.autoscaler_errors.labels(stage).inc(),
                                log=logger)

    def follow(self, cluster: ClusterSpec) -> None:
        """The live spec for the next pass (bounds, prices, interval may have changed)."""
        self.cluster, self.loop.policy = cluster, policy_from_spec(cluster)

    async def observe(self) -> Observations | None:
        measured_rates, self.previous = await _measure(self.api, self.name, self.namespace, self.cluster,
                                                       self.previous, self.memo, self.logger)
        if measured_rates is None:
            return None  # rates need two scrapes
        pool_replicas: dict[str, tuple[int, int]] = {}
        api, ns, name = self.api, self.namespace, self.name
        for pool in self.cluster.drafter_pools:
            scaler = await kube.get(api, POOL_KIND, ns, pool_object_name(name, pool.name))
            deployment = await kube.get(api, "Deployment", ns, drafter_name(name, pool.name))
            if scaler is None:
                continue
            ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
            pool_replicas[pool.name] = (int(scaler["spec"].get("replicas", pool.replicas)), ready)
        return observations_of(measured_rates, pool_replicas)

    async def actuate(self, d: ScaleDecision) -> None:
        direction = "up" if d.desired > d.current else "down"
        await kube.patch(self.api, POOL_KIND, self.namespace, pool_object_name(self.name, d.pool),
                         {"spec": {"replicas": d.desired}})
        self.memo.metrics.scale_decisions.labels(self.namespace, self.name, d.pool, direction).inc()
        kopf.info(self.body, reason=f"Scaled{direction.capitalize()}",
                  message=f"drafter pool {d.pool}: {d.current} → {d.desired} replicas: {d.reason}")
        self.logger.info(f"pool {d.pool}: {d.current} -> {d.desired}: {d.reason}")

    async def report(self, observations: Observations, decisions: Sequence[ScaleDecision]) -> None:
        for d in decisions:
            self.memo.metrics.desired_replicas.labels(self.namespace, self.name, d.pool).set(d.desired)
            if d.condition:
                self.logger.info(f"pool {d.pool}: {d.condition}: {d.reason}")
        measured = observations.verifier is not None
        generation, now = self.body.metadata.get("generation"), _now()
        await _write_status(self.api, self.name, self.namespace, lambda live: status.autoscaler_status(
            live,
            observations,
            decisions,
            measured,
            "Measuring" if measured else "MetricsMissing",
            "sizing drafter pools to the verifier's demand" if measured else "no verifier metrics: every pool holds",
            generation,
            now,
        ))


async def _report_disabled(api: Any, body: kopf.Body, name: str, namespace: str) -> None:
    """``ScalingActive`` = False, reason ``Disabled`` (written once: only if it says otherwise)."""
    previous = dict(body.status)
    conds = {c.get("type"): c for c in previous.get("conditions") or ()}
    if (conds.get("ScalingActive") or {}).get("reason") == "Disabled":
        return
    generation, now = body.metadata.get("generation"), _now()
    await _write_status(api, name, namespace, lambda live: status.autoscaler_status(
        live,
        None,
        (),
        False,
        "Disabled",
        "spec.autoscaling.enabled is false: replicas come from the spec or the pools' scale subresource",
        generation,
        now,
    ))


@kopf.daemon(*CLUSTER, initial_delay=1.0, cancellation_polling=1.0, cancellation_timeout=10.0)
async def cosinecluster_autoscaler(
    body: kopf.Body,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    logger: Any,
    stopped: kopf.DaemonStopped,
    **_: Any,
) -> None:
    """One per CoSineCluster, for the cluster's life: every ``spec.autoscaling.intervalSeconds``
    scrape, decide with ``desired_replicas`` and write the pools' ``spec.replicas``.

    Wakes every ``OperatorConfig.tick_s`` seconds to read the (live) spec, so a changed interval,
    ``enabled: false`` or a deletion is noticed within a tick. Its memory (the previous scrape, the
    stabilization window) is local: it goes when the cluster does, and is reset while disabled.
    The pass is the one scaling loop's (:class:`_ClusterScaling`): a failed stage (a scrape, an API
    call) is counted (``cosine_operator_autoscaler_errors{stage}``) and logged with its cause, and
    the next interval tries again; kopf cancels a pass still running ``cancellation_timeout`` s
    after the cluster's deletion.
    """
    api, config = memo.api, memo.config
    scaling: _ClusterScaling | None = None  # None while disabled: its memory goes with it
    last_scrape_s = float("-inf")
    while not stopped:
        try:
            cluster, _ = read_stored_spec(body.spec)
        except ValueError:
            cluster = None  # reconcile reports an invalid spec
        try:
            if cluster is not None and not cluster.autoscaling.enabled:
                scaling, last_scrape_s = None, float("-inf")
                await _report_disabled(api, body, name, namespace)
            elif cluster is not None and time.monotonic() - last_scrape_s >= cluster.autoscaling.interval_s:
                last_scrape_s = time.monotonic()
                if scaling is None:
                    scaling = _ClusterScaling(api, body, name, namespace, cluster, memo, logger)
                scaling.follow(cluster)
                await scaling.loop.tick(time.monotonic())
        except Exception as e:  # noqa: BLE001 - reporting "disabled" failed: try again next tick
            logger.warning(f"autoscaler pass failed: {e!r}")
        # A plain sleep, not `stopped.wait(tick_s)`: kopf 1.45.2 runs that time limit as a task of
        # its own, which can time out while the operator stops and then fails the operator's exit
        # (seen as a TimeoutError from `run_tasks`); the loop sees `stopped` within a tick anyway.
        await asyncio.sleep(config.tick_s)
