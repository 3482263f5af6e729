"""TLS for the drafter service, from a directory laid out like a mounted ``kubernetes.io/tls``
Secret: ``tls.crt`` (the drafter's certificate chain), ``tls.key`` (its key), ``ca.crt`` (the CA the
verifier trusts; absent: the system's roots).

Plain gRPC stays the default (``tls_dir=None``): the embedded ``cosine serve`` talks to its
drafters on loopback. In Kubernetes, ``spec.drafterTLS`` mounts the Secret and passes the flags.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

CERT, KEY, CA = "tls.crt", "tls.key", "ca.crt"


def server_credentials(tls_dir: str | Path) -> grpc.ServerCredentials:
    """The drafter's server credentials from ``tls_dir`` (``FileNotFoundError`` if a file is missing)."""
    d = Path(tls_dir)
    return grpc.ssl_server_credentials([((d / KEY).read_bytes(), (d / CERT).read_bytes())])


def channel(
    address: str,
    *,
    options: Sequence[tuple[str, Any]] = (),
    tls_dir: str | Path | None = None,
    server_name: str | None = None,
) -> grpc.Channel:
    """A channel to ``address``: plaintext without ``tls_dir``; else TLS trusting ``tls_dir``'s
    ``ca.crt`` and checking the server's certificate against ``server_name`` (default: the host of
    ``address``, e.g. the drafter Service's DNS name)."""
    if tls_dir is None:
        return grpc.insecure_channel(address, options=list(options))
    ca = Path(tls_dir) / CA
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes() if ca.exists() else None)
    opts = list(options)
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(address, credentials, options=opts)
