"""The drafter service over TLS (`transport.tls`, `spec.drafterTLS`): a real gRPC round trip with
a CA and a server certificate made here, laid out like a mounted kubernetes.io/tls Secret; a client
without the CA, with another CA, checking another name, or speaking plaintext gets nothing."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cosine.transport.drafter_service import DrafterServicer, serve
from cosine.transport.remote_drafter import RemoteDrafter

from .test_transport import RuleEngine

SERVICE = "demo-drafter-code.ns.svc"  # what the verifier dials in a cluster (a SAN below)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool, sans: list[x509.GeneralName] = ()) -> bytes:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _secret_dir(path: Path, ca_name: str) -> Path:
    """tls.crt (SANs: the Service's name, localhost, 127.0.0.1), tls.key, ca.crt under ``path``."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(SERVICE), x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    path.mkdir()
    (path / "ca.crt").write_bytes(_cert(ca_name, ca_key, ca_name, ca_key, ca=True))
    (path / "tls.crt").write_bytes(_cert("drafter", key, ca_name, ca_key, ca=False, sans=sans))
    (path / "tls.key").write_bytes(_pem_key(key))
    return path


@pytest.fixture()
def tls_pool(tmp_path):
    secret = _secret_dir(tmp_path / "secret", "cosine-test-ca")
    servicer = DrafterServicer(RuleEngine(), pool="code", tokenizer_family="tiny")
    server = serve(servicer, port=0, tls_dir=str(secret))
    yield server.bound_port, secret, tmp_path
    server.stop(None)
    servicer.close()


def test_round_trip_over_tls(tls_pool):
    port, secret, _ = tls_pool
    # the Service's DNS name checked against the certificate (the address here is loopback)
    remote = RemoteDrafter(f"127.0.0.1:{port}", "code", tls_dir=str(secret),
                           tls_server_name=SERVICE)
    assert remote.info().pool == "code"
    assert remote.propose("r", [1, 2, 3], 4).token_ids == (4, 5, 6, 7)
    # no override: the host of the address is the name checked (a SAN)
    plain_name = RemoteDrafter(f"localhost:{port}", "code", tls_dir=str(secret))
    assert plain_name.info().pool == "code"


def test_clients_that_cannot_verify_the_drafter_get_nothing(tls_pool):
    """Catches: a server still answering plaintext, a client that does not check the chain (any
    CA accepted) or the name."""
    port, _, tmp_path = tls_pool
    other_ca = _secret_dir(tmp_path / "other", "some-other-ca")
    clients = {
        "plaintext": RemoteDrafter(f"127.0.0.1:{port}", "code"),
        "another CA": RemoteDrafter(f"127.0.0.1:{port}", "code", tls_dir=str(other_ca),
                                    tls_server_name=SERVICE),
        "wrong name": RemoteDrafter(f"127.0.0.1:{port}", "code",
                                    tls_dir=str(tls_pool[1]), tls_server_name="evil.example"),
    }
    for what, client in clients.items():
        with pytest.raises(grpc.RpcError) as e:
            client.info(timeout_s=3)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), what


def test_the_verifiers_proposer_dials_tls_from_its_config(tls_pool):
    """Catches: `tls_dir` dropped between the verifier's pool config and its RemoteDrafter."""
    from cosine import vllm_hooks

    port, secret, _ = tls_pool
    pools = [{"name": "code", "addresses": [f"127.0.0.1:{port}"], "tls_dir": str(secret), "tls_server_name": SERVICE}]
    proposer = vllm_hooks.build_proposer(vllm_hooks.proposer_config(pools=pools))
    assert proposer.pools.pools["code"].info().pool == "code"
