"""Regenerate manifests/cosine-operator.yaml from the chart (default values), offline.

    python manifests/render.py

tests/operator/test_manifests.py fails when the file and the chart disagree.
"""

from __future__ import annotations

from pathlib import Path

import helm_python as helm

ROOT = Path(__file__).resolve().parent.parent
RELEASE, NAMESPACE = "cosine", "cosine-system"
# The chart's self-signed webhook certificate is generated at render time, so a fixed file cannot
# carry one: the plain manifests leave the webhook out (the CRD's CEL rules still validate; use the
# chart, or the chart with webhook.certManager.enabled, for the tokenizer check).
VALUES = {"webhook": {"enabled": False}}
HEADER = f"""# cosine-operator as plain YAML (generated from charts/cosine-operator by manifests/render.py).
#   kubectl apply --server-side -f crds/
#   kubectl create namespace {NAMESPACE}
#   kubectl apply -f manifests/cosine-operator.yaml
"""


def render() -> str:
    """The chart's templates with default values, in a stable order, as one YAML stream."""
    with helm.Chart.load(ROOT / "charts" / "cosine-operator") as chart:
        out = chart.render(VALUES, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path in sorted(out):
        if path.endswith(".yaml") and out[path].strip():
            docs.append(out[path].strip())
    return HEADER + "\n---\n".join(docs) + "\n"


if __name__ == "__main__":
    (ROOT / "manifests" / "cosine-operator.yaml").write_text(render())
