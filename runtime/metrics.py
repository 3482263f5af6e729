"""Prometheus metrics of the serving runtime, named after vLLM's under a `cosine:` prefix.

Layers (after vLLM `spec_decode/metrics.py`): the coordinator reports events through
`ServingMetrics.*` methods; `prometheus_client` aggregates; `/metrics` exports. The operator's
autoscaler reads the same series (its contract: the names below).

Derived figures in PromQL:
- acceptance rate per pool:
    rate(cosine:spec_decode_num_accepted_tokens_total[1m]) / rate(cosine:spec_decode_num_draft_tokens_total[1m])
- mean acceptance length (tokens emitted per verification that had a draft):
    1 + rate(cosine:spec_decode_num_accepted_tokens_total[1m]) / rate(cosine:spec_decode_num_drafts_total[1m])
- verifier idle ("bubble") fraction:
    rate(cosine:verifier_idle_seconds_total[1m])
      / (rate(cosine:verifier_idle_seconds_total[1m]) + rate(cosine:verifier_busy_seconds_total[1m]))
- TTFT p99: histogram_quantile(0.99, rate(cosine:time_to_first_token_seconds_bucket[5m]))
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class ServingMetrics:
    """Metrics of one verifier (coordinator + gateway). `registry` defaults to a fresh one so tests
    and several in-process servers do not collide."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, {"model_name": model_name}
        self.requests_total = Counter(
            "cosine:request_success_total", "Finished requests by finish reason.", ["model_name", "finished_reason"],
            registry=r,
        )
        self.running = Gauge("cosine:num_requests_running", "Requests being decoded.", ["model_name"], registry=r)
        self.waiting = Gauge(
            "cosine:num_requests_waiting", "Requests queued for admission.", ["model_name"], registry=r
        )
        self.prompt_tokens = Counter(
            "cosine:prompt_tokens_total", "Prefilled prompt tokens.", ["model_name"], registry=r
        )
        self.generation_tokens = Counter(
            "cosine:generation_tokens_total", "Emitted output tokens.", ["model_name"], registry=r
        )
        self.ttft = Histogram(
            "cosine:time_to_first_token_seconds", "Time to first token.", ["model_name"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "cosine:inter_token_latency_seconds", "Mean time per output token after the first, per request.",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "cosine:e2e_request_latency_seconds", "Request latency from admission to last token.", ["model_name"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.num_drafts = Counter(
            "cosine:spec_decode_num_drafts_total", "Verifications that had a draft.", ["model_name", "pool"], registry=r
        )
        self.draft_tokens = Counter(
            "cosine:spec_decode_num_draft_tokens_total", "Draft tokens verified.", ["model_name", "pool"], registry=r
        )
        self.accepted_tokens = Counter(
            "cosine:spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", ["model_name", "pool"],
            registry=r,
        )
        self.verified_tokens = Counter(
            "cosine:verifier_tokens_verified_total", "Tokens scored by target passes (drafts + pending).",
            ["model_name"], registry=r,
        )
        self.busy_s = Counter(
            "cosine:verifier_busy_seconds_total", "Seconds the verifier engine spent in passes.", ["model_name"],
            registry=r,
        )
        self.idle_s = Counter(
            "cosine:verifier_idle_seconds_total", "Seconds the verifier engine waited for work.", ["model_name"],
            registry=r,
        )
        self.rejected = Counter(
            "cosine:request_rejected_total", "Requests refused at admission (overload).", ["model_name"], registry=r
        )
        self.draft_bytes = Counter(
            "cosine:draft_bytes_total", "Bytes of draft messages received from drafters.", ["model_name", "pool"],
            registry=r,
        )
        self._labels = labels

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.labels(**self._labels).set(running)
        self.waiting.labels(**self._labels).set(waiting)

    def request_rejected(self) -> None:
        self.rejected.labels(**self._labels).inc()

    def first_token(self, ttft_s: float) -> None:
        self.ttft.labels(**self._labels).observe(ttft_s)

    def spec_step(self, pool: str, num_draft_tokens: int, num_accepted: int, draft_bytes: int = 0) -> None:
        lab = {**self._labels, "pool": pool}
        self.num_drafts.labels(**lab).inc()
        self.draft_tokens.labels(**lab).inc(num_draft_tokens)
        self.accepted_tokens.labels(**lab).inc(num_accepted)
        if draft_bytes:
            self.draft_bytes.labels(**lab).inc(draft_bytes)

    def tokens_verified(self, n: int) -> None:
        self.verified_tokens.labels(**self._labels).inc(n)

    def verifier_busy(self, seconds: float) -> None:
        self.busy_s.labels(**self._labels).inc(max(0.0, seconds))

    def verifier_idle(self, seconds: float) -> None:
        self.idle_s.labels(**self._labels).inc(max(0.0, seconds))

    def request_finished(self, stats, e2e_s: float, reason: str) -> None:
        """`stats` is the request's `GenerationStats`; reason: "stop", "length" or "abort"."""
        self.requests_total.labels(**self._labels, finished_reason=reason).inc()
        self.prompt_tokens.labels(**self._labels).inc(stats.prompt_tokens)
        self.generation_tokens.labels(**self._labels).inc(stats.output_tokens)
        if stats.tpot_s is not None:
            self.itl.labels(**self._labels).observe(stats.tpot_s)
        self.e2e.labels(**self._labels).observe(e2e_s)


class ProposerCollector:
    """Prometheus collector over a `proposer.ProposerStats` (read at scrape time), for the
    drafting plane running inside vLLM's engine-core process. vLLM's own `vllm:` series (its
    `vllm:spec_decode_*` counters included) stay on the OpenAI server's `/metrics`; these are the
    per-pool series vLLM lacks, on the proposer's own port (`ProposerExporter`):

    - cosine:spec_decode_num_drafts_total{pool}, cosine:spec_decode_num_draft_tokens_total{pool},
      cosine:spec_decode_num_accepted_tokens_total{pool}: as above, per draft source ("lookup" =
      in-process prompt lookup, else the drafter pool);
    - cosine:spec_decode_drafts_late_total{pool}: steps a pool's draft was still in flight;
    - cosine:drafter_errors_total{pool}, cosine:drafter_calls_total{pool};
      cosine:drafter_rtt_seconds{pool} (EMA of a draft call); cosine:drafter_yield_tokens{pool}
      (accepted tokens per draft call over recent calls); cosine:drafter_on_time_ratio{pool}
      (share of a pool's drafts that arrived in time and continued the context);
      cosine:drafter_asks_skipped_total{pool} (draft asks not made: the pool did not pay there);
    - cosine:verifier_steps_total, cosine:verifier_steps_with_draft_total.
    """

    def __init__(self, stats, model_name: str = "", clock=None) -> None:
        import time

        self.stats = stats
        self.model_name = model_name
        self.clock = clock or time.monotonic
        self.started_s = self.clock()

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats
        per_pool = (
            ("cosine:spec_decode_num_drafts", "Verifications that had a draft.", s.drafts),
            ("cosine:spec_decode_num_draft_tokens", "Draft tokens verified.", s.draft_tokens),
            ("cosine:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.accepted_tokens),
            ("cosine:spec_decode_drafts_late", "Steps a pool's draft was still in flight.", s.drafts_late),
            ("cosine:drafter_errors", "Failed draft calls.", s.pool_errors),
            ("cosine:drafter_calls", "Draft calls that returned.", s.pool_calls),
            ("cosine:drafter_asks_skipped", "Draft asks not made: the pool did not pay there.", s.pool_skipped),
        )
        for name, doc, values in per_pool:
            fam = CounterMetricFamily(name, doc, labels=["model_name", "pool"])
            for pool, v in sorted(dict(values).items()):
                fam.add_metric([self.model_name, pool], v)
            yield fam
        gauges = (
            ("cosine:drafter_rtt_seconds", "Draft call wall time (EMA).", s.pool_rtt_s),
            ("cosine:drafter_yield_tokens", "Accepted tokens per draft call, recent calls.", s.pool_yield),
            ("cosine:drafter_on_time_ratio", "Share of a pool's drafts that arrived in time and continued the "
             "context (EMA).", s.pool_on_time),
        )
        for name, doc, values in gauges:
            fam = GaugeMetricFamily(name, doc, labels=["model_name", "pool"])
            for pool, v in sorted(dict(values).items()):
                fam.add_metric([self.model_name, pool], v)
            yield fam
        steps = CounterMetricFamily("cosine:verifier_steps", "Engine steps.", labels=["model_name"])
        steps.add_metric([self.model_name], s.steps)
        yield steps
        with_draft = CounterMetricFamily("cosine:verifier_steps_with_draft", "Engine steps that verified a draft.",
                                         labels=["model_name"])
        with_draft.add_metric([self.model_name], s.steps_with_draft)
        yield with_draft
        # the operator's autoscaler contract (operator/metrics_scrape.py): busy/idle, tokens, queue
        busy = CounterMetricFamily("cosine:verifier_busy_seconds", "Seconds in engine steps.", labels=["model_name"])
        busy.add_metric([self.model_name], s.busy_s)
        yield busy
        idle = CounterMetricFamily("cosine:verifier_idle_seconds", "Seconds not in engine steps.",
                                   labels=["model_name"])
        idle.add_metric([self.model_name], max(0.0, self.clock() - self.started_s - s.busy_s))
        yield idle
        tokens = CounterMetricFamily("cosine:verifier_tokens_verified", "Tokens computed by engine steps.",
                                     labels=["model_name"])
        tokens.add_metric([self.model_name], s.tokens_verified)
        yield tokens
        for name, doc, v in (("cosine:num_requests_running", "Requests being decoded.", s.requests_running),
                             ("cosine:num_requests_waiting", "Requests queued for admission.", s.requests_waiting)):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], v)
            yield g


class ProposerExporter:
    """Serves `ProposerCollector` on its own port (the engine-core process is not the HTTP server's)."""

    def __init__(self, stats, port: int, host: str = "0.0.0.0", model_name: str = "") -> None:
        from prometheus_client import start_http_server

        self.registry = CollectorRegistry()
        self.registry.register(ProposerCollector(stats, model_name))
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
