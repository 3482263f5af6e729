"""`spec.gateway.apiKeySecretRef` on a real verifier: `cosine verifier` started as the operator
starts it (the key in `COSINE_API_KEY`, from the Secret), vLLM's OpenAI server on the smallest
real model. Every route vLLM registered (its own OpenAPI list) refuses a request without the key,
`/invocations` (SageMaker's, which runs chat and completions) among them; the probes' routes and
`/metrics` stay open; with the key, completions are served on `/v1` and `/invocations` alike."""

from __future__ import annotations

import sys

import httpx
import pytest

from cosine.model_store import pull
from cosine.processes import free_port

from .test_serve import API_KEY, MODEL, _manifest, _start, _stop

pytestmark = pytest.mark.real_model

OPEN = {"/health", "/ping", "/load", "/version"}  # and /metrics (a mount: not in the OpenAPI list)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    pull(MODEL, progress=False)
    path = _manifest(tmp_path_factory, 4)  # speculation on (prompt lookup; no pool is dialled)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start([sys.executable, "-m", "cosine", "verifier", "--cluster", path, "--http-port", str(port),
                   "--metrics-port", "0"], base, {"COSINE_API_KEY": API_KEY})
    yield base
    _stop(proc)


def test_every_route_but_the_probes_needs_the_key(verifier):
    """Catches: vLLM's key check, which covers only /v1, /v2, /inference and /cohere, left as the
    only one: `/invocations` answered a chat request without the key (200)."""
    base, auth = verifier, {"Authorization": f"Bearer {API_KEY}"}
    for body, path in ((CHAT, "/invocations"), (COMPLETION, "/invocations"), (CHAT, "/v1/chat/completions"),
                       (COMPLETION, "/v1/completions")):
        assert httpx.post(f"{base}{path}", json=body, timeout=120).status_code == 401, path
        served = httpx.post(f"{base}{path}", json=body, headers=auth, timeout=120)
        assert served.status_code == 200, (path, served.text)
    routes = httpx.get(f"{base}/openapi.json", headers=auth, timeout=30).json()["paths"]
    assert "/invocations" in routes and "/v1/chat/completions" in routes and "/tokenize" in routes
    refused, let_through = 0, []
    with httpx.Client(base_url=base, timeout=30) as http:
        for path, methods in routes.items():
            url = path.replace("{", "").replace("}", "")  # a path parameter, e.g. {response_id}
            for method in methods:
                for headers in ({}, {"Authorization": "Bearer wrong"}):
                    status = http.request(method.upper(), url, json=CHAT, headers=headers).status_code
                    if path in OPEN or path.startswith("/metrics"):
                        assert status != 401, (method, path)
                    elif status == 401:
                        refused += 1
                    else:
                        let_through.append((method, path, headers, status))
    assert not let_through, let_through
    assert refused > 20
    for path in (*OPEN, "/metrics"):  # the probes, the scrapers (Prometheus, the endpoint picker)
        assert httpx.get(f"{base}{path}", timeout=30).status_code == 200, path
