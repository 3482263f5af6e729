"""The provisioning of the real API server fails loudly, naming the step (never a silent skip)."""

from __future__ import annotations

import pytest
from real_apiserver import MIN_APIEXTENSIONS, ProvisionError, _parse_upstream, _run


def test_a_failing_step_raises_with_its_name_and_output() -> None:
    with pytest.raises(ProvisionError, match=r"at 'go build k8s.io/x'.*no such package"):
        _run("go build k8s.io/x", ["sh", "-c", "echo no such package >&2; exit 1"])


def test_a_missing_tool_is_a_provision_error_too() -> None:
    with pytest.raises(ProvisionError, match="apt-get"):
        _run("apt-get update (sid)", ["/nonexistent/apt-get"])


@pytest.mark.parametrize(
    ("debian_version", "upstream"),
    [("0.36.4-1", (0, 36, 4)), ("1:0.33.0+ds-2", (0, 33, 0)), ("3.5.30-2", (3, 5, 30)), ("0.34.1~rc1-1", (0, 34, 1))],
)
def test_debian_versions_compare_by_upstream(debian_version: str, upstream: tuple[int, ...]) -> None:
    assert _parse_upstream(debian_version) == upstream


def test_minimum_is_enforced_against_old_versions() -> None:
    assert _parse_upstream("0.32.9-1") < MIN_APIEXTENSIONS <= _parse_upstream("0.33.0-1")
