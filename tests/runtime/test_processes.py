"""Every child of `cosine serve` dies with it, however it dies (`cosine.processes`).

Real processes: first the watchdog alone on a process group of two `sleep`s whose holder is
SIGKILLed (no model: milliseconds); then `cosine serve` itself, on a real small model, SIGKILLed
while its verifier loads (its engine core and a drafter replica up; `tests/runtime/test_serve.py` drains
a serving one with SIGTERM and checks the same). A SIGKILLed
process runs no code, so nothing but the kernel and the watchdog can clean up after it: the
test lists every descendant before the kill and waits for each to be gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import yaml

from cosine.model_store import pull

MODEL = "smollm2-135m-instruct"


def descendants(pid: int) -> list[psutil.Process]:
    """Every process below `pid` now (children of children included)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(procs: list[psutil.Process], within_s: float = 10.0) -> None:
    """Every process of `procs` has exited (or is a zombie awaiting its reaper) within `within_s`."""
    def alive() -> list[psutil.Process]:
        out = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    _, still = psutil.wait_procs(procs, timeout=within_s)
    left = alive()
    detail = [(p.pid, " ".join(p.cmdline()[:4])) for p in left if p.is_running()]
    for p in left:  # leave nothing behind for the next test
        with __import__("contextlib").suppress(psutil.NoSuchProcess):
            p.kill()
    assert not left, f"orphans {within_s:.0f} s after their parent's SIGKILL: {detail}"


def test_the_watchdog_kills_a_group_when_its_holder_is_sigkilled():
    """Catches: a process group (as vLLM's server, engine core and workers are) outliving the
    process that started it once that process dies without running any code of its own."""
    holder_code = textwrap.dedent("""
        import subprocess, sys, time
        from cosine.processes import start_reaper
        group = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300"], start_new_session=True)
        start_reaper([group.pid], grace_s=1.0)
        print(group.pid, flush=True)
        time.sleep(300)
    """)
    holder = subprocess.Popen([sys.executable, "-c", holder_code], stdout=subprocess.PIPE, text=True)
    pgid = int(holder.stdout.readline())
    time.sleep(0.5)  # the group's second sleep is started
    group = [p for p in psutil.process_iter() if _pgid(p) == pgid]
    assert len(group) >= 2, "a group of a shell and its background sleep"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert_all_gone(group)


def test_a_clean_stop_ends_the_watchdog_too():
    """Catches: the watchdog lingering after its parent stopped the group itself."""
    from cosine.processes import start_reaper, stop_reaper

    group = subprocess.Popen(["sleep", "300"], start_new_session=True)
    reaper = start_reaper([group.pid], grace_s=1.0)
    group.terminate()
    group.wait()
    stop_reaper(reaper, timeout_s=10)
    assert reaper.returncode == 0


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return None


@pytest.mark.real_model
def test_sigkill_of_serve_while_its_verifier_loads_leaves_no_child(tmp_path):
    """Catches: vLLM's server (in a session of its own) and its engine core left running, with the
    port and the model's memory, after `cosine serve` is SIGKILLed during start-up."""
    from cosine.processes import free_port

    pull(MODEL, progress=False)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "orphans"},
        "spec": {"verifier": {"model": MODEL, "threads": 1},
                 "drafterPools": [{"name": "small", "model": MODEL, "replicas": 1, "threads": 1}],
                 "autoscaling": {"enabled": False}}}))
    serve = subprocess.Popen([sys.executable, "-m", "cosine", "serve", "--cluster", str(path), "--port",
                              str(free_port()), "--placement", "split"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # vLLM's engine core is up (it names itself so): the model is loading
            assert serve.poll() is None, "cosine serve exited during start-up"
            if any("EngineCore" in " ".join(_cmdline(p)) for p in descendants(serve.pid)):
                break
            assert time.monotonic() < deadline, "no engine core after 300 s"
            time.sleep(0.5)
        below = descendants(serve.pid)
        assert any("drafter" in _cmdline(p) for p in below), [_cmdline(p) for p in below]
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait()
        assert_all_gone(below)  # the watchdog included: it exits once the groups are gone
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.NoSuchProcess:
        return []
