"""Layering: the import contracts (.importlinter) hold, and they would catch a broken layer; the
operator process loads no model code (what the contracts cannot see: imports inside third-party
packages)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / ".importlinter"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
SOURCES = {"cosine": ROOT / "runtime" / "src" / "cosine",
           "cosine_operator": ROOT / "operator" / "src" / "cosine_operator",
           "cosine_spec": ROOT / "spec" / "src" / "cosine_spec"}


def _lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    """lint-imports with the repository's configuration, from `cwd` (outside the repository); its
    report is wrapped at COLUMNS. `pythonpath` goes ahead of the editable installs' .pth entries."""
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([str(LINT_IMPORTS), "--config", str(CONFIG), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _status(report: str, contract: str) -> str:
    """KEPT or BROKEN: the status lint-imports reports for the contract whose name starts so."""
    m = re.search(rf"{re.escape(contract)}.*? (KEPT|BROKEN)", " ".join(report.split()))
    assert m, report
    return m.group(1)


def test_import_contracts_hold(tmp_path: Path) -> None:
    out = _lint_imports(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6 kept, 0 broken" in out.stdout, out.stdout


POLICY = "Policy modules are pure"
OPERATOR = "The operator imports nothing of the runtime"
NO_OPERATOR = "The runtime imports no operator"
SPEC = "The spec imports neither side"
VLLM = "Only the vLLM adapter"
SERVING = "The serving path imports no tooling"


@pytest.mark.parametrize(("module", "line", "contracts", "chain"), [
    ("cosine/routing.py", "import torch", [POLICY], "cosine.routing -> torch"),
    # the spec is imported by both sides: kopf or the operator there reaches the runtime through it
    ("cosine_spec/cluster_spec.py", "import kopf", [POLICY, SPEC, NO_OPERATOR], "cosine_spec.cluster_spec -> kopf"),
    ("cosine_spec/autoscaling.py", "from cosine_operator import status", [SPEC, NO_OPERATOR],
     "cosine_spec.autoscaling -> cosine_operator.status"),
    ("cosine_operator/builders/workloads.py", "from cosine import proposer", [OPERATOR],
     "cosine_operator.builders.workloads -> cosine.proposer"),
    ("cosine/model_store.py", "from cosine_operator import builders", [NO_OPERATOR],
     "cosine.model_store -> cosine_operator.builders"),
    ("cosine/roles.py", "import vllm", [VLLM], "cosine.roles -> vllm"),
    ("cosine/proposer.py", "from cosine.tooling import workloads", [SERVING],
     "cosine.proposer -> cosine.tooling.workloads"),
], ids=["policy-torch", "spec-kopf", "spec-operator", "operator-runtime", "runtime-operator",
        "vllm-outside-adapter", "serving-path-tooling"])
def test_import_contracts_fail_on_a_broken_layer(tmp_path: Path, module: str, line: str, contracts: list[str],
                                                 chain: str) -> None:
    """A copy of the three packages with one forbidden import added, linted with the same configuration:
    lint-imports exits non-zero and names the broken contracts and the import; the others hold."""
    src = tmp_path / "src"
    for name, path in SOURCES.items():
        shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = src / module
    target.write_text(target.read_text() + f"\n{line}  # the layer this test breaks\n")
    out = _lint_imports(tmp_path, pythonpath=src)
    assert out.returncode != 0, out.stdout + out.stderr
    for contract in (POLICY, OPERATOR, NO_OPERATOR, SPEC, VLLM, SERVING):
        assert _status(out.stdout, contract) == ("BROKEN" if contract in contracts else "KEPT"), contract
    assert chain in out.stdout, out.stdout


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out))


def test_operator_loads_no_model_code() -> None:
    """The contracts stop at third-party packages (kopf, kubernetes_asyncio, aiohttp, prometheus_client
    are leaves to them); the operator image has no torch, so check what an import really loads."""
    loaded = _modules_after_import("cosine_operator.handlers")
    assert "kopf" in loaded  # the import really happened
    heavy = {"torch", "transformers", "gguf", "grpc", "numpy", "vllm", "llama_cpp", "cosine"}
    assert not {m for m in loaded if m.split(".")[0] in heavy}


def test_the_runtime_loads_no_operator_and_depends_on_none() -> None:
    """Catches: the inference image pulling kopf and the Kubernetes clients back in, by an import
    of the serving path or by a dependency of the runtime's distribution (or the spec's)."""
    import tomllib

    loaded = _modules_after_import("cosine.roles, cosine.embedded, cosine.vllm_hooks, cosine.cli")
    assert not {m for m in loaded if m.split(".")[0] in ("kopf", "kubernetes_asyncio", "cosine_operator")}
    for dist in ("runtime", "spec"):
        project = tomllib.loads((ROOT / dist / "pyproject.toml").read_text())["project"]
        names = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
        assert not names & {"kopf", "kubernetes-asyncio", "cosine-operator"}, (dist, names)
