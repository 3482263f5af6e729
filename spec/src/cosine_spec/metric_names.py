"""Every ``cosine_`` series the runtime exports, named once: a contract between processes.

The runtime produces them (``cosine.metrics.ProposerCollector`` on the verifier,
``cosine.transport.drafter_service.DrafterMetrics`` on each drafter replica); the operator's
autoscaler (:mod:`cosine_spec.metrics_scrape`) and the runtime's own tooling (``cosine demo``,
``cosine bench``) read them. All import these names; nothing spells them twice.
``tests/test_metric_contract.py`` feeds the runtime's real ``/metrics`` text to the operator's
parsers, so a name changed on one side only fails there, not silently in a cluster's autoscaler.

Names are Prometheus metric family names; a counter's samples carry ``_total`` (:func:`total`).
Labels: ``model_name`` on every verifier series, ``pool`` on per-pool ones; the scrape adds
``namespace``, ``cosine_cluster`` and ``component`` (the chart's PodMonitor or ClusterPodMonitoring;
``cosine_spec.contract.METRIC_CLUSTER_LABEL``).

Why ``cosine_`` and not ``cosine:`` (the names before 0.2): Prometheus reserves colons for
recording rules (prometheus.io/docs/practices/naming), and a colon does not survive every scrape.
prometheus_client 0.26 answers Prometheus 2.x's OpenMetrics ``Accept`` header with
``escaping=underscores`` and writes ``cosine:drafter_contexts`` as ``cosine_drafter_contexts``
(prometheus/client_python#1177), while Prometheus 3.x negotiates UTF-8 names and keeps the colon:
the same exporter stored under two names. A name of ``[a-z0-9_]`` only is the same on both.
vLLM's own ``vllm:`` series are vLLM's to name; CoSine reads them as vLLM spells them (below).
"""

from __future__ import annotations

# verifier (the proposer inside vLLM's engine; its own port, verifier metrics port 9091)
VERIFIER_BUSY_SECONDS = "cosine_verifier_busy_seconds"  # counter: seconds in engine steps
VERIFIER_IDLE_SECONDS = "cosine_verifier_idle_seconds"  # counter: seconds not in engine steps
VERIFIER_TOKENS_VERIFIED = "cosine_verifier_tokens_verified"  # counter: tokens computed by the steps
VERIFIER_STEPS = "cosine_verifier_steps"  # counter: engine steps
VERIFIER_STEPS_WITH_DRAFT = "cosine_verifier_steps_with_draft"  # counter: steps that verified a draft
REQUESTS_RUNNING = "cosine_num_requests_running"  # gauge
REQUESTS_WAITING = "cosine_num_requests_waiting"  # gauge
# The suffix-affinity signal (the router's endpoint picker scores it): on the verifier's http port,
# beside vLLM's series, as well as on the metrics port
SUFFIX_TREE_HIT_RATE = "cosine_suffix_tree_hit_rate"  # gauge: share of recent lookups that found a draft (EMA)
SUFFIX_TREE_REQUESTS = "cosine_suffix_tree_requests"  # gauge: finished requests whose outputs the global tree holds
SUFFIX_TREE_TOKENS = "cosine_suffix_tree_tokens"  # gauge: tokens indexed in the suffix trees (prompts and outputs)
DRAFTS = "cosine_spec_decode_num_drafts"  # counter{pool}: verifications that had a draft
DRAFT_TOKENS = "cosine_spec_decode_num_draft_tokens"  # counter{pool}: draft tokens verified
ACCEPTED_TOKENS = "cosine_spec_decode_num_accepted_tokens"  # counter{pool}: draft tokens accepted
DRAFTS_LATE = "cosine_spec_decode_drafts_late"  # counter{pool}: steps a pool's draft was still in flight
POOL_ERRORS = "cosine_drafter_errors"  # counter{pool}: failed draft calls
POOL_CALLS = "cosine_drafter_calls"  # counter{pool}: draft calls that returned
POOL_ASKS_SKIPPED = "cosine_drafter_asks_skipped"  # counter{pool,reason}: draft asks not made (late/yield/down)
POOL_PROBE_ASKS = "cosine_drafter_probe_asks"  # counter{pool}: asks made only to probe (skipped as yield else)
# counter{pool}: expected tokens it adds over the verifier's own sources, where requests want it
POOL_GAIN_TOKENS = "cosine_drafter_gain_tokens"
POOL_RTT_SECONDS = "cosine_drafter_rtt_seconds"  # gauge{pool}: a draft call's wall time (EMA)
POOL_TOKEN_SECONDS = "cosine_drafter_token_seconds"  # gauge{pool}: a call's seconds per draft token (EMA)
POOL_YIELD_TOKENS = "cosine_drafter_yield_tokens"  # gauge{pool}: accepted tokens per draft call
POOL_ON_TIME_RATIO = "cosine_drafter_on_time_ratio"  # gauge{pool}: share of drafts in time (EMA)
POOL_ON_CONTEXT_RATIO = "cosine_drafter_on_context_ratio"  # gauge{pool}: share of arrived drafts continuing (EMA)
REPLICA_CALLS = "cosine_drafter_replica_calls"  # counter{pool,replica}
REPLICA_ERRORS = "cosine_drafter_replica_errors"  # counter{pool,replica}
REPLICA_BUSY_SECONDS = "cosine_drafter_replica_busy_seconds"  # counter{pool,replica}: a call in flight
REPLICA_REQUESTS = "cosine_drafter_replica_requests"  # gauge{pool,replica}: requests assigned now
REPLICA_REHOMED = "cosine_drafter_replica_rehomed"  # counter{pool,replica}: requests moved off it (drained/left/failed)
# drafter replica (drafter metrics port 9090)
DRAFTER_DRAFT_TOKENS = "cosine_drafter_draft_tokens"  # counter{pool}: draft tokens produced
DRAFTER_BUSY_SECONDS = "cosine_drafter_busy_seconds"  # counter{pool}: seconds the engine spent drafting
DRAFTER_BYTES_SENT = "cosine_drafter_bytes_sent"  # counter{pool}: bytes of draft responses
DRAFTER_ROUNDS = "cosine_drafter_rounds"  # counter{pool}: batched draft rounds
DRAFTER_BATCHED_REQUESTS = "cosine_drafter_batched_requests"  # counter{pool}: requests, summed over rounds
DRAFTER_CONTEXTS = "cosine_drafter_contexts"  # gauge{pool}: requests whose context the replica keeps
# spec fields of the manifest (the ConfigMap the operator wrote) this release does not know and
# ignored: a later release's CRD defaults, i.e. the CRDs are newer than this image
MANIFEST_UNKNOWN_FIELDS = "cosine_manifest_unknown_fields"  # gauge{pool}
# one replica's price per hour from the spec (spotPricePerHourUsd on spot capacity, else
# pricePerHourUsd), exported by the operator per cluster and by `cosine serve`: what the dashboards
# divide accepted tokens by
POOL_PRICE = "cosine_drafter_pool_price_usd_per_hour"  # gauge{namespace,cluster,pool} (operator) / {pool} (serve)
# `cosine serve`'s embedded cluster (`cosine serve --pools-metrics-port`), what the operator's own
# metrics say on Kubernetes
EMBEDDED_REPLICAS = "cosine_embedded_pool_replicas"  # gauge{pool}: replica processes the pool runs now
EMBEDDED_AUTOSCALER_PASSES = "cosine_embedded_autoscaler_passes"  # counter: autoscaling passes made
EMBEDDED_AUTOSCALER_ERRORS = "cosine_embedded_autoscaler_errors"  # counter{stage}: passes' failed stages
EMBEDDED_REPLICA_EXITS = "cosine_embedded_replica_exits"  # counter{pool,code}: replica processes that exited

# vLLM's own series, on the verifier's OpenAI server (port 8000), as vLLM 0.32 names them
# (`vllm/v1/metrics/loggers.py`, `vllm/v1/spec_decode/metrics.py`; `tests/test_metric_contract.py`
# checks each against the installed vLLM). Read, never exported, by CoSine.
VLLM_DRAFTS = "vllm:spec_decode_num_drafts"  # counter: verifications that had a draft
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"  # counter: draft tokens verified
VLLM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"  # counter: draft tokens accepted
VLLM_TTFT_SECONDS = "vllm:time_to_first_token_seconds"  # histogram: TTFT
VLLM_ITL_SECONDS = "vllm:inter_token_latency_seconds"  # histogram: time between output tokens (TPOT)
VLLM_REQUESTS_RUNNING = "vllm:num_requests_running"  # gauge
VLLM_REQUESTS_WAITING = "vllm:num_requests_waiting"  # gauge
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # gauge: share of the KV cache's blocks in use, 0..1
VLLM_SPEC_DECODE_PREFIX = "vllm:spec_decode_"  # the bench scrapes every series under it


PREFIX = "cosine_"  # every CoSine series (the operator's own: ``cosine_operator_``)


def total(name: str) -> str:
    """The sample name of counter ``name`` in the text exposition format (``<name>_total``)."""
    return f"{name}_total"
