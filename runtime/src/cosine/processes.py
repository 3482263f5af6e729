"""Child processes of the runtime: `cosine serve`'s drafter replicas and verifier, and a whole
`cosine serve` started by `cosine demo` and `cosine bench`.

Every child dies with its parent, however the parent dies: direct children by
`PR_SET_PDEATHSIG`, the verifier's process group (vLLM's API server, its engine core and workers)
by a watchdog (`start_reaper`, `cosine.reaper`) that outlives a SIGKILLed parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cosine.manifest import Manifest

log = logging.getLogger(__name__)


@dataclass
class Child:
    """A drafter replica process of `cosine serve`: its command, environment, gRPC port, the cores it
    is pinned to (() = any) and how many times `supervise` restarted it."""

    name: str
    process: subprocess.Popen
    grpc_port: int
    cmd: list[str]
    env: dict[str, str]
    restarts: int = 0

    cores: tuple[int, ...] = ()
    metrics_port: int = 0  # its `cosine:drafter_*` series (the embedded autoscaler scrapes them)

    def start(self) -> None:
        """(Re)start the process with the same command, environment and cores."""
        self.process = subprocess.Popen(self.cmd, env=self.env, preexec_fn=child_setup(self.cores))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS's pick; another process may take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:  # runs in the child before exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def child_setup(cores: Sequence[int]):
    """A `preexec_fn`: die with the parent and, given cores, run only on them."""

    def setup() -> None:
        die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)

    return setup


def start_replica(manifest: Manifest, pool, name: str, host: str = "127.0.0.1",
                  cores: Sequence[int] = ()) -> Child:
    """One `cosine drafter` process of `pool` (a `DrafterPoolSpec`) on free loopback ports, its
    engine threads `pool.threads`, pinned to `cores` when given; named `name`."""
    port, metrics_port = free_port(host), free_port(host)
    cmd = [sys.executable, "-m", "cosine", "drafter", "--pool", pool.name, "--grpc-port", str(port),
           "--metrics-port", str(metrics_port), "--host", host]
    if manifest.path:
        cmd += ["--cluster", str(manifest.path)]
    env = {**os.environ, "OMP_NUM_THREADS": str(pool.threads)}
    proc = subprocess.Popen(cmd, env=env, preexec_fn=child_setup(cores))
    log.info("started drafter %s (pid %d) on %s:%d, cores %s", name, proc.pid, host, port, list(cores) or "any")
    return Child(name, proc, port, cmd, env, cores=tuple(cores), metrics_port=metrics_port)


def wait_healthy(children: list[Child], host: str = "127.0.0.1", timeout_s: float = 600) -> None:
    """Block until every child answers its gRPC health check. Raises RuntimeError on exit/timeout."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    for c in children:
        with grpc.insecure_channel(f"{host}:{c.grpc_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            def serving() -> bool:
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status  # noqa: B023
                except grpc.RpcError:
                    return False
                return bool(status == health_pb2.HealthCheckResponse.SERVING)

            _poll(serving, c.process, deadline, 0.5, f"drafter {c.name}", f"not healthy after {timeout_s:.0f} s")


def _poll(ready: Callable[[], bool], proc: subprocess.Popen, deadline: float, period_s: float, what: str,
          late: str) -> None:
    """Until `ready()`, every `period_s` seconds. Raises RuntimeError naming `what` when `proc`
    exits first, or with `late` at the monotonic `deadline`."""
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} {late}")
        time.sleep(period_s)


def stop_children(children: list[Child], timeout_s: float = 10) -> None:
    """SIGTERM every running child, then SIGKILL those still running after `timeout_s` seconds in all."""
    for c in children:
        if c.process.poll() is None:
            c.process.terminate()
    end = time.monotonic() + timeout_s
    for c in children:
        try:
            c.process.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.process.kill()
            c.process.wait()


def stop_group(proc: subprocess.Popen, timeout_s: float = 20) -> None:
    """Stop a child and its process group (vLLM's engine-core and worker processes)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_for_signal() -> None:
    stop = {"now": False}

    def handler(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    while not stop["now"]:
        time.sleep(0.2)


def start_reaper(pgids: Sequence[int], grace_s: float = 5.0) -> subprocess.Popen:
    """A watchdog that kills the process groups `pgids` when this process dies, however it dies.

    `PR_SET_PDEATHSIG` reaches a direct child only, and only if it still honours SIGTERM: vLLM's
    API server, started in a session of its own (so it can be stopped as a group, engine core and
    workers included), survived its parent's SIGKILL while loading and left its engine core running
    with the port and the model's memory. A SIGKILLed process runs no code, but the kernel closes
    its descriptors: the watchdog (`python -m cosine.reaper`, in a session of its own so that
    signals to this process's group miss it) reads a pipe from this process and, at end-of-file,
    SIGTERMs the groups, then SIGKILLs what is left after `grace_s` seconds. Close its stdin
    (`stop_reaper`) once the groups are stopped."""
    return subprocess.Popen([sys.executable, "-m", "cosine.reaper", f"--grace-s={grace_s}", *map(str, pgids)],
                            stdin=subprocess.PIPE, start_new_session=True)


def stop_reaper(reaper: subprocess.Popen, timeout_s: float = 10) -> None:
    """End a `start_reaper` watchdog (it kills its groups first, if any process is left in them)."""
    if reaper.stdin is not None:
        reaper.stdin.close()
    try:
        reaper.wait(timeout_s)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def start_cluster(manifest: Manifest, port: int, *, quiet: bool = True, metrics_port: int = 0,
                  log_path: Path | None = None, placement: str = "auto") -> subprocess.Popen:
    """Start `cosine serve --placement placement` in a child process (its own drafter processes
    under it). Its output
    (vLLM's and the drafters' logs) goes to `log_path` (appended) if given, else nowhere when
    `quiet`, else to this process's terminal."""
    cmd = [sys.executable, "-m", "cosine", "serve", "--port", str(port), "--metrics-port", str(metrics_port),
           "--placement", placement]
    if manifest.path:
        cmd += ["--cluster", str(manifest.path)]
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    out = subprocess.DEVNULL if quiet else None
    return subprocess.Popen(cmd, stdout=out, stderr=out, preexec_fn=die_with_parent)


def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    """Poll `GET /health` until 200. Raises RuntimeError if the server exits or times out."""
    import httpx

    def healthy() -> bool:
        try:
            return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    _poll(healthy, proc, time.monotonic() + timeout_s, 1.0, "cosine serve (during start-up)",
          f"at {base_url} not ready after {timeout_s:.0f} s")


def stop_cluster(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM a `start_cluster` process (it stops its children), SIGKILL after `timeout_s` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
