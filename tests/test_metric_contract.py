"""The metric contract between processes: what the runtime exports, the operator's autoscaler reads.

The producer is real (the verifier's `ProposerCollector` over a `ProposerStats`, a drafter
replica's `DrafterMetrics`), rendered to the Prometheus text format as their `/metrics` endpoints
serve it; the consumer is the operator's own parser (`metrics_scrape.parse`,
`observe`). A series renamed on one side only reads as 0 on the other, which would blind
the autoscaler silently; here it fails. The names live in `cosine_spec.metric_names`.
"""

from __future__ import annotations

from cosine_spec import metric_names
from cosine_spec.metrics_scrape import Scrape, observe, parse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cosine.metrics import ProposerCollector
from cosine.proposer_stats import ProposerStats
from cosine.transport.drafter_service import DrafterMetrics


def _cosine_names() -> set[str]:
    """The contract's CoSine series (vLLM's and the prefixes left out)."""
    return {v for k, v in vars(metric_names).items()
            if k.isupper() and isinstance(v, str) and not k.startswith("VLLM_") and not v.endswith("_")}


def _verifier_text(stats: ProposerStats, now_s: float) -> str:
    registry = CollectorRegistry()
    registry.register(ProposerCollector(stats, "qwen", clock=iter([0.0, now_s]).__next__))
    return generate_latest(registry).decode()


def test_the_runtimes_metrics_become_the_autoscalers_observations() -> None:
    """The verifier's and a drafter's real exposition, 10 s apart, through the operator's parser
    and rates: every input of the scaling rule comes out as the runtime counted it."""
    before = ProposerStats()
    after = ProposerStats(busy_s=5.0, steps=50, tokens_verified=340, requests_running=6, requests_waiting=2,
                          draft_tokens={"lookup": 40, "code": 100}, accepted_tokens={"lookup": 10, "code": 70},
                          pool_calls={"code": 20}, pool_errors={"code": 5}, drafts_late={"code": 30},
                          pool_skipped={("code", "late"): 10, ("code", "yield"): 60, ("code", "down"): 15},
                          pool_rtt_s={"code": 0.04}, pool_yield={"code": 2.5})
    drafter = DrafterMetrics("code")
    first = parse(generate_latest(drafter.registry).decode())
    drafter.rounds.inc(40)
    drafter.batched.inc(100)
    drafter.busy_seconds = lambda: 2.0
    drafter.draft_tokens.inc(250)
    second = parse(generate_latest(drafter.registry).decode())
    prev = Scrape(0.0, {"v": parse(_verifier_text(before, 0.0))}, {"code": {"d": first}})
    cur = Scrape(10.0, {"v": parse(_verifier_text(after, 10.0))}, {"code": {"d": second}})
    o = observe(prev, cur, {"code": (1, 1)})
    assert o.verifier is not None
    assert (o.verifier.step_s, o.verifier.tokens_verified_per_s) == (0.1, 34)
    assert (o.verifier.requests_running, o.verifier.requests_waiting) == (6, 2)
    (code,) = o.pools
    assert (code.asks_per_s, code.late_per_s) == (2.5, 3)
    assert code.skipped_per_s == {"late": 1, "yield": 6, "down": 1.5}
    assert code.demand_per_s() == 8  # asks + late steps + skipped late + skipped down
    assert (code.acceptance_rate, code.accepted_tokens_per_s) == (0.7, 7)
    assert (code.round_s, code.batch, code.draft_tokens_per_s, code.utilization) == (0.05, 2.5, 25, 0.2)
    assert (code.rtt_s, code.yield_tokens) == (0.04, 2.5)


def test_every_contract_name_is_exported() -> None:
    """Each name of the contract appears in a producer's output (none is read but never written)."""
    registry = CollectorRegistry()
    from cosine.embedded import EmbeddedMetrics
    from cosine.lookup import SuffixLookup
    from cosine.metrics import SuffixAffinity

    registry.register(ProposerCollector(ProposerStats(draft_tokens={"p": 1}, accepted_tokens={"p": 1}), "m",
                                        suffix=SuffixAffinity(SuffixLookup(), "m")))

    embedded = EmbeddedMetrics()
    embedded.replicas.labels("p").set(1)
    embedded.errors.labels("observe").inc()
    embedded.exits.labels("p", "0").inc()
    text = (generate_latest(registry).decode() + generate_latest(DrafterMetrics("p").registry).decode()
            + generate_latest(embedded.registry).decode())
    exported = {family.name for family in text_string_to_metric_families(text)}
    names = _cosine_names()
    assert names and names <= exported, names - exported


def test_the_vllm_series_cosine_reads_are_the_ones_vllm_names() -> None:
    """Catches: a vLLM upgrade renaming a series the bench, `cosine generate`, the docs or the
    dashboards read (it would read as absent, not fail). The names are looked up in the installed
    vLLM's metric loggers, where vLLM defines them."""
    import importlib.util
    from pathlib import Path

    root = Path(importlib.util.find_spec("vllm").origin).parent  # type: ignore[union-attr, arg-type]
    source = "".join((root / f).read_text() for f in ("v1/metrics/loggers.py", "v1/spec_decode/metrics.py"))
    names = {v for k, v in vars(metric_names).items() if k.startswith("VLLM_") and isinstance(v, str)}
    assert len(names) >= 8
    for name in names:
        assert (f'"{name}' in source), name


def test_a_pool_asked_once_has_every_series_at_zero_until_something_happens() -> None:
    """Catches: a counter that appears only once it moves (drafts late, asks skipped per reason, errors):
    a dashboard panel or an alert over it sees no series on a healthy cluster, and `rate()` misses
    its first increments."""
    text = _verifier_text(ProposerStats(pool_calls={"code": 3}), 10.0)
    for series in ('cosine_spec_decode_drafts_late_total{model_name="qwen",pool="code"} 0.0',
                   'cosine_drafter_errors_total{model_name="qwen",pool="code"} 0.0',
                   'cosine_spec_decode_num_drafts_total{model_name="qwen",pool="code"} 0.0',
                   'cosine_drafter_asks_skipped_total{model_name="qwen",pool="code",reason="down"} 0.0',
                   'cosine_drafter_asks_skipped_total{model_name="qwen",pool="code",reason="late"} 0.0'):
        assert series in text, series


# The Accept headers Prometheus scrapes with (its scrape manager's defaults): 2.x asks for OpenMetrics
# with no escaping parameter, which prometheus_client 0.26 answers with escaping=underscores
# (prometheus/client_python#1177); 3.x asks for UTF-8 names.
PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                       "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
PROMETHEUS_3_ACCEPT = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
                       "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;"
                       "q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1")


def test_every_name_reads_the_same_to_prometheus_2_and_3() -> None:
    """Catches: a CoSine series whose name a scrape rewrites (a colon: Prometheus 2.x stored
    `cosine:drafter_contexts` as `cosine_drafter_contexts`, 3.x kept it), so that a dashboard or an
    alert sees it on one server and nothing on the other. Every producer's exposition, as
    prometheus_client negotiates it with each server's Accept header, holds the contract's names."""
    from prometheus_client.exposition import choose_encoder
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    from cosine.embedded import EmbeddedMetrics
    from cosine.lookup import SuffixLookup
    from cosine.metrics import SuffixAffinity

    verifier = CollectorRegistry()
    verifier.register(ProposerCollector(ProposerStats(draft_tokens={"p": 1}, accepted_tokens={"p": 1}), "m",
                                        suffix=SuffixAffinity(SuffixLookup(), "m")))
    embedded = EmbeddedMetrics()
    embedded.replicas.labels("p").set(1)
    embedded.errors.labels("observe").inc()
    embedded.exits.labels("p", "0").inc()
    registries = (verifier, DrafterMetrics("p").registry, embedded.registry)
    names = _cosine_names()
    assert all(":" not in name and name.startswith(metric_names.PREFIX) for name in names), names
    for accept in (PROMETHEUS_2_ACCEPT, PROMETHEUS_3_ACCEPT):
        exported: set[str] = set()
        for registry in registries:
            encode, content_type = choose_encoder(accept)
            assert content_type.startswith("application/openmetrics-text"), content_type
            exported |= {family.name for family in openmetrics_families(encode(registry).decode())}
        assert names <= exported, (accept, names - exported)
