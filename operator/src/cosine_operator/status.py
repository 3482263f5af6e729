"""Pure builders of ``CoSineCluster.status``: conditions in the standard shape, replica counts.

Conditions (``type``, ``status`` True/False/Unknown, ``reason``, ``message``,
``lastTransitionTime``, ``observedGeneration``): ``VerifierReady``, ``DraftersReady`` and
``Ready`` come from the children's Deployments (:func:`build_status`); ``ScalingActive`` comes
from the autoscaler (:func:`autoscaler_status`). Each writer replaces only its own conditions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cosine_spec.autoscaling import Observations, ScaleDecision
from cosine_spec.cluster_spec import ClusterSpec

from cosine_operator.builders.names import drafter_name, gateway_name, pool_selector, verifier_name, verifier_selector

Status = dict[str, Any]


def condition(
    type_: str, ok: bool | None, reason: str, message: str, generation: int | None, now: str
) -> dict[str, Any]:
    """One condition; ``ok=None`` means ``Unknown``."""
    out: dict[str, Any] = {
        "type": type_,
        "status": "Unknown" if ok is None else ("True" if ok else "False"),
        "reason": reason,
        "message": message,
        "lastTransitionTime": now,
    }
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def merge_conditions(
    previous: Iterable[Mapping[str, Any]] | None, updates: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Replace conditions by type; keep ``lastTransitionTime`` when the status did not change."""
    merged = {c["type"]: dict(c) for c in previous or () if "type" in c}
    for new in updates:
        old = merged.get(new["type"])
        entry = dict(new)
        if old is not None and old.get("status") == new["status"] and "lastTransitionTime" in old:
            entry["lastTransitionTime"] = old["lastTransitionTime"]
        merged[new["type"]] = entry
    order = ["Ready", "ModelCacheReady", "ModelsReady", "VerifierReady", "DraftersReady", "ScalingActive"]
    return sorted(merged.values(), key=lambda c: order.index(c["type"]) if c["type"] in order else 99)


def models_condition(job: Mapping[str, Any] | None, generation: int | None, now: str) -> dict[str, Any]:
    """``ModelsReady`` from the model pull Job (``spec.modelCache``): True once it succeeded, False
    while it runs (``Pulling``) or after it failed (``PullFailed``: the reason is in its pod's
    log; deleting the Job makes the operator run it again)."""
    name = ((job or {}).get("metadata") or {}).get("name", "")
    observed = (job or {}).get("status") or {}
    if int(observed.get("succeeded") or 0) >= 1:
        return condition("ModelsReady", True, "Pulled", f"Job {name} pulled the models", generation, now)
    failed = any(c.get("type") == "Failed" and c.get("status") == "True" for c in observed.get("conditions") or ())
    if failed:
        return condition("ModelsReady", False, "PullFailed",
                         f"Job {name} failed: see `kubectl logs job/{name}`; delete the Job to retry",
                         generation, now)
    return condition("ModelsReady", False, "Pulling", f"Job {name} is pulling the models into the cache; "
                     "verifier and drafter pods start when it succeeds", generation, now)


def _counts(deployment: Mapping[str, Any] | None) -> tuple[int, int]:
    """(desired replicas, ready replicas) of a Deployment, (0, 0) if absent."""
    if not deployment:
        return 0, 0
    desired = int((deployment.get("spec") or {}).get("replicas") or 0)
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    return desired, ready


def pool_status(cluster: str, pool: str, deployment: Mapping[str, Any] | None) -> Status:
    """A ``CoSineDrafterPool``'s status, what its scale subresource reports: ``replicas``, the pods
    its Deployment has (``status.replicas``, not the desired count), ``readyReplicas``, and the
    pods' label ``selector`` (known from creation on, before any pod exists)."""
    observed = (deployment or {}).get("status") or {}
    return {
        "replicas": int(observed.get("replicas") or 0),
        "readyReplicas": int(observed.get("readyReplicas") or 0),
        "selector": pool_selector(cluster, pool),
    }


def build_status(
    name: str,
    namespace: str,
    generation: int | None,
    cluster: ClusterSpec,
    deployments: Mapping[str, Mapping[str, Any] | None],
    previous: Mapping[str, Any] | None,
    now: str,
) -> Status:
    """Status from the children's Deployments (by name); autoscaler fields of ``previous`` are kept."""
    previous = previous or {}
    verifier = deployments.get(verifier_name(name))
    v_desired, v_ready = _counts(verifier)
    # the Deployment's replicas once it exists: whoever scales the verifier (an HPA) sets them
    v_want = v_desired if verifier else cluster.verifier.replicas
    old_pools = {p.get("name"): p for p in previous.get("pools") or ()}
    pools = []
    d_desired = d_ready = 0
    pools_ready = True
    for pool in cluster.drafter_pools:
        desired, ready = _counts(deployments.get(drafter_name(name, pool.name)))
        d_desired += desired
        d_ready += ready
        pools_ready &= ready >= max(desired, 1) or (desired == 0 and pool.min_replicas == 0)
        entry = {k: v for k, v in (old_pools.get(pool.name) or {}).items()}
        entry.update({"name": pool.name, "replicas": desired, "readyReplicas": ready})
        entry.setdefault("desiredReplicas", desired)
        pools.append(entry)
    verifier_ok = v_ready >= max(v_want, 1)
    ready = verifier_ok and pools_ready
    conditions = [
        condition(
            "VerifierReady",
            verifier_ok,
            "ReplicasReady" if verifier_ok else "ReplicasNotReady",
            f"{v_ready}/{v_want} verifier replicas ready",
            generation,
            now,
        ),
        condition(
            "DraftersReady",
            pools_ready,
            "ReplicasReady" if pools_ready else "ReplicasNotReady",
            f"{d_ready}/{d_desired} drafter replicas ready in {len(pools)} pool(s)",
            generation,
            now,
        ),
        condition(
            "Ready",
            ready,
            "AllReplicasReady" if ready else "Waiting",
            "verifier and every drafter pool serve" if ready else "waiting for verifier or drafter pods",
            generation,
            now,
        ),
    ]
    phase = "Ready" if ready else ("Degraded" if v_ready or d_ready else "Pending")
    return {
        "observedGeneration": generation,
        "phase": phase,
        "verifier": {
            "replicas": v_desired,
            "readyReplicas": v_ready,
            "ready": f"{v_ready}/{v_want}",
            # the scale subresource's labelSelectorPath (HPA on the CoSineCluster)
            "selector": verifier_selector(name),
        },
        "drafters": {"replicas": d_desired, "readyReplicas": d_ready, "ready": f"{d_ready}/{d_desired}"},
        "pools": pools,
        "gatewayUrl": f"http://{gateway_name(name)}.{namespace}.svc:{cluster.gateway.port}",
        "conditions": merge_conditions(previous.get("conditions"), conditions),
    }


def autoscaler_status(
    previous: Mapping[str, Any] | None,
    observations: Observations | None,
    decisions: Sequence[ScaleDecision],
    active: bool,
    reason: str,
    message: str,
    generation: int | None,
    now: str,
) -> Status:
    """The autoscaler's part of the status: measurements, per-pool desired replicas, ScalingActive."""
    previous = previous or {}
    out: Status = {}
    pools = [dict(p) for p in previous.get("pools") or ()]
    by_name = {p.get("name"): p for p in pools}
    if observations is not None:
        v = observations.verifier
        if v is not None:
            out["tokensVerifiedPerSecond"] = round(v.tokens_verified_per_s, 3)
            if v.step_s is not None:
                out["verifierStepSeconds"] = round(v.step_s, 5)
        drafted = {p.name: p.accepted_tokens_per_s / p.acceptance_rate for p in observations.pools
                   if p.acceptance_rate}
        if drafted:
            accepted = sum(p.accepted_tokens_per_s for p in observations.pools if p.name in drafted)
            out["acceptanceRate"] = round(accepted / sum(drafted.values()), 4)
        out["draftTokensPerSecond"] = round(sum(p.draft_tokens_per_s for p in observations.pools), 3)
        for p in observations.pools:
            entry = by_name.setdefault(p.name, {"name": p.name})
            entry["draftTokensPerSecond"] = round(p.draft_tokens_per_s, 3)
            entry["demandPerSecond"] = round(p.demand_per_s(), 3)
            if p.acceptance_rate is not None:
                entry["acceptanceRate"] = round(p.acceptance_rate, 4)
    for d in decisions:
        entry = by_name.setdefault(d.pool, {"name": d.pool})
        entry["desiredReplicas"] = d.desired
        entry["lastDecision"] = d.reason
        if d.condition:
            entry["condition"] = d.condition
        else:
            entry.pop("condition", None)
    if by_name:
        out["pools"] = list(by_name.values())
    changed = [d for d in decisions if d.changed]
    if changed:
        out["lastScaleTime"] = now
        out["lastScaleDecision"] = "; ".join(
            f"{d.pool}: {d.current}→{d.desired} ({d.reason})" for d in changed
        )
    conditions = [condition("ScalingActive", active, reason, message, generation, now)]
    if observations is not None:  # per decision: a pool no size makes useful, a series not read
        for type_, cause in (("PoolTooSlow", "RoundExceedsStep"), ("MetricsMissing", "SeriesNotRead")):
            hit = [d for d in decisions if d.condition == type_]
            text = "; ".join(f"pool {d.pool}: {d.reason}" for d in hit) or "none"
            conditions.append(condition(type_, bool(hit), cause if hit else "None", text, generation, now))
    out["conditions"] = merge_conditions(previous.get("conditions"), conditions)
    return out
