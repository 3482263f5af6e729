"""Modules by concept, functions by step: no module over 800 lines and no function over 80 in the
three distributions (generated protobuf code aside). Past those, split by concept (STYLE)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("operator/src", "spec/src", "runtime/src")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 800, 80


def _modules():
    for root in SOURCES:
        for path in sorted((ROOT / root).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield path


def test_no_module_over_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_over_80_lines():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}::{node.name}"] = lines
    assert long == {}
