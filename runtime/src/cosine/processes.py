"""Child processes of the runtime, whoever starts them: `cosine serve`'s drafter replicas and
verifier (`cosine.embedded`), and a whole `cosine serve` started by `cosine demo` and `cosine bench`.

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
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cosine.manifest import Manifest

log = logging.getLogger(__name__)


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


def poll_until(ready: Callable[[], bool], proc: subprocess.Popen, deadline: float, period_s: float, what: str,
          late: str) -> None:
    """Until `ready()`, every `period_s` seconds. Raises RuntimeError naming `what` when `proc`
    exits first, or with `late` at the monotonic `deadline`."""
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} {late}")
        time.sleep(period_s)


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
           "--pools-metrics-port", "0", "--placement", placement]
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

    poll_until(healthy, proc, time.monotonic() + timeout_s, 1.0, "cosine serve (during start-up)",
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
