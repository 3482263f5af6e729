"""Model sources on loopback for the model store's URI tests: moto's S3 server (a real process),
and the Hugging Face Hub and Google Cloud Storage faked at the HTTP layer (only the calls
``huggingface_hub`` and ``gcsfs`` make for a download).

The fakes answer what the clients read, no more: the Hub's ``/api/models/R/revision/V`` (the
commit), ``/api/models/R/tree/V`` (the files) and ``/R/resolve/V/F`` (HEAD: commit, ETag and size;
GET: the bytes), as ``huggingface_hub``'s ``snapshot_download`` and ``hf_hub_download`` call
them; GCS's JSON API ``/storage/v1/b/B/o`` (list by prefix), ``/storage/v1/b/B/o/K`` (an object's
metadata) and ``/download/storage/v1/b/B/o/K?alt=media`` (its bytes), what ``gcsfs`` calls with
``STORAGE_EMULATOR_HOST``. Each server records the paths asked, so a test can see the client came.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound and released: the server that takes it binds it next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def moto_s3(buckets: Mapping[str, Mapping[str, bytes]]) -> Iterator[str]:
    """moto's server (``moto[server]``) on a free loopback port, holding ``buckets`` (bucket ->
    key -> bytes), put there through boto3; yields its endpoint URL. The server is stopped after."""
    import boto3

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto's server did not start on {url}")
            time.sleep(0.2)
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                              aws_secret_access_key="testing")
        for bucket, objects in buckets.items():
            client.create_bucket(Bucket=bucket)
            for key, body in objects.items():
                client.put_object(Bucket=bucket, Key=key, Body=body)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _Handler(BaseHTTPRequestHandler):
    asked: list[str]

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
        pass

    def _send(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: object, status: int = 200) -> None:
        self._send(status, json.dumps(obj).encode())


COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the fake Hub's one commit of every repo


@contextlib.contextmanager
def fake_hub(repos: Mapping[str, Mapping[str, bytes]]) -> Iterator[tuple[str, list[str]]]:
    """The Hugging Face Hub's download endpoints for ``repos`` (repo id -> file -> bytes), at one
    commit, :data:`COMMIT`; yields ``(endpoint, asked)``: the URL for ``HF_ENDPOINT`` and the
    request paths served. Any other request is a 404 with the Hub's error header."""
    asked: list[str] = []

    class Hub(_Handler):
        def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
            self.do_GET()

        def do_GET(self) -> None:  # noqa: N802
            path = unquote(urlsplit(self.path).path)
            asked.append(f"{self.command} {path}")
            for repo, files in repos.items():
                api = f"/api/models/{repo}/"
                if path.startswith(api + "revision/"):
                    return self._json({"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]})
                if path.startswith(api + "tree/"):
                    return self._json([{"type": "file", "path": f, "size": len(b), "oid": _git_oid(b)}
                                       for f, b in files.items()])
                resolve = f"/{repo}/resolve/"
                if path.startswith(resolve):
                    _, _, name = path[len(resolve):].partition("/")
                    if name in files:
                        body = files[name]
                        return self._send(200, body, {"X-Repo-Commit": COMMIT, "ETag": f'"{_git_oid(body)}"'},
                                          content_type="application/octet-stream")
            self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})

    with _serve(Hub) as url:
        yield url, asked


def _git_oid(body: bytes) -> str:
    """The git blob id of ``body`` (what the Hub gives as a small file's oid and ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()  # noqa: S324 (git's id, not security)


@contextlib.contextmanager
def fake_gcs(buckets: Mapping[str, Mapping[str, bytes]]) -> Iterator[tuple[str, list[str]]]:
    """Google Cloud Storage's JSON API for reading ``buckets`` (bucket -> key -> bytes); yields
    ``(endpoint, asked)``: the URL for ``STORAGE_EMULATOR_HOST`` and the request paths served."""
    asked: list[str] = []

    def meta(bucket: str, key: str) -> dict[str, object]:
        body = buckets[bucket][key]
        return {"kind": "storage#object", "bucket": bucket, "name": key, "size": str(len(body)),
                "generation": "1", "contentType": "application/octet-stream",
                "md5Hash": base64.b64encode(hashlib.md5(body).digest()).decode(),  # noqa: S324 (GCS's field)
                "updated": "2026-01-01T00:00:00.000Z", "timeCreated": "2026-01-01T00:00:00.000Z"}

    class Gcs(_Handler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            split = urlsplit(self.path)
            path, query = split.path, parse_qs(split.query)
            asked.append(f"GET {unquote(path)}")
            parts = path.split("/")
            if path.startswith("/download/storage/v1/b/"):  # /download/storage/v1/b/B/o/K?alt=media
                bucket, key = unquote(parts[5]), unquote("/".join(parts[7:]))
                if key in buckets.get(bucket, {}):
                    return self._send(200, buckets[bucket][key], content_type="application/octet-stream")
            elif path.startswith("/storage/v1/b/") and len(parts) == 5:  # the bucket
                if unquote(parts[4]) in buckets:
                    return self._json({"kind": "storage#bucket", "name": unquote(parts[4])})
            elif path.startswith("/storage/v1/b/") and len(parts) == 6 and parts[5] == "o":  # a listing
                bucket = unquote(parts[4])
                prefix = query.get("prefix", [""])[0]
                delimiter = query.get("delimiter", [""])[0]
                keys = sorted(k for k in buckets.get(bucket, {}) if k.startswith(prefix))
                items, prefixes = [], set()
                for k in keys:
                    rest = k[len(prefix):]
                    if delimiter and delimiter in rest:
                        prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
                    else:
                        items.append(meta(bucket, k))
                return self._json({"kind": "storage#objects", "items": items, "prefixes": sorted(prefixes)})
            elif path.startswith("/storage/v1/b/") and len(parts) >= 7:  # an object's metadata
                bucket, key = unquote(parts[4]), unquote("/".join(parts[6:]))
                if key in buckets.get(bucket, {}):
                    return self._json(meta(bucket, key))
            self._json({"error": {"code": 404, "message": "No such object"}}, status=404)

    with _serve(Gcs) as url:
        yield url, asked
