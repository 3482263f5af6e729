"""Fixtures: the API emulator on loopback and the real operator (``kopf run``) against it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_emulator import EmulatorThread, Kube

CLUSTERS = "cosine.dev/v1alpha1/cosineclusters"
POOLS = "cosine.dev/v1alpha1/cosinedrafterpools"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
CONFIGMAPS = "v1/configmaps"
PODS = "v1/pods"
EVENTS = "v1/events"


@pytest.fixture()
def emulator(tmp_path: Path) -> Iterator[EmulatorThread]:
    with EmulatorThread(tmp_path) as emu:
        yield emu


@pytest.fixture()
def kube(emulator: EmulatorThread) -> Kube:
    return Kube(emulator.url)


@pytest.fixture()
def operator(emulator: EmulatorThread, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``cosine-operator --standalone -A`` (kopf run) in a thread, pointed at the emulator."""
    from kopf.testing import KopfRunner

    from cosine.operator.__main__ import kopf_args

    monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    args = kopf_args(["--standalone", "-A", "--verbose"], os.environ)
    with KopfRunner(args, timeout=30) as runner:
        yield runner
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition") -> Any:
    """Poll ``predicate`` every 50 ms until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (KeyError, TypeError, IndexError):
            last = None
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")
