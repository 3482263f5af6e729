"""Status builders: conditions in the standard shape, transitions, autoscaler fields."""

from __future__ import annotations

from cosine_spec.autoscaling import Observations, PoolObservation, ScaleDecision, VerifierObservation
from cosine_spec.cluster_spec import parse_cluster_spec

from cosine_operator.status import autoscaler_status, build_status

SPEC = parse_cluster_spec({"verifier": {"model": "m"}, "drafterPools": [{"name": "code", "model": "m"}]})


def deployments(v_ready: int, d_ready: int) -> dict:
    return {
        "demo-verifier": {"spec": {"replicas": 1}, "status": {"readyReplicas": v_ready}},
        "demo-drafter-code": {"spec": {"replicas": 2}, "status": {"readyReplicas": d_ready}},
    }


def conds(status: dict) -> dict:
    return {c["type"]: c for c in status["conditions"]}


def test_pending_then_ready_keeps_transition_times_of_unchanged_conditions() -> None:
    first = build_status("demo", "ns", 1, SPEC, deployments(1, 0), None, "t1")
    assert first["phase"] == "Degraded"
    c = conds(first)
    assert (c["VerifierReady"]["status"], c["DraftersReady"]["status"], c["Ready"]["status"]) == (
        "True",
        "False",
        "False",
    )
    assert c["Ready"]["observedGeneration"] == 1
    second = build_status("demo", "ns", 1, SPEC, deployments(1, 2), first, "t2")
    c2 = conds(second)
    assert second["phase"] == "Ready" and c2["Ready"]["status"] == "True"
    assert c2["Ready"]["lastTransitionTime"] == "t2"
    assert c2["VerifierReady"]["lastTransitionTime"] == "t1"  # unchanged since t1
    assert second["verifier"]["ready"] == "1/1" and second["drafters"]["ready"] == "2/2"
    assert second["gatewayUrl"] == "http://demo-gateway.ns.svc:8000"


def test_autoscaler_status_records_measurements_and_decisions() -> None:
    previous = build_status("demo", "ns", 1, SPEC, deployments(1, 2), None, "t1")
    o = Observations(VerifierObservation(0.04, 120.0, 3, 0), (
        PoolObservation("code", 2, 2, asks_per_s=30.0, late_per_s=10.0, skipped_per_s={"late": 5.0, "yield": 9.0},
                        accepted_tokens_per_s=45.0, acceptance_rate=0.75),
        PoolObservation("slow", 1, 1, asks_per_s=1.0, accepted_tokens_per_s=5.0, acceptance_rate=0.25)))
    decisions = [ScaleDecision("code", 2, 3, "growing"), ScaleDecision("slow", 1, 1, "round 90 ms ...", "PoolTooSlow")]
    out = autoscaler_status(previous, o, decisions, True, "Measuring", "ok", 1, "t2")
    assert out["acceptanceRate"] == 0.625 and out["verifierStepSeconds"] == 0.04  # 50 of 80 drafted tokens
    code, slow = out["pools"][:2] if out["pools"][0]["name"] == "code" else out["pools"][1::-1]
    assert code["desiredReplicas"] == 3 and code["readyReplicas"] == 2 and code["acceptanceRate"] == 0.75
    assert code["demandPerSecond"] == 45.0 and "condition" not in code  # asks, late steps, late skips
    assert slow["condition"] == "PoolTooSlow"
    assert "code: 2→3 (growing)" in out["lastScaleDecision"]
    c = conds(out)
    assert c["ScalingActive"]["status"] == "True" and c["Ready"]["status"] == "True"
    assert c["PoolTooSlow"]["status"] == "True" and "pool slow: round 90 ms" in c["PoolTooSlow"]["message"]
    assert c["MetricsMissing"]["status"] == "False"
