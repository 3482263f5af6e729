"""Prometheus metrics of the serving runtime, named after vLLM's under a `cosine_` prefix.

The proposer counts (`proposer_stats.ProposerStats`); `ProposerCollector` turns the counts into series
at scrape time; `ProposerExporter` serves them. The operator's autoscaler reads the same series
(its contract: the names below).

Derived figures in PromQL:
- acceptance rate per pool:
    rate(cosine_spec_decode_num_accepted_tokens_total[1m]) / rate(cosine_spec_decode_num_draft_tokens_total[1m])
- mean acceptance length (tokens emitted per verification that had a draft):
    1 + rate(cosine_spec_decode_num_accepted_tokens_total[1m]) / rate(cosine_spec_decode_num_drafts_total[1m])
- a pool replica's busy fraction (share of wall time with a draft call in flight) and its share of
  the pool's calls:
    rate(cosine_drafter_replica_busy_seconds_total[1m])
    rate(cosine_drafter_replica_calls_total[1m]) / ignoring(replica) group_left
      sum without(replica) (rate(cosine_drafter_replica_calls_total[1m]))
- verifier idle ("bubble") fraction:
    rate(cosine_verifier_idle_seconds_total[1m])
      / (rate(cosine_verifier_idle_seconds_total[1m]) + rate(cosine_verifier_busy_seconds_total[1m]))
Latency (TTFT, inter-token latency) is vLLM's own: its `vllm:` histograms on the OpenAI server.
"""

from __future__ import annotations

from cosine_spec import metric_names as names
from cosine_spec.autoscaling import SKIP_REASONS
from prometheus_client import CollectorRegistry


class ProposerCollector:
    """Prometheus collector over a `proposer_stats.ProposerStats` (read at scrape time), for the
    drafting plane running inside vLLM's engine-core process. vLLM's own `vllm:` series (its
    `vllm:spec_decode_*` counters included) stay on the OpenAI server's `/metrics`; these are the
    per-pool series vLLM lacks, on the proposer's own port (`ProposerExporter`):

    - cosine_spec_decode_num_drafts_total{pool}, cosine_spec_decode_num_draft_tokens_total{pool},
      cosine_spec_decode_num_accepted_tokens_total{pool}: as above, per draft source ("lookup" =
      in-process prompt lookup, else the drafter pool);
    - cosine_spec_decode_drafts_late_total{pool}: steps a pool's draft was still in flight;
    - cosine_drafter_errors_total{pool}, cosine_drafter_calls_total{pool};
      cosine_drafter_rtt_seconds{pool} (EMA of a draft call); cosine_drafter_token_seconds{pool}
      (EMA of a call's seconds per draft token it drafted); cosine_drafter_yield_tokens{pool}
      (accepted tokens per draft call over recent calls); cosine_drafter_on_time_ratio{pool}
      (share of a pool's drafts that arrived in time and continued the context);
      cosine_drafter_asks_skipped_total{pool,reason} (draft asks not made: `late`, `yield` or `down`,
      `proposer.CoSineProposer`; the autoscaler's demand counts late and down);
      cosine_drafter_probe_asks_total{pool} (asks made only on a request's probe steps, where the
      pool would be skipped as `yield`: not demand); cosine_drafter_gain_tokens_total{pool} (expected
      accepted tokens the pool adds over the verifier's own sources where requests want it: what
      the autoscaler weighs a replica's price against);
    - cosine_drafter_replica_calls_total{pool,replica}, cosine_drafter_replica_errors_total{pool,replica},
      cosine_drafter_replica_busy_seconds_total{pool,replica} (wall seconds with a call in flight),
      cosine_drafter_replica_requests{pool,replica} (requests assigned to the replica now),
      cosine_drafter_replica_rehomed_total{pool,replica} (requests moved off it), from
      `replicas()`: pool -> replica address -> `transport.replica_pool.ReplicaStats`;
    - cosine_verifier_steps_total, cosine_verifier_steps_with_draft_total.
    """

    def __init__(self, stats, model_name: str = "", clock=None, replicas=None, suffix=None) -> None:
        import time

        self.stats = stats
        self.replicas = replicas or dict
        self.suffix = suffix  # a `SuffixAffinity`: the cosine_suffix_tree_* gauges
        self.model_name = model_name
        self.clock = clock or time.monotonic
        self.started_s = self.clock()

    def collect(self):
        """Yield the metric families above from the stats' current values (called per scrape)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self.suffix is not None:
            yield from self.suffix.families()
        s = self.stats.snapshot()  # one consistent reading: pool calls' threads go on writing
        # every pool asked at least once gets every per-pool series, at 0 where nothing happened yet
        # (Prometheus's advice against missing series: a rate, an alert or a panel over a counter
        # that appears only once something goes wrong sees nothing until then)
        pools = sorted(set(s.pool_calls) | set(s.pool_errors) | set(s.pool_rtt_s) | {p for p, _ in s.pool_skipped})
        per_pool = (
            (names.DRAFTS, "Verifications that had a draft.", s.drafts),
            (names.DRAFT_TOKENS, "Draft tokens verified.", s.draft_tokens),
            (names.ACCEPTED_TOKENS, "Draft tokens accepted.", s.accepted_tokens),
            (names.DRAFTS_LATE, "Steps a pool's draft was still in flight.", s.drafts_late),
            (names.POOL_ERRORS, "Failed draft calls.", s.pool_errors),
            (names.POOL_CALLS, "Draft calls that returned.", s.pool_calls),
            (names.POOL_PROBE_ASKS, "Draft asks made only to probe: on a request's probe step, where the pool "
             "would be skipped as yield (not demand for the autoscaler).", s.pool_probes),
            (names.POOL_GAIN_TOKENS, "Expected accepted tokens the pool's drafts add over the verifier's own "
             "sources, summed over the steps a request wanted them (asks but probes, drafts in flight, skips "
             "as late or down).",
             s.pool_gain_tokens),
        )
        for name, doc, values in per_pool:
            fam = CounterMetricFamily(name, doc, labels=["model_name", "pool"])
            for pool, v in sorted({**dict.fromkeys(pools, 0), **dict(values)}.items()):
                fam.add_metric([self.model_name, pool], v)
            yield fam
        skipped = CounterMetricFamily(names.POOL_ASKS_SKIPPED, "Draft asks not made, by reason: late (the pool's "
                                      "drafts arrive too late to pay), yield (they are not accepted enough), down "
                                      "(no replica answers).", labels=["model_name", "pool", "reason"])
        by_reason = {**{(p, r): 0 for p in pools for r in SKIP_REASONS}, **dict(s.pool_skipped)}
        for (pool, reason), v in sorted(by_reason.items()):
            skipped.add_metric([self.model_name, pool, reason], v)
        yield skipped
        gauges = (
            (names.POOL_RTT_SECONDS, "Draft call wall time (EMA).", s.pool_rtt_s),
            (names.POOL_TOKEN_SECONDS, "Draft call wall time per draft token drafted (EMA): what a "
             "pool's draft is sized by.", s.pool_token_s),
            (names.POOL_YIELD_TOKENS, "Accepted tokens per draft call, recent calls.", s.pool_yield),
            (names.POOL_ON_CONTEXT_RATIO, "Share of a pool's drafts arrived in time that continued the context "
             "(EMA).", s.pool_on_context),
            (names.POOL_ON_TIME_RATIO, "Share of looks at a pool's draft for which it had arrived in time "
             "(EMA).", s.pool_on_time),
        )
        for name, doc, values in gauges:
            fam = GaugeMetricFamily(name, doc, labels=["model_name", "pool"])
            for pool, v in sorted(dict(values).items()):
                fam.add_metric([self.model_name, pool], v)
            yield fam
        per_replica = (
            (names.REPLICA_CALLS, "Draft calls that returned, per replica.", CounterMetricFamily, "calls"),
            (names.REPLICA_ERRORS, "Failed draft calls, per replica.", CounterMetricFamily, "errors"),
            (names.REPLICA_BUSY_SECONDS, "Wall seconds with a draft call in flight, per replica.",
             CounterMetricFamily, "busy_s"),
            (names.REPLICA_REQUESTS, "Requests assigned to the replica.", GaugeMetricFamily, "held"),
            (names.REPLICA_REHOMED, "Requests moved off the replica (it drained, left or failed).",
             CounterMetricFamily, "rehomed"),
        )
        snapshot = self.replicas()
        for name, doc, kind, attr in per_replica:
            fam = kind(name, doc, labels=["model_name", "pool", "replica"])
            for pool, by_address in sorted(snapshot.items()):
                for address, st in sorted(by_address.items()):
                    fam.add_metric([self.model_name, pool, address], getattr(st, attr))
            yield fam
        yield from self._verifier_families(s)

    def _verifier_families(self, s):
        """The verifier's own series (steps, busy and idle seconds, tokens, queue) from snapshot `s`."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        steps = CounterMetricFamily(names.VERIFIER_STEPS, "Engine steps.", labels=["model_name"])
        steps.add_metric([self.model_name], s.steps)
        yield steps
        with_draft = CounterMetricFamily(names.VERIFIER_STEPS_WITH_DRAFT, "Engine steps that verified a draft.",
                                         labels=["model_name"])
        with_draft.add_metric([self.model_name], s.steps_with_draft)
        yield with_draft
        # the operator's autoscaler reads these (cosine_spec.metric_names): busy/idle, tokens, queue
        busy = CounterMetricFamily(names.VERIFIER_BUSY_SECONDS, "Seconds in engine steps.", labels=["model_name"])
        busy.add_metric([self.model_name], s.busy_s)
        yield busy
        idle = CounterMetricFamily(names.VERIFIER_IDLE_SECONDS, "Seconds not in engine steps.",
                                   labels=["model_name"])
        idle.add_metric([self.model_name], max(0.0, self.clock() - self.started_s - s.busy_s))
        yield idle
        tokens = CounterMetricFamily(names.VERIFIER_TOKENS_VERIFIED, "Tokens computed by engine steps.",
                                     labels=["model_name"])
        tokens.add_metric([self.model_name], s.tokens_verified)
        yield tokens
        for name, doc, v in ((names.REQUESTS_RUNNING, "Requests being decoded.", s.requests_running),
                             (names.REQUESTS_WAITING, "Requests queued for admission.", s.requests_waiting)):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], v)
            yield g


class ProposerExporter:
    """Serves `ProposerCollector` on its own port (the engine-core process is not the HTTP server's).

    Raises OSError when `host:port` cannot be bound."""

    def __init__(self, stats, port: int, host: str = "0.0.0.0", model_name: str = "", replicas=None,
                 suffix=None) -> None:
        from prometheus_client import start_http_server

        self.registry = CollectorRegistry()
        self.registry.register(ProposerCollector(stats, model_name, replicas=replicas, suffix=suffix))
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)


SUFFIX_GAUGES = (
    (names.SUFFIX_TREE_HIT_RATE, "Share of recent suffix-tree lookups that found a draft (EMA over ~50)."),
    (names.SUFFIX_TREE_REQUESTS, "Finished requests whose outputs the verifier's global suffix tree holds."),
    (names.SUFFIX_TREE_TOKENS, "Tokens indexed in the verifier's suffix trees (running prompts, outputs)."),
)


class SuffixAffinity:
    """What the verifier's suffix trees (`lookup.SuffixLookup`) hold and how often they draft: the
    cosine_suffix_tree_* gauges, the signal the router's endpoint picker scores suffix affinity on.

    `update` reads the lookup from the engine's thread (its only user), at most once per
    `period_s`; exporters read the last values (`families`, on the proposer's port). With
    `multiprocess` (the verifier sets `PROMETHEUS_MULTIPROC_DIR`, `roles.verifier_command`) the
    values are also written as prometheus_client multi-process gauges, which vLLM's OpenAI server
    aggregates on its own `/metrics`: the http port, where an endpoint picker scrapes vLLM's series."""

    def __init__(self, lookup, model_name: str = "", period_s: float = 1.0, multiprocess: bool = False) -> None:
        self.lookup, self.model_name, self.period_s = lookup, model_name, period_s
        self.values = (0.0, 0, 0)  # hit rate, requests, tokens
        self._last_s = float("-inf")
        self._gauges = None
        if multiprocess:
            from prometheus_client import Gauge

            self._gauges = [Gauge(name, doc, ["model_name"], multiprocess_mode="mostrecent")
                            for name, doc in SUFFIX_GAUGES]

    def update(self, now_s: float) -> None:
        """Read the lookup (engine thread only) when `period_s` has passed since the last read."""
        if now_s - self._last_s < self.period_s:
            return
        self._last_s = now_s
        requests, tokens = self.lookup.held()
        self.values = (float(self.lookup.hit_rate), requests, tokens)
        if self._gauges is not None:
            for gauge, value in zip(self._gauges, self.values, strict=True):
                gauge.labels(self.model_name).set(value)

    def families(self):
        """The gauges at their last values, as metric families (a collector's `collect`)."""
        from prometheus_client.core import GaugeMetricFamily

        for (name, doc), value in zip(SUFFIX_GAUGES, self.values, strict=True):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
