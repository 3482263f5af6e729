"""Prometheus text → samples → observations, and the HTTP scrapers against loopback servers."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fake_metrics import Counters, serve

from cosine_operator.metrics_scrape import (
    DrafterSample,
    Scrape,
    ScrapeTarget,
    VerifierSample,
    observe,
    parse_drafter,
    parse_verifier,
    scrape_pods,
    scrape_prometheus,
)

VERIFIER_TEXT = """# HELP cosine:verifier_busy_seconds_total Busy.
# TYPE cosine:verifier_busy_seconds_total counter
cosine:verifier_busy_seconds_total 12.5
cosine:verifier_idle_seconds_total 7.5
cosine:num_requests_running 3
cosine:num_requests_waiting 1
cosine:spec_decode_num_draft_tokens_total{pool="code"} 1000
cosine:spec_decode_num_draft_tokens_total{pool="chat"} 500
cosine:spec_decode_num_accepted_tokens_total{pool="code"} 800
cosine:spec_decode_num_accepted_tokens_total{pool="chat"} 100
cosine:verifier_tokens_verified_total 2000
"""


def test_parse_verifier_and_drafter() -> None:
    v = parse_verifier(VERIFIER_TEXT)
    assert (v.busy_s, v.idle_s, v.requests_running, v.requests_waiting) == (12.5, 7.5, 3, 1)
    assert v.draft_tokens == {"code": 1000, "chat": 500}
    assert v.accepted_tokens == {"code": 800, "chat": 100}
    d = parse_drafter("cosine:drafter_draft_tokens_total 42\ncosine:drafter_busy_seconds_total 3\n")
    assert (d.draft_tokens, d.busy_s) == (42, 3)


def test_observe_rates_acceptance_share_and_counter_reset() -> None:
    prev = Scrape(
        0.0,
        {
            "v-1": VerifierSample(
                busy_s=10,
                idle_s=10,
                draft_tokens={"code": 0, "chat": 0},
                accepted_tokens={"code": 0, "chat": 0},
            )
        },
        {"code": {"d-1": DrafterSample(100, 2)}, "chat": {"d-2": DrafterSample(500, 30)}},
    )
    cur = Scrape(
        10.0,
        {
            "v-1": VerifierSample(
                busy_s=19,
                idle_s=11,
                requests_running=2,
                tokens_verified=300,
                draft_tokens={"code": 300, "chat": 100},
                accepted_tokens={"code": 240, "chat": 20},
            )
        },
        {
            "code": {"d-1": DrafterSample(400, 9), "d-new": DrafterSample(999, 9)},
            "chat": {"d-2": DrafterSample(50, 4)},
        },
    )  # chat's pod restarted: counter reset
    o = observe(prev, cur, {"code": (2, 1), "chat": (1, 1)})
    assert o.verifier is not None
    assert abs(o.verifier.utilization - 0.9) < 1e-9
    assert o.verifier.tokens_verified_per_s == 30
    pools = {p.name: p for p in o.pools}
    assert pools["code"].draft_tokens_per_s == 30  # the new pod is not counted
    assert pools["chat"].draft_tokens_per_s == 5  # reset: counted from zero
    assert pools["code"].acceptance_rate == 0.8 and pools["chat"].acceptance_rate == 0.2
    assert pools["code"].share == 0.75
    assert pools["code"].utilization == 0.7  # 7 busy seconds of 10, the measured pod only
    assert pools["chat"].utilization == 0.4  # reset: counted from zero
    assert (pools["code"].replicas, pools["code"].ready_replicas) == (2, 1)


def test_observe_without_a_common_verifier_pod_has_no_verifier() -> None:
    o = observe(Scrape(0, {}, {}), Scrape(5, {"v": VerifierSample()}, {}), {"code": (1, 1)})
    assert o.verifier is None and o.pools[0].acceptance_rate is None


def test_scrape_pods_reads_loopback_endpoints_and_skips_dead_ones() -> None:
    counters = Counters(**{"cosine:drafter_draft_tokens_total": 10.0})
    with serve(counters) as port:
        targets = [
            ScrapeTarget("d-1", "drafter", "code", f"http://127.0.0.1:{port}/metrics"),
            ScrapeTarget("v-1", "verifier", None, "http://127.0.0.1:9/metrics"),
        ]
        scrape = asyncio.run(scrape_pods(targets, timeout_s=1.0, time_s=1.0))
    assert "d-1" in scrape.drafters["code"]
    assert scrape.verifiers == {}
    # the dead one is reported, with why, for the operator's counter and log
    assert [(target.pod, target.role) for target, _ in scrape.failures] == [("v-1", "verifier")]
    assert "ClientConnectorError" in scrape.failures[0][1] or "refused" in scrape.failures[0][1].lower()


def test_scrape_prometheus_maps_pods_to_roles_and_pools() -> None:
    result = [
        {
            "metric": {"__name__": "cosine:verifier_busy_seconds_total", "pod": "c-verifier-7d9f-abcde"},
            "value": [0, "5"],
        },
        {
            "metric": {
                "__name__": "cosine:spec_decode_num_draft_tokens_total",
                "pod": "c-verifier-7d9f-abcde",
                "pool": "code-large",
            },
            "value": [0, "40"],
        },
        {
            "metric": {
                "__name__": "cosine:drafter_draft_tokens_total",
                "pod": "c-drafter-code-large-5c-x1y2z",
            },
            "value": [0, "40"],
        },
        {
            "metric": {"__name__": "cosine:drafter_draft_tokens_total", "pod": "c-drafter-code-6f-q1w2e"},
            "value": [0, "7"],
        },
    ]
    seen = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen["path"] = self.path
            body = json.dumps(
                {"status": "success", "data": {"resultType": "vector", "result": result}}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        scrape = asyncio.run(scrape_prometheus(url, "ns", "c", ["code", "code-large"], 2.0, 0.0))
    finally:
        server.shutdown()
    assert "/api/v1/query" in seen["path"]
    assert scrape.verifiers["c-verifier-7d9f-abcde"].busy_s == 5
    assert scrape.verifiers["c-verifier-7d9f-abcde"].draft_tokens == {"code-large": 40}
    assert scrape.drafters["code-large"]["c-drafter-code-large-5c-x1y2z"].draft_tokens == 40
    assert scrape.drafters["code"]["c-drafter-code-6f-q1w2e"].draft_tokens == 7
