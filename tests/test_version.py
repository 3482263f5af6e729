"""One version: the chart's appVersion (charts/cosine-operator/Chart.yaml) tags the images (the
Makefile's VERSION) and the chart; the runtime image tag the operator gives pods by default
(``RUNTIME_TAG``) and every distribution carry the same.

Catches: a release that bumps one place only. With ``imagePullPolicy: IfNotPresent``, a node that
holds ``cosine:<old>-cuda`` would keep running the old code under the new operator's arguments."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import yaml
from cosine_spec.pods import CUDA_TAG_SUFFIX, RUNTIME_TAG, ImageSpec, RoleImage

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "cosine-operator" / "Chart.yaml"
DISTRIBUTIONS = ("spec", "runtime", "operator")


def _make(*names: str) -> list[str]:
    """Makefile variables as make expands them by default (no overrides from the environment)."""
    rule = "print:\n\t@echo " + " ".join(f"'$({n})'" for n in names) + "\n"
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_IMAGE", "IMAGE_TAG", "VERSION"))}
    out = subprocess.run(["make", "-s", "--no-print-directory", "-f", "Makefile", "-f", "-", "print"], cwd=ROOT,
                         input=rule, capture_output=True, text=True, check=True, env=env)
    return out.stdout.split()


def test_one_version_tags_the_chart_the_images_and_the_distributions() -> None:
    chart = yaml.safe_load(CHART.read_text())
    version = chart["appVersion"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert chart["version"] == version
    make_version, tag, runtime, cuda, operator = _make("VERSION", "IMAGE_TAG", "RUNTIME_IMAGE",
                                                       "CUDA_RUNTIME_IMAGE", "OPERATOR_IMAGE")
    assert make_version == tag == version
    assert runtime.endswith(f":{version}") and operator.endswith(f":{version}")
    assert cuda.endswith(f":{version}{CUDA_TAG_SUFFIX}")
    # what the operator gives a pod without spec.image.tag is what `make images` / `images-cuda` built
    assert RUNTIME_TAG == version
    assert ImageSpec().for_pod(RoleImage(), gpu=False)[0] == runtime
    assert ImageSpec().for_pod(RoleImage(), gpu=True)[0] == cuda
    for name in DISTRIBUTIONS:
        project = tomllib.loads((ROOT / name / "pyproject.toml").read_text())["project"]
        assert project["version"] == version, name
        pins = [d for d in project.get("dependencies", []) if d.startswith("cosine-spec")]
        assert pins in ([], [f"cosine-spec=={version}"]), (name, pins)

