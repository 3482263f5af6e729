"""The metric contract between processes: what the runtime exports, the operator's autoscaler reads.

The producer is real (the verifier's `ProposerCollector` over a `ProposerStats`, a drafter
replica's `DrafterMetrics`), rendered to the Prometheus text format as their `/metrics` endpoints
serve it; the consumer is the operator's own parser (`metrics_scrape.parse_verifier`,
`parse_drafter`). A series renamed on one side only reads as 0 on the other, which would blind
the autoscaler silently; here it fails. The names live in `cosine_operator.metric_names`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cosine.metrics import ProposerCollector
from cosine.proposer import ProposerStats
from cosine.transport.drafter_service import DrafterMetrics
from cosine_operator import metric_names
from cosine_operator.metrics_scrape import parse_drafter, parse_verifier


def test_the_verifiers_metrics_read_by_the_operator() -> None:
    stats = ProposerStats(busy_s=12.5, tokens_verified=340, requests_running=6, requests_waiting=2,
                          draft_tokens={"lookup": 40, "code": 100}, accepted_tokens={"lookup": 10, "code": 71})
    clock = iter([0.0, 20.0])  # started at 0; scraped at 20 s: 12.5 s busy, 7.5 s idle
    registry = CollectorRegistry()
    registry.register(ProposerCollector(stats, "qwen", clock=lambda: next(clock)))
    sample = parse_verifier(generate_latest(registry).decode())
    assert (sample.busy_s, sample.idle_s, sample.tokens_verified) == (12.5, 7.5, 340)
    assert (sample.requests_running, sample.requests_waiting) == (6, 2)
    assert sample.draft_tokens == {"lookup": 40, "code": 100}
    assert sample.accepted_tokens == {"lookup": 10, "code": 71}


def test_a_drafters_metrics_read_by_the_operator() -> None:
    metrics = DrafterMetrics("code")
    metrics.draft_tokens.inc(250)
    metrics.busy_s.inc(4.25)
    sample = parse_drafter(generate_latest(metrics.registry).decode())
    assert (sample.draft_tokens, sample.busy_s) == (250, 4.25)


def test_every_contract_name_is_exported() -> None:
    """Each name of the contract appears in a producer's output (none is read but never written)."""
    registry = CollectorRegistry()
    registry.register(ProposerCollector(ProposerStats(draft_tokens={"p": 1}, accepted_tokens={"p": 1}), "m"))
    text = generate_latest(registry).decode() + generate_latest(DrafterMetrics("p").registry).decode()
    exported = {family.name for family in text_string_to_metric_families(text)}
    names = {v for k, v in vars(metric_names).items() if k.isupper()}
    assert names and names <= exported, names - exported
