"""Typed spec views (operator/settings.py): the drafter engine's default rule and
``spec.speculation``, against the CRD in crds/ (its defaults, enum and bounds, read from the file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from cosine.operator import settings as s

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
GPU = {"limits": {"nvidia.com/gpu": 1}}


def _spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "cosine.dev_cosineclusters.yaml").read_text())
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])


def _speculation_schema() -> dict[str, Any]:
    return dict(_spec_schema()["properties"]["speculation"]["properties"])


def _engine_schema() -> dict[str, Any]:
    return dict(_spec_schema()["properties"]["drafterPools"]["items"]["properties"]["engine"])


def _cluster(*pools: dict[str, Any], **spec: Any) -> s.ClusterSpec:
    return s.parse_cluster_spec({"verifier": {"model": "m"}, "drafterPools": list(pools), **spec})


def test_speculation_defaults_are_the_crds() -> None:
    crd = _speculation_schema()
    got = _cluster({"name": "p", "model": "m"}).speculation
    assert (got.max_draft_len, got.adaptive, got.fusion, got.min_confidence) == (
        crd["maxDraftLen"]["default"],
        crd["adaptive"]["default"],
        crd["fusion"]["default"],
        crd["minConfidence"]["default"],
    )
    assert "compression" not in crd


def test_speculation_is_parsed() -> None:
    got = _cluster(
        {"name": "p", "model": "m"},
        speculation={"maxDraftLen": 4, "adaptive": False, "fusion": False, "minConfidence": 0.4},
    ).speculation
    assert got == s.SpeculationSpec(max_draft_len=4, adaptive=False, fusion=False, min_confidence=0.4)


def test_speculation_bounds_agree_with_the_crd() -> None:
    crd = _speculation_schema()
    k_min, k_max = crd["maxDraftLen"]["minimum"], crd["maxDraftLen"]["maximum"]
    c_min, c_max = crd["minConfidence"]["minimum"], crd["minConfidence"]["maximum"]
    assert s.MAX_DRAFT_LEN == k_max
    assert (c_min, c_max) == (0, 1)
    s.SpeculationSpec(max_draft_len=k_min, min_confidence=c_min)
    s.SpeculationSpec(max_draft_len=k_max, min_confidence=c_max)
    for bad in ({"max_draft_len": k_min - 1}, {"max_draft_len": k_max + 1},
                {"min_confidence": c_min - 0.01}, {"min_confidence": c_max + 0.01}):
        with pytest.raises(ValueError, match=r"^spec\.speculation\."):
            s.SpeculationSpec(**bad)


def test_engine_enum_and_documented_default_match_the_code() -> None:
    crd = _engine_schema()
    assert tuple(crd["enum"]) == s.DRAFTER_ENGINES
    assert "default" not in crd  # it depends on the device: resolved_engine decides
    assert "default: llamacpp when the pool requests no nvidia.com/gpu, vllm otherwise" in " ".join(
        crd["description"].split()
    )


@pytest.mark.parametrize(
    ("pool", "engine"),
    [
        ({"model": "m"}, "llamacpp"),
        ({"model": "m", "resources": {"requests": {"cpu": "2"}}}, "llamacpp"),
        ({"model": "m", "resources": GPU}, "vllm"),
        ({"model": "m", "resources": {"requests": {"nvidia.com/gpu": 1}}}, "vllm"),
        ({"model": "m", "engine": "llamacpp", "resources": GPU}, "llamacpp"),  # llama.cpp offloads
        ({"model": "m", "engine": "vllm"}, "vllm"),  # vLLM's CPU build
        ({"kind": "ngram"}, None),
    ],
)
def test_resolved_engine(pool: dict[str, Any], engine: str | None) -> None:
    got = _cluster({"name": "p", **pool}).drafter_pools[0]
    assert got.engine == pool.get("engine")
    assert got.resolved_engine == engine


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_name_each_model_pools_engine_for_its_device(path: Path) -> None:
    cluster = s.parse_cluster_spec(yaml.safe_load(path.read_text())["spec"])
    for pool in cluster.drafter_pools:
        if pool.kind == "model":
            assert pool.engine == ("vllm" if pool.pod.requests_gpu else "llamacpp"), pool.name
        else:
            assert pool.engine is None
