"""Fixtures: the API emulator on loopback and the real operator (``kopf run``) against it."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from k8s_emulator import EmulatorThread, Kube

RESYNC_S = 2.0  # the operators under test re-apply children this often (drift repair)
RUNTIME_REPOSITORY = "registry.example/cosine"  # the operator fixture's default runtime image repository
# kopf registers the resync timer, with its interval, when the handlers are first imported: set
# before any test of this folder can import them.
os.environ["COSINE_OPERATOR_RESYNC_S"] = str(RESYNC_S)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorThread]:
    with EmulatorThread(tmp_path_factory.mktemp("emulator")) as emu:
        yield emu


@pytest.fixture(scope="module")
def kube(emulator: EmulatorThread) -> Kube:
    return Kube(emulator.url)


@pytest.fixture(scope="module")
def webhook_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def operator_metrics_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def operator(emulator: EmulatorThread, webhook_port: int, operator_metrics_port: int) -> Iterator[Any]:
    """``cosine-operator --standalone -A`` (kopf run) in a thread, pointed at the emulator,
    with the admission webhook on plain HTTP at ``webhook_port`` and its own metrics on
    ``operator_metrics_port``. One operator per test module."""
    with run_operator(emulator.kubeconfig, {"COSINE_OPERATOR_WEBHOOK_PORT": str(webhook_port),
                                            "COSINE_OPERATOR_METRICS_PORT": str(operator_metrics_port),
                                            "COSINE_OPERATOR_WEBHOOK_INSECURE": "1",
                                            "COSINE_OPERATOR_NAMESPACE": "cosine-system",
                                            "COSINE_OPERATOR_POD_LABELS": "app.kubernetes.io/name=cosine-operator",
                                            # the chart's runtimeImage.repository (test_handlers.py)
                                            "COSINE_OPERATOR_RUNTIME_IMAGE_REPOSITORY": RUNTIME_REPOSITORY}
                      ) as runner:
        yield runner


@contextlib.contextmanager
def run_operator(kubeconfig: Any, extra_env: dict[str, str]) -> Iterator[Any]:
    """The real operator (``kopf run`` via KopfRunner) against ``kubeconfig``; ``extra_env`` sets
    the webhook's port and TLS."""
    from kopf.testing import KopfRunner

    from cosine_operator.__main__ import kopf_args

    env = {"KUBECONFIG": str(kubeconfig), "COSINE_OPERATOR_SCRAPE_TIMEOUT_S": "1",
           "COSINE_OPERATOR_RESYNC_S": str(RESYNC_S), **extra_env}
    saved = {k: os.environ.get(k) for k in [*env, "KUBERNETES_SERVICE_HOST"]}
    os.environ.update(env)
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    try:
        args = kopf_args(["--standalone", "-A"], os.environ)
        with KopfRunner(args, timeout=30) as runner:
            yield runner
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output


@pytest.fixture(scope="session")
def real_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Kubernetes' own CRD server (apiextensions-apiserver) and etcd on loopback, provisioned once
    into the cache (real_apiserver.py). A provisioning failure fails the tests: never skipped."""
    from real_apiserver import RealApiServer, provision

    with RealApiServer(provision(), tmp_path_factory.mktemp("apiserver")) as server:
        yield server


@pytest.fixture(scope="session")
def routed(real_apiserver: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One URL for the real server (our group, CRDs) and an emulator (core, apps): what kubectl
    and the operator talk to (api_router.py). ``routed.emulator`` is that emulator."""
    from api_router import ApiRouter

    with EmulatorThread(tmp_path_factory.mktemp("routed-emulator")) as emu, ApiRouter(
        emu.url, real_apiserver, tmp_path_factory.mktemp("router")
    ) as router:
        router.emulator = emu
        yield router
