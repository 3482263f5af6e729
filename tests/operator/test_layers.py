"""Layering: the operator never loads model code; its policy modules load no kopf/HTTP."""

from __future__ import annotations

import json
import subprocess
import sys


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return set(json.loads(out))


def test_operator_loads_no_model_code() -> None:
    loaded = _modules_after_import("cosine_operator.handlers")
    assert "kopf" in loaded  # the import really happened
    assert not {m for m in loaded if m.split(".")[0] in {"torch", "transformers", "gguf", "grpc"}}
    assert not {m for m in loaded if m.split(".")[0] == "cosine"}


def test_policy_modules_are_pure() -> None:
    for module in ("cosine_operator.autoscaling", "cosine_operator.builders", "cosine_operator.status"):
        loaded = _modules_after_import(module)
        assert not {
            m for m in loaded if m.split(".")[0] in {"kopf", "aiohttp", "kubernetes_asyncio", "httpx"}
        }, module
