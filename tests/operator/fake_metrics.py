"""Fake ``/metrics`` endpoints on loopback for the autoscaler: counters that grow at set rates."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Counters:
    """Counters integrated from per-second rates (changeable at any time) plus gauges."""

    def __init__(self, **rates_per_s: float) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        self._rates: dict[str, float] = dict(rates_per_s)
        self.gauges: dict[str, float] = {}
        self._t = time.monotonic()

    def _advance(self) -> None:
        now = time.monotonic()
        for key, rate in self._rates.items():
            self._values[key] = self._values.get(key, 0.0) + rate * (now - self._t)
        self._t = now

    def set_rates(self, **rates_per_s: float) -> None:
        with self._lock:
            self._advance()
            self._rates.update(rates_per_s)

    def text(self) -> str:
        """Prometheus text; a key ``name|pool`` becomes ``name{pool="…"}``."""
        with self._lock:
            self._advance()
            lines = []
            for key, value in sorted({**self._values, **self.gauges}.items()):
                name, _, pool = key.partition("|")
                lines.append(f'{name}{{pool="{pool}"}} {value}' if pool else f"{name} {value}")
            return "\n".join(lines) + "\n"


@contextmanager
def serve(counters: Counters) -> Iterator[int]:
    """Serve ``counters`` at ``http://127.0.0.1:PORT/metrics``; yields the port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = counters.text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
