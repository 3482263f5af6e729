"""Prometheus text → samples → observations, and the HTTP scrapers against loopback servers."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cosine_spec.metrics_scrape import (
    Scrape,
    ScrapeTarget,
    observe,
    parse,
    scrape_pods,
    scrape_prometheus,
)
from fake_metrics import Counters, serve

VERIFIER_TEXT = """# HELP cosine_verifier_busy_seconds_total Busy.
# TYPE cosine_verifier_busy_seconds_total counter
cosine_verifier_busy_seconds_total{model_name="m"} 12.5
cosine_verifier_steps_total{model_name="m"} 100
cosine_num_requests_running{model_name="m"} 3
cosine_num_requests_waiting{model_name="m"} 1
cosine_spec_decode_num_draft_tokens_total{model_name="m",pool="code"} 1000
cosine_spec_decode_num_accepted_tokens_total{model_name="m",pool="code"} 800
cosine_drafter_calls_total{model_name="m",pool="code"} 200
cosine_spec_decode_drafts_late_total{model_name="m",pool="code"} 50
cosine_drafter_asks_skipped_total{model_name="m",pool="code",reason="late"} 30
cosine_drafter_asks_skipped_total{model_name="m",pool="code",reason="yield"} 70
cosine_drafter_rtt_seconds{model_name="m",pool="code"} 0.05
cosine_verifier_tokens_verified_total{model_name="m"} 2000
"""


def _drafter(rounds: float, batched: float, busy: float, tokens: float) -> dict:
    return parse(f'cosine_drafter_rounds_total{{pool="code"}} {rounds}\n'
                 f'cosine_drafter_batched_requests_total{{pool="code"}} {batched}\n'
                 f'cosine_drafter_busy_seconds_total{{pool="code"}} {busy}\n'
                 f'cosine_drafter_draft_tokens_total{{pool="code"}} {tokens}\n')


def test_parse_keeps_pool_and_reason() -> None:
    v = parse(VERIFIER_TEXT)
    assert v[("cosine_verifier_busy_seconds_total", "", "")] == 12.5
    assert v[("cosine_drafter_asks_skipped_total", "code", "late")] == 30
    assert v[("cosine_drafter_asks_skipped_total", "code", "yield")] == 70


def test_observe_rates_demand_rounds_and_counter_reset() -> None:
    before = parse(VERIFIER_TEXT)
    after = dict(before)
    for key, grow in ((("cosine_verifier_busy_seconds_total", "", ""), 5.0),
                      (("cosine_verifier_steps_total", "", ""), 50.0),
                      (("cosine_drafter_calls_total", "code", ""), 100.0),
                      (("cosine_spec_decode_drafts_late_total", "code", ""), 40.0),
                      (("cosine_drafter_asks_skipped_total", "code", "late"), 20.0),
                      (("cosine_drafter_asks_skipped_total", "code", "yield"), 500.0),
                      (("cosine_spec_decode_num_draft_tokens_total", "code", ""), 400.0),
                      (("cosine_spec_decode_num_accepted_tokens_total", "code", ""), 300.0)):
        after[key] += grow
    prev = Scrape(0.0, {"v-1": before}, {"code": {"d-1": _drafter(100, 150, 4, 800), "d-2": _drafter(90, 90, 9, 900)}})
    cur = Scrape(10.0, {"v-1": after}, {"code": {"d-1": _drafter(150, 250, 6, 1000),  # +50 rounds of 2, 2 s
                                                 "d-2": _drafter(10, 10, 0.5, 100),  # restarted: from zero
                                                 "d-new": _drafter(9, 9, 9, 9)}})  # no span: left out
    o = observe(prev, cur, {"code": (3, 2), "chat": (1, 1)})
    assert o.verifier is not None and o.verifier.step_s == 0.1 and o.verifier.requests_running == 3
    code = {p.name: p for p in o.pools}["code"]
    assert (code.asks_per_s, code.late_per_s) == (10, 4)
    assert code.skipped_per_s == {"late": 2, "yield": 50, "down": 0}
    assert code.demand_per_s() == 16  # asks + late steps + skipped as late; not the yield skips
    assert code.acceptance_rate == 0.75 and code.accepted_tokens_per_s == 30
    assert code.round_s == 2.5 / 60 and code.batch == 110 / 60  # both measured pods' rounds
    assert code.draft_tokens_per_s == 30 and code.rtt_s == 0.05 and code.drafter_samples
    assert code.utilization == 2.5 / 10 / 2  # busy seconds per second per measured pod
    chat = {p.name: p for p in o.pools}["chat"]
    assert chat.round_s is None and not chat.drafter_samples and chat.demand_per_s() == 0


def test_observe_without_a_common_verifier_pod_has_no_verifier() -> None:
    o = observe(Scrape(0, {}, {}), Scrape(5, {"v": parse(VERIFIER_TEXT)}, {}), {"code": (1, 1)})
    assert o.verifier is None and o.pools[0].acceptance_rate is None


def test_scrape_pods_reads_loopback_endpoints_and_skips_dead_ones() -> None:
    counters = Counters(**{"cosine_drafter_draft_tokens_total": 10.0})
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


def test_scrape_prometheus_takes_rates_from_prometheus() -> None:
    """Prometheus mode asks for ``rate()`` over a window (Prometheus divides by the samples' own
    timestamps, not the operator's clock) and reads the answers by pool and reason."""
    answers = {
        "sum(rate(cosine_verifier_steps_total": [{"metric": {}, "value": [0, "10"]}],
        "sum(rate(cosine_verifier_busy_seconds_total": [{"metric": {}, "value": [0, "0.8"]}],
        "sum by (pool, reason) (rate(cosine_drafter_asks_skipped_total": [
            {"metric": {"pool": "code", "reason": "down"}, "value": [0, "3"]}],
        "sum by (pool) (rate(cosine_drafter_rounds_total": [{"metric": {"pool": "code"}, "value": [0, "5"]}],
    }
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            from urllib.parse import parse_qs, urlparse

            query = parse_qs(urlparse(self.path).query)["query"][0]
            seen.append(query)
            result = next((v for k, v in answers.items() if query.startswith(k)), [])
            body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
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
        r = asyncio.run(scrape_prometheus(url, "ns", "c", 60.0, 2.0))
    finally:
        server.shutdown()
    assert 'sum(rate(cosine_verifier_steps_total{namespace="ns",pod=~"c-verifier-.*"}[60s]))' in seen
    assert r.verifier is not None and r.verifier["cosine_verifier_steps"] == 10
    assert r.pools["code"][("cosine_drafter_asks_skipped", "down")] == 3
    assert r.drafters["code"]["cosine_drafter_rounds"] == 5
