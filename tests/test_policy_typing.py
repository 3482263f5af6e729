"""The pure policy layer type-checks under `mypy --strict`."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
POLICY = ["runtime/speculation_control.py", "runtime/routing.py", "simulation/batching.py", "operator/autoscaling.py",
          "operator/settings.py"]


def test_policy_modules_are_strictly_typed():
    pytest.importorskip("mypy")
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", *POLICY],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
