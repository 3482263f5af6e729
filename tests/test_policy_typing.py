"""The pure policy layer type-checks under `mypy --strict`."""

import subprocess
import sys

# The policy modules (.importlinter's "pure" contract) that are strictly typed. The operator's
# builders and status are pure too but not yet strict (PyYAML has no stubs here).
POLICY = ["cosine.speculation_control", "cosine.pool_policy", "cosine.routing", "cosine.fusion", "cosine.placement",
          "cosine.breaker", "cosine.sources", "cosine.sources.engine", "cosine_spec.autoscaling",
          "cosine_spec.contract", "cosine_spec.schema", "cosine_spec.catalogue", "cosine_spec.spot",
          "cosine_spec.pods", "cosine_spec.verifier_spec", "cosine_spec.cluster_spec", "cosine_spec.scaling_loop",
          "cosine_operator.endpoint_picker",
          "cosine_operator.config_hashes", "cosine_operator.capacity_placement", "cosine_operator.apply_plan"]


def test_policy_modules_are_strictly_typed(tmp_path):
    """mypy finds both distributions where they are installed (editable: runtime/src, operator/src;
    both ship py.typed), so the policy modules' imports of each other are checked too; run outside
    the repository so its folders are no candidates."""
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", "/dev/null",
         *[arg for module in POLICY for arg in ("-m", module)]],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
