"""Test harness: Prometheus's own ``prometheus`` and ``promtool``, from Debian.

Debian sid packages them as ``prometheus`` and ``promtool`` (Go binaries linked against libc
only). They are provisioned once into ``$COSINE_CACHE/prometheus/<version>/`` (default
``~/.cache/cosine``) with the same private apt configuration as the CRD server
(``real_apiserver._Apt``: its own sources list, lists and cache; the machine's apt configuration
is never touched), by downloading the two packages and unpacking them with ``dpkg-deb -x``.
Failures raise ``real_apiserver.ProvisionError`` naming the step: tests fail on it, never skip.

Run ``python tests/operator/prometheus_tools.py`` (``make prometheus``) to provision by hand.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_apiserver import ProvisionError, _Apt, _run  # noqa: E402
from real_apiserver import cache_root as _apiserver_cache  # noqa: E402

PACKAGES = ("prometheus", "promtool")


@dataclass(frozen=True)
class Prometheus:
    prometheus: Path
    promtool: Path
    version: str


def cache_root() -> Path:
    return _apiserver_cache().parent / "prometheus"


def provision(log=print) -> Prometheus:  # type: ignore[no-untyped-def]
    """The cached binaries, downloaded and unpacked on first use (seconds)."""
    apt_root = _apiserver_cache() / "apt"
    for existing in sorted(cache_root().glob("*/bin/promtool")):
        tools = existing.parent
        if (tools / "prometheus").exists():
            return Prometheus(tools / "prometheus", tools / "promtool", existing.parent.parent.name)
    start = time.monotonic()
    apt = _Apt(apt_root)
    apt.update()
    version = apt.version("promtool")
    if apt.version("prometheus") != version:
        raise ProvisionError(f"prometheus provisioning: sid's prometheus and promtool differ ({version})")
    final = cache_root() / version
    with tempfile.TemporaryDirectory(dir=cache_root().parent if cache_root().parent.exists() else None) as tmp:
        debs, tree = Path(tmp) / "debs", Path(tmp) / "tree"
        apt.download(list(PACKAGES), debs)
        for deb in sorted(debs.glob("*.deb")):
            _run(f"dpkg-deb -x {deb.name}", ["dpkg-deb", "-x", str(deb), str(tree)])
        staged = Path(tmp) / "out" / "bin"
        staged.mkdir(parents=True)
        for name in PACKAGES:
            shutil.copy2(tree / "usr" / "bin" / name, staged / name)
        _run("promtool --version", [str(staged / "promtool"), "--version"])
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(final, ignore_errors=True)
        shutil.move(str(Path(tmp) / "out"), final)
    log(f"prometheus and promtool {version} in {final} ({time.monotonic() - start:.0f} s)")
    return Prometheus(final / "bin" / "prometheus", final / "bin" / "promtool", version)


if __name__ == "__main__":
    found = provision()
    print(f"{found.prometheus}\n{found.promtool}\nversion {found.version}")
