"""Generate the CRDs' field facts from the spec's declarations (a development script, as
controller-gen is for Go types: `make crds`).

    python spec/crdgen.py            # rewrite crds/ and the chart's copy
    python spec/crdgen.py --check    # exit 1, naming the files, when they differ from what it writes

One source: every `spec_field` of the spec types (`cosine_spec.cluster_spec` and its parts)
declares its key, default, minimum, maximum and enum once, in Python; this script writes them
into the CoSineCluster CRD (and the
replica bounds into the CoSineDrafterPool CRD), in `crds/`, and copies both into the chart. What
only a CRD can say stays written in it: descriptions, CEL rules, printer columns, subresources,
the status schema. A field declared on one side only is an error naming it (add its property,
with its description, to the CRD; or its `spec_field` to the types). `tests/spec/test_crdgen.py`
fails when the committed files are not what this writes.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT / "crds"
CHART_CRDS = ROOT / "charts" / "cosine-operator" / "crds"
CLUSTER_CRD = "cosine.dev_cosineclusters.yaml"
POOL_CRD = "cosine.dev_cosinedrafterpools.yaml"
FACTS = ("default", "minimum", "maximum", "enum")
POOL_BOUNDS = ("replicas", "minReplicas", "maxReplicas")  # the pool CRD's spec, bounded as spec.drafterPools[]'s


def _yaml() -> Any:
    from ruamel.yaml import YAML

    y = YAML()  # round trip: comments, key order and quoting are kept
    y.preserve_quotes = True
    y.width = 120
    y.indent(mapping=2, sequence=2, offset=0)
    return y


def _properties(schema: Mapping[str, Any], verbatim: set[str], prefix: str = "") -> dict[str, Any]:
    """Every field node under `schema` by spec path (`drafterPools[].replicas`); a field copied
    verbatim into pods (Kubernetes' own types) is a leaf: its inner schema is Kubernetes'."""
    out: dict[str, Any] = {}
    for key, prop in (schema.get("properties") or {}).items():
        path = prefix + key
        items = prop.get("items") or {}
        if path not in verbatim and prop.get("type") == "object" and "properties" in prop:
            out.update(_properties(prop, verbatim, f"{path}."))
        elif path not in verbatim and prop.get("type") == "array" and items.get("type") == "object":
            out.update(_properties(items, verbatim, f"{path}[]."))
        else:
            out[path] = prop
    return out


def _set_facts(node: Any, decl: Mapping[str, Any]) -> None:
    for fact in FACTS:
        value = decl.get(fact)
        if value is None:
            node.pop(fact, None)
        else:
            node[fact] = list(value) if fact == "enum" else value


def _spec_schema(crd: Any) -> Any:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def generate() -> dict[str, str]:
    """The CRD files' text as `make crds` writes them, by file name.

    Raises:
        ValueError: a field declared in the types and not in the CRD, or the other way round.
    """
    from cosine_spec import schema
    from cosine_spec.cluster_spec import ClusterSpec

    y = _yaml()
    declared = schema.spec_declarations(ClusterSpec)
    verbatim = {path for path, d in declared.items() if d["verbatim"]}
    out: dict[str, str] = {}

    cluster = y.load((CRDS / CLUSTER_CRD).read_text())
    nodes = _properties(_spec_schema(cluster), verbatim)
    only_types, only_crd = sorted(set(declared) - set(nodes)), sorted(set(nodes) - set(declared))
    if only_types or only_crd:
        raise ValueError(f"{CLUSTER_CRD}: fields only in cosine_spec.cluster_spec: {only_types or 'none'}; "
                         f"only in the CRD: {only_crd or 'none'}")
    for path, decl in declared.items():
        if not decl["verbatim"]:
            _set_facts(nodes[path], decl)
    out[CLUSTER_CRD] = _dump(y, cluster)

    pool = y.load((CRDS / POOL_CRD).read_text())
    pool_spec = _spec_schema(pool)["properties"]
    for key in POOL_BOUNDS:
        decl = declared[f"drafterPools[].{key}"]
        _set_facts(pool_spec[key], {"minimum": decl["minimum"], "maximum": decl["maximum"]})
    out[POOL_CRD] = _dump(y, pool)
    return out


def _dump(y: Any, data: Any) -> str:
    text = io.StringIO()
    y.dump(data, text)
    # a folded plain scalar's line ends are not part of its value: no trailing blanks
    return "".join(line.rstrip() + "\n" for line in text.getvalue().splitlines())


def main(argv: list[str]) -> int:
    files = generate()
    stale = [d / name for name, text in files.items() for d in (CRDS, CHART_CRDS) if (d / name).read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path.relative_to(ROOT)} differs from what `make crds` writes", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(files[path.name])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
