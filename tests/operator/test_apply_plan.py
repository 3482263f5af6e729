"""The per-kind apply policy (apply_plan.py), as a pure plan: child and observations in, step out."""

from __future__ import annotations

from typing import Any

from cosine_spec.cluster_spec import parse_cluster_spec

from cosine_operator.apply_plan import ApplyStep, apply_step
from cosine_operator.builders.inventory import build_children

SPEC: dict[str, Any] = {
    "verifier": {"model": "qwen2.5-coder-1.5b-instruct"},
    "drafterPools": [{"name": "code", "model": "qwen2.5-coder-0.5b-instruct"}],
    "modelCache": {"size": "10Gi"},
    "router": {"enabled": True, "gatewayName": "gw"},
}
CHILDREN = build_children("demo", "ns", parse_cluster_spec(SPEC), {})


def _child(kind: str, name: str) -> dict[str, Any]:
    (child,) = [c for c in CHILDREN if c["kind"] == kind and c["metadata"]["name"] == name]
    return child


def test_each_kind_is_applied_as_its_owner_of_scale_requires() -> None:
    steps = {(c["kind"], c["metadata"]["name"]): apply_step(c, set(), True) for c in CHILDREN}
    assert steps["Deployment", "demo-verifier"] == ApplyStep("apply_scale_free")
    assert steps["Deployment", "demo-drafter-code"] == ApplyStep("apply_scale_free", drafter_of="code")
    assert steps["Deployment", "demo-epp"] == ApplyStep("apply")  # the picker's replicas are the spec's
    assert steps["CoSineDrafterPool", "demo-code"] == ApplyStep("scale_target")
    assert steps["PersistentVolumeClaim", "demo-models"] == ApplyStep("claim")
    (job,) = [k for k in steps if k[0] == "Job"]
    assert steps[job] == ApplyStep("apply", models_job=True)
    assert steps["Service", "demo-verifier"] == steps["ConfigMap", "demo-config"] == ApplyStep("apply")


def test_a_hand_scaled_pool_is_rescaled() -> None:
    assert apply_step(_child("CoSineDrafterPool", "demo-code"), {"code"}, None).rescale
    assert not apply_step(_child("CoSineDrafterPool", "demo-code"), {"other"}, None).rescale


def test_nothing_that_loads_a_model_starts_before_the_cache_holds_it() -> None:
    """Catches: pods crash-looping on a model the pull Job has not written yet."""
    waiting = {(c["kind"], c["metadata"]["name"]) for c in CHILDREN if apply_step(c, set(), False).how == "skip"}
    assert waiting == {("Deployment", "demo-verifier"), ("Deployment", "demo-drafter-code"),
                       ("CoSineDrafterPool", "demo-code"), ("Deployment", "demo-epp")}
    assert not any(apply_step(c, set(), None).how == "skip" for c in CHILDREN)  # no Job seen yet


def test_a_leader_worker_set_is_scale_free_and_replaced_when_resized() -> None:
    spec = {**SPEC, "verifier": {"model": "m", "resources": {"limits": {"nvidia.com/gpu": 8}},
                                 "parallelism": {"nodes": 2}}}
    (group,) = [c for c in build_children("demo", "ns", parse_cluster_spec(spec), {}) if c["kind"] == "LeaderWorkerSet"]
    assert apply_step(group, set(), True) == ApplyStep("apply_scale_free", replace_if_resized=True)
