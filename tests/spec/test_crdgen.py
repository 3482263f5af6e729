"""`make crds` (spec/crdgen.py): the CRDs' field facts are generated from the spec's declarations,
and the committed files (crds/ and the chart's copy) are what it writes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml
from cosine_spec import schema
from cosine_spec.cluster_spec import ClusterSpec

ROOT = Path(__file__).resolve().parents[2]


def _crdgen():  # noqa: ANN202 - a development script, loaded from its file
    spec = importlib.util.spec_from_file_location("crdgen", ROOT / "spec" / "crdgen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_crds_are_what_make_crds_writes() -> None:
    """Catches: a default, bound or enum changed in cosine_spec's types and not regenerated (or
    edited in a CRD by hand); a chart copy that differs from crds/."""
    assert _crdgen().main(["--check"]) == 0


def test_a_declaration_is_what_the_crd_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: a generator that copies the files through without writing the declarations in."""
    crdgen = _crdgen()
    declared = schema.spec_declarations(ClusterSpec)
    changed = {**declared, "speculation.maxDraftLen": {**declared["speculation.maxDraftLen"], "default": 5},
               "drafterPools[].maxReplicas": {**declared["drafterPools[].maxReplicas"], "minimum": 2}}
    monkeypatch.setattr(schema, "spec_declarations", lambda _cls: changed)
    files = crdgen.generate()
    cluster = yaml.safe_load(files[crdgen.CLUSTER_CRD])["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert cluster["properties"]["spec"]["properties"]["speculation"]["properties"]["maxDraftLen"]["default"] == 5
    pool = yaml.safe_load(files[crdgen.POOL_CRD])["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert pool["properties"]["spec"]["properties"]["maxReplicas"]["minimum"] == 2


def test_a_field_on_one_side_only_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: a typed field the CRD lacks (the API server would prune it) passing unnoticed."""
    crdgen = _crdgen()
    declared = schema.spec_declarations(ClusterSpec)
    extra = {**declared, "speculation.maxDraftLenn": declared["speculation.maxDraftLen"]}
    monkeypatch.setattr(schema, "spec_declarations", lambda _cls: extra)
    with pytest.raises(ValueError, match=r"only in cosine_spec.cluster_spec: \['speculation.maxDraftLenn'\]"):
        crdgen.generate()
    fewer = {k: v for k, v in declared.items() if k != "verifier.dtype"}
    monkeypatch.setattr(schema, "spec_declarations", lambda _cls: fewer)
    with pytest.raises(ValueError, match=r"only in the CRD: \['verifier.dtype'\]"):
        crdgen.generate()
