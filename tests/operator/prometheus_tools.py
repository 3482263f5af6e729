"""Test harness: Prometheus's own ``prometheus`` and ``promtool``, from Debian, in two majors.

- **3.x**: Debian sid packages them as ``prometheus`` and ``promtool`` (3.5.3 when written).
- **2.x**: Debian 12 "bookworm" ships Prometheus 2.42 (``prometheus`` 2.42.0+ds-5+deb12u1, whose
  package holds both binaries), still in deb.debian.org's bookworm suite: the server many teams
  run, and the one that scrapes with an OpenMetrics ``Accept`` that makes prometheus_client
  rewrite colons in metric names (``cosine_spec.metric_names``).

Both are Go binaries linked against libc only. Each is provisioned once into
``$COSINE_CACHE/prometheus/<suite>/<version>/`` (default ``~/.cache/cosine``) with the same private
apt configuration as the CRD server (``real_apiserver._Apt``: its own sources list, lists and
cache; the machine's apt configuration is never touched), by downloading the packages and
unpacking them with ``dpkg-deb -x``. Failures raise ``real_apiserver.ProvisionError`` naming the
step: tests fail on it, never skip.

Run ``python tests/operator/prometheus_tools.py`` (``make prometheus``) to provision by hand.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_apiserver import SID, ProvisionError, _Apt, _run  # noqa: E402
from real_apiserver import cache_root as _apiserver_cache  # noqa: E402

BOOKWORM = "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main\n"
# suite -> (its sources list, the packages holding prometheus and promtool)
SUITES = {"sid": (SID, ("prometheus", "promtool")), "bookworm": (BOOKWORM, ("prometheus",))}
BINARIES = ("prometheus", "promtool")


@dataclass(frozen=True)
class Prometheus:
    prometheus: Path
    promtool: Path
    version: str  # Debian's, e.g. 3.5.3+ds1-6

    @property
    def major(self) -> int:
        return int(self.version.split(":")[-1].split(".")[0])


def cache_root() -> Path:
    return _apiserver_cache().parent / "prometheus"


def provision(log=print, suite: str = "sid") -> Prometheus:  # type: ignore[no-untyped-def]
    """The cached binaries of ``suite`` (``sid``: 3.x, ``bookworm``: 2.42), downloaded and unpacked
    on first use (seconds)."""
    sources, packages = SUITES[suite]
    root = cache_root() / suite
    for existing in sorted(root.glob("*/bin/promtool")):
        tools = existing.parent
        if (tools / "prometheus").exists():
            return Prometheus(tools / "prometheus", tools / "promtool", tools.parent.name)
    start = time.monotonic()
    apt = _Apt(cache_root() / f"apt-{suite}", sources)
    apt.update()
    version = apt.version(packages[0])
    if any(apt.version(p) != version for p in packages[1:]):
        raise ProvisionError(f"prometheus provisioning: {suite}'s {' and '.join(packages)} differ ({version})")
    final = root / version
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        debs, tree = Path(tmp) / "debs", Path(tmp) / "tree"
        apt.download(list(packages), debs)
        for deb in sorted(debs.glob("*.deb")):
            _run(f"dpkg-deb -x {deb.name}", ["dpkg-deb", "-x", str(deb), str(tree)])
        staged = Path(tmp) / "out" / "bin"
        staged.mkdir(parents=True)
        for name in BINARIES:
            shutil.copy2(tree / "usr" / "bin" / name, staged / name)
        _run("promtool --version", [str(staged / "promtool"), "--version"])
        shutil.rmtree(final, ignore_errors=True)
        shutil.move(str(Path(tmp) / "out"), final)
    log(f"prometheus and promtool {version} ({suite}) in {final} ({time.monotonic() - start:.0f} s)")
    return Prometheus(final / "bin" / "prometheus", final / "bin" / "promtool", version)


def provision_all(log=print) -> list[Prometheus]:  # type: ignore[no-untyped-def]
    """Prometheus 2.x (bookworm) and 3.x (sid), in that order."""
    return [provision(log, suite) for suite in ("bookworm", "sid")]


if __name__ == "__main__":
    for found in provision_all():
        print(f"{found.prometheus}\n{found.promtool}\nversion {found.version}")


def chart_rules(operator_job: str, workloads_job: str) -> list:  # type: ignore[type-arg]
    """The chart's alerting and recording rules (every file of files/rules/) with their placeholders
    filled as the PrometheusRule template fills them: their groups."""
    import yaml

    rules = "".join(p.read_text() for p in sorted(
        (Path(__file__).resolve().parents[2] / "charts" / "cosine-operator" / "files" / "rules").glob("*.yaml")))
    for placeholder, value in (("__RUNBOOK_URL__", "https://example.com"), ("__TPOT_SLO_SECONDS__", "0.1"),
                               ("__FAST_BURN__", "0.144"), ("__SLOW_BURN__", "0.06"),
                               ("__OPERATOR_JOB__", operator_job), ("__OPERATOR_NAMESPACE__", "cosine-system"),
                               ("__WORKLOADS_JOB__", workloads_job)):
        rules = rules.replace(placeholder, value)
    return yaml.safe_load(rules)


@contextlib.contextmanager
def servers_2_and_3(config_dir: Path):  # type: ignore[no-untyped-def]
    """Prometheus 2.x and 3.x running side by side on `config_dir`/prometheus.yml, each on a free
    loopback port with its own storage there: yields [(version, API base URL, process)], stopped after."""
    import socket
    import subprocess

    servers = []
    try:
        for tools in provision_all():
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            servers.append((tools.version, f"http://127.0.0.1:{port}/api/v1", subprocess.Popen(
                [str(tools.prometheus), f"--config.file={config_dir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={config_dir / tools.version}", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        assert [v.split(".")[0] for v, _, _ in servers] == ["2", "3"], [v for v, _, _ in servers]
        yield servers
    finally:
        for _, _, prom in servers:
            prom.terminate()
            prom.wait(30)
