"""e2e: the user's journey. Against a real cluster when KUBECONFIG is set, else the API emulator."""

from __future__ import annotations

import sys
from pathlib import Path

# The emulator and fake endpoints live with the operator tests; reuse them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "operator"))
