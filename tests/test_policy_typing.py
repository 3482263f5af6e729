"""The pure policy layer type-checks under `mypy --strict`."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> the package it is installed as (pyproject `package-dir`)
PACKAGES = {"runtime": "runtime", "operator": "operator", "simulation": "simulation"}
POLICY = ["runtime/speculation_control.py", "runtime/routing.py", "operator/autoscaling.py",
          "operator/settings.py"]


def test_policy_modules_are_strictly_typed(tmp_path):
    """mypy sees the folders under their import names (`cosine.operator.settings`, ...) through a
    `cosine` package of symlinks, so the policy modules' imports of each other are checked too."""
    pytest.importorskip("mypy")
    pkg = tmp_path / "cosine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for folder, name in PACKAGES.items():
        (pkg / name).symlink_to(ROOT / folder, target_is_directory=True)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--explicit-package-bases",
         *[str(pkg / p) for p in POLICY]],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={"MYPYPATH": str(tmp_path), "PATH": ""},
    )
    assert out.returncode == 0, out.stdout + out.stderr
