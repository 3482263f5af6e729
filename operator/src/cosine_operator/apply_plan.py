"""How a pass applies each child: a pure plan from the child and what the pass has observed (the
pools scaled by hand, whether the model cache holds the models yet), which the handlers carry out.

The rules, by kind: a pod that loads a model waits for the cache (with ``spec.modelCache``, no
Deployment, LeaderWorkerSet or scale target before the pull Job succeeded); a Deployment or a
LeaderWorkerSet is applied without ``spec.replicas`` after creation (whoever scales it owns them),
but for the endpoint picker's, whose replicas are the spec's; a pool's ``CoSineDrafterPool`` is
its scale target (its replicas patched only when the spec's changed by hand, its status written
from the start); the model cache's claim is applied with its refusal turned into a condition; a
LeaderWorkerSet whose group size changed is replaced; everything else is applied whole.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cosine_spec.contract import COMPONENT_LABEL, POOL_KIND, POOL_LABEL

from cosine_operator.builders.names import ROUTER_COMPONENT

How = Literal["skip", "apply", "apply_scale_free", "claim", "scale_target"]
LOADS_MODELS = ("Deployment", "LeaderWorkerSet", POOL_KIND)  # kinds whose pods load a model


@dataclass(frozen=True)
class ApplyStep:
    """What a pass does with one child. ``how``: ``skip`` (it would load a model the cache does not
    hold yet), ``apply`` (server-side apply of the whole child), ``apply_scale_free`` (apply,
    without ``spec.replicas`` once it exists), ``claim`` (the model cache's claim) or
    ``scale_target`` (a pool's ``CoSineDrafterPool``). ``rescale``: patch the scale target's
    replicas to the spec's. ``replace_if_resized``: delete a LeaderWorkerSet whose group size
    differs first. ``drafter_of``: the pool whose Deployment this is (its scale target's status and
    its fallback read it). ``models_job``: the pull Job, whose status says whether the cache is ready."""

    how: How
    rescale: bool = False
    replace_if_resized: bool = False
    drafter_of: str | None = None
    models_job: bool = False


def apply_step(child: Mapping[str, Any], hand_scaled: Collection[str], models_ready: bool | None) -> ApplyStep:
    """The step for ``child``; ``hand_scaled``: the pools whose ``spec.drafterPools[].replicas``
    this update changed; ``models_ready``: the pull Job's verdict so far (``None``: no Job seen)."""
    kind, labels = child["kind"], child["metadata"].get("labels") or {}
    pool = labels.get(POOL_LABEL)
    if kind in LOADS_MODELS and models_ready is False:
        return ApplyStep("skip")
    if kind == POOL_KIND:
        return ApplyStep("scale_target", rescale=pool in hand_scaled)
    if kind == "PersistentVolumeClaim":
        return ApplyStep("claim")
    scaled_by_others = kind == "LeaderWorkerSet" or (
        kind == "Deployment" and labels.get(COMPONENT_LABEL) != ROUTER_COMPONENT)
    return ApplyStep(
        "apply_scale_free" if scaled_by_others else "apply",
        replace_if_resized=kind == "LeaderWorkerSet",
        drafter_of=pool if kind == "Deployment" else None,
        models_job=kind == "Job",
    )
