"""Gather the autoscaler's observations: scrape the pods' ``/metrics`` (or ask Prometheus).

Three layers: :func:`parse` (Prometheus text → one pod's samples, pure), :func:`observe` (two
scrapes ``dt`` seconds apart → rates → :class:`~cosine_spec.autoscaling.Observations`, pure;
Prometheus mode computes the rates itself, with ``rate()``), and the async fetchers
:func:`scrape_pods` / :func:`scrape_prometheus` (HTTP only). Series names:
:mod:`cosine_spec.metric_names`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from cosine_spec import metric_names as names
from cosine_spec.autoscaling import SKIP_REASONS, Observations, PoolObservation, VerifierObservation
from cosine_spec.metric_names import total

# A pod's samples: (sample name, pool label or "", reason label or "") -> value, summed over the
# other labels (model_name, replica).
Sample = Mapping[tuple[str, str, str], float]

# verifier series read per pool: counters (rates) and gauges (averaged over verifier pods)
POOL_COUNTERS = (names.POOL_CALLS, names.POOL_ERRORS, names.DRAFTS_LATE, names.DRAFT_TOKENS,
                 names.ACCEPTED_TOKENS, names.POOL_ASKS_SKIPPED, names.POOL_PROBE_ASKS,
                 names.POOL_GAIN_TOKENS)
POOL_GAUGES = (names.POOL_RTT_SECONDS, names.POOL_YIELD_TOKENS)
VERIFIER_COUNTERS = (names.VERIFIER_BUSY_SECONDS, names.VERIFIER_STEPS, names.VERIFIER_TOKENS_VERIFIED)
VERIFIER_GAUGES = (names.REQUESTS_RUNNING, names.REQUESTS_WAITING)
PODS = "pods"  # Rates.drafters[pool][PODS]: how many of its pods the rates cover
DRAFTER_COUNTERS = (names.DRAFTER_ROUNDS, names.DRAFTER_BATCHED_REQUESTS, names.DRAFTER_BUSY_SECONDS,
                    names.DRAFTER_DRAFT_TOKENS)


@dataclass(frozen=True)
class Scrape:
    """Every pod's sample at ``time_s``; keys are pod names."""

    time_s: float
    verifiers: Mapping[str, Sample]
    drafters: Mapping[str, Mapping[str, Sample]]  # pool -> pod -> sample
    # the targets that could not be read, each with why (an HTTP status, a timeout, a refused
    # connection): counted and logged by the caller, left out of the samples
    failures: tuple[tuple[ScrapeTarget, str], ...] = ()


@dataclass(frozen=True)
class ScrapeTarget:
    """One pod to scrape: its role (``verifier``/``drafter``), pool, and metrics URL."""

    pod: str
    role: str
    pool: str | None
    url: str


@dataclass(frozen=True)
class Rates:
    """Counters as per-second rates and gauges as values, over an interval.

    ``verifier``: verifier series summed over its pods (``None``: no verifier pod measured);
    ``pools``: pool -> ``(name, reason)`` -> rate or gauge (gauges averaged over verifier pods);
    ``drafters``: pool -> drafter series rate summed over its pods measured (absent: none)."""

    verifier: Mapping[str, float] | None
    pools: Mapping[str, Mapping[tuple[str, str], float]] = field(default_factory=dict)
    drafters: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


def parse(text: str) -> dict[tuple[str, str, str], float]:
    """A pod's ``/metrics`` body → its samples (:data:`Sample`); counters keep their ``_total``."""
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("pool", ""), sample.labels.get("reason", ""))
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def value(sample: Sample, name: str, pool: str | None = "", reason: str | None = "") -> float:
    """The value of sample ``name`` (a counter's ends in ``_total``) for ``pool`` and ``reason``;
    ``None`` sums over every pool or reason. Absent: 0."""
    return sum(v for (n, p, r), v in sample.items()
               if n == name and (pool is None or p == pool) and (reason is None or r == reason))


def _delta(now: float, before: float | None) -> float:
    """Counter increase; a counter that went down was reset (pod restart), so count from 0."""
    if before is None or now < before:
        return now
    return now - before


def rates(prev: Scrape, cur: Scrape) -> Rates:
    """Per-second rates between two scrapes. Only pods present in both count (a new pod's
    counters cover an unknown span)."""
    dt_s = cur.time_s - prev.time_s
    both = [pod for pod in cur.verifiers if pod in prev.verifiers]
    if not both or dt_s <= 0:
        return Rates(None)
    verifier: dict[str, float] = {}
    pools: dict[str, dict[tuple[str, str], float]] = {}
    gauges_seen: dict[tuple[str, str, str], int] = {}
    for pod in both:
        a, b = prev.verifiers[pod], cur.verifiers[pod]
        for (n, pool, reason), v in b.items():
            base = n.removesuffix("_total")
            if not pool and base in VERIFIER_COUNTERS and n == total(base):
                verifier[base] = verifier.get(base, 0.0) + _delta(v, a.get((n, pool, reason))) / dt_s
            elif not pool and n in VERIFIER_GAUGES:
                verifier[n] = verifier.get(n, 0.0) + v
            elif pool and base in POOL_COUNTERS and n == total(base):
                by = pools.setdefault(pool, {})
                by[(base, reason)] = by.get((base, reason), 0.0) + _delta(v, a.get((n, pool, reason))) / dt_s
            elif pool and n in POOL_GAUGES:
                by = pools.setdefault(pool, {})
                seen = gauges_seen[(n, pool, reason)] = gauges_seen.get((n, pool, reason), 0) + 1
                by[(n, reason)] = by.get((n, reason), 0.0) + (v - by.get((n, reason), 0.0)) / seen
    drafters: dict[str, dict[str, float]] = {}
    for pool, pods in cur.drafters.items():
        before = prev.drafters.get(pool, {})
        for pod, b in pods.items():
            if pod not in before:
                continue
            by = drafters.setdefault(pool, {})
            by[PODS] = by.get(PODS, 0.0) + 1
            for n in DRAFTER_COUNTERS:
                by[n] = by.get(n, 0.0) + _delta(value(b, total(n), None), value(before[pod], total(n), None)) / dt_s
    return Rates(verifier, pools, drafters)


def observations(r: Rates, pool_replicas: Mapping[str, tuple[int, int]]) -> Observations:
    """Rates → the rule's observations; ``pool_replicas``: pool → (replicas, ready replicas)."""
    verifier: VerifierObservation | None = None
    if r.verifier is not None:
        steps, busy = r.verifier.get(names.VERIFIER_STEPS, 0.0), r.verifier.get(names.VERIFIER_BUSY_SECONDS, 0.0)
        verifier = VerifierObservation(
            step_s=busy / steps if steps > 0 else None,
            tokens_verified_per_s=r.verifier.get(names.VERIFIER_TOKENS_VERIFIED, 0.0),
            requests_running=r.verifier.get(names.REQUESTS_RUNNING, 0.0),
            requests_waiting=r.verifier.get(names.REQUESTS_WAITING, 0.0),
        )
    pools: list[PoolObservation] = []
    for pool, (replicas, ready) in pool_replicas.items():
        v = r.pools.get(pool, {})
        d = r.drafters.get(pool)
        rounds = d.get(names.DRAFTER_ROUNDS, 0.0) if d else 0.0
        drafted = v.get((names.DRAFT_TOKENS, ""), 0.0)
        pools.append(PoolObservation(
            name=pool,
            replicas=replicas,
            ready_replicas=ready,
            asks_per_s=v.get((names.POOL_CALLS, ""), 0.0) + v.get((names.POOL_ERRORS, ""), 0.0),
            late_per_s=v.get((names.DRAFTS_LATE, ""), 0.0),
            probes_per_s=v.get((names.POOL_PROBE_ASKS, ""), 0.0),
            gain_tokens_per_s=v.get((names.POOL_GAIN_TOKENS, "")),
            skipped_per_s={reason: v.get((names.POOL_ASKS_SKIPPED, reason), 0.0) for reason in SKIP_REASONS},
            accepted_tokens_per_s=v.get((names.ACCEPTED_TOKENS, ""), 0.0),
            acceptance_rate=v.get((names.ACCEPTED_TOKENS, ""), 0.0) / drafted if drafted > 0 else None,
            draft_tokens_per_s=d.get(names.DRAFTER_DRAFT_TOKENS, 0.0) if d else 0.0,
            round_s=d[names.DRAFTER_BUSY_SECONDS] / rounds if d and rounds > 0 else None,
            batch=d[names.DRAFTER_BATCHED_REQUESTS] / rounds if d and rounds > 0 else None,
            rtt_s=v.get((names.POOL_RTT_SECONDS, "")),
            yield_tokens=v.get((names.POOL_YIELD_TOKENS, "")),
            utilization=min(1.0, d.get(names.DRAFTER_BUSY_SECONDS, 0.0) / d[PODS]) if d and d.get(PODS) else None,
            drafter_samples=d is not None,
        ))
    return Observations(verifier=verifier, pools=tuple(pools))


def observe(prev: Scrape, cur: Scrape, pool_replicas: Mapping[str, tuple[int, int]]) -> Observations:
    """Two scrapes → observations (:func:`rates`, then :func:`observations`)."""
    return observations(rates(prev, cur), pool_replicas)


async def _fetch(session: aiohttp.ClientSession, target: ScrapeTarget) -> tuple[ScrapeTarget, str | None, str]:
    """``(target, text, "")`` or, when unreadable, ``(target, None, why)``."""
    try:
        async with session.get(target.url) as response:
            if response.status != 200:
                return target, None, f"HTTP {response.status}"
            return target, await response.text(), ""
    except TimeoutError:
        return target, None, "timed out"
    except (aiohttp.ClientError, OSError) as e:
        return target, None, f"{type(e).__name__}: {e}"


async def scrape_pods(targets: Iterable[ScrapeTarget], timeout_s: float, time_s: float) -> Scrape:
    """GET every target's ``/metrics`` concurrently; unreadable pods are left out of the samples
    and listed in ``failures`` with the reason."""
    verifiers: dict[str, Sample] = {}
    drafters: dict[str, dict[str, Sample]] = {}
    failures: list[tuple[ScrapeTarget, str]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        results = await asyncio.gather(*(_fetch(session, t) for t in targets))
    for target, text, why in results:
        if text is None:
            failures.append((target, why))
            continue
        if target.role == "verifier":
            verifiers[target.pod] = parse(text)
        elif target.pool is not None:
            drafters.setdefault(target.pool, {})[target.pod] = parse(text)
    return Scrape(time_s=time_s, verifiers=verifiers, drafters=drafters, failures=tuple(failures))




async def _query(session: aiohttp.ClientSession, url: str, query: str) -> list[dict[str, object]]:
    async with session.get(url, params={"query": query}) as response:
        response.raise_for_status()
        payload = await response.json()
    return list(payload.get("data", {}).get("result", []))


def _vector(results: list[dict[str, object]]) -> dict[tuple[str, str], float]:
    """An instant vector's samples by ``(pool, reason)`` labels."""
    out: dict[tuple[str, str], float] = {}
    for item in results:
        metric = dict(item.get("metric") or {})  # type: ignore[call-overload]
        sample = item.get("value") or [0, "0"]
        out[(str(metric.get("pool", "")), str(metric.get("reason", "")))] = float(sample[1])  # type: ignore[index]
    return out


async def scrape_prometheus(prometheus_url: str, namespace: str, cluster: str, window_s: float,
                            timeout_s: float) -> Rates:
    """The rates, computed by Prometheus: ``rate(<counter>[window_s])`` summed by pool (and
    reason), gauges summed (verifier) or averaged (per pool) over the pods, one query per series.

    Assumes the usual ``namespace`` and ``pod`` target labels (kube-prometheus, the chart's
    PodMonitor relabelling). A verifier series with no result means no verifier was measured
    (``Rates.verifier`` is ``None``). Raises aiohttp.ClientError (HTTP errors included) or
    TimeoutError when Prometheus cannot answer.
    """
    url = prometheus_url.rstrip("/") + "/api/v1/query"
    verifier_pods = f'namespace="{namespace}",pod=~"{cluster}-verifier-.*"'
    drafter_pods = f'namespace="{namespace}",pod=~"{cluster}-drafter-.*"'
    window = f"{max(1, round(window_s))}s"
    queries: dict[tuple[str, str], str] = {}
    for n in VERIFIER_COUNTERS:
        queries[("verifier", n)] = f"sum(rate({total(n)}{{{verifier_pods}}}[{window}]))"
    for n in VERIFIER_GAUGES:
        queries[("verifier", n)] = f"sum({n}{{{verifier_pods}}})"
    for n in POOL_COUNTERS:
        queries[("pool", n)] = f"sum by (pool, reason) (rate({total(n)}{{{verifier_pods}}}[{window}]))"
    for n in POOL_GAUGES:
        queries[("pool", n)] = f"avg by (pool) ({n}{{{verifier_pods}}})"
    for n in DRAFTER_COUNTERS:
        queries[("drafter", n)] = f"sum by (pool) (rate({total(n)}{{{drafter_pods}}}[{window}]))"
    queries[("drafter", PODS)] = f"count by (pool) ({total(names.DRAFTER_ROUNDS)}{{{drafter_pods}}})"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        answers = await asyncio.gather(*(_query(session, url, q) for q in queries.values()))
    verifier: dict[str, float] = {}
    pools: dict[str, dict[tuple[str, str], float]] = {}
    drafters: dict[str, dict[str, float]] = {}
    for (role, n), results in zip(queries, answers, strict=True):
        for (pool, reason), v in _vector(results).items():
            if role == "verifier":
                verifier[n] = v
            elif role == "pool" and pool:
                pools.setdefault(pool, {})[(n, reason)] = v
            elif role == "drafter" and pool:
                drafters.setdefault(pool, {})[n] = v
    return Rates(verifier if names.VERIFIER_STEPS in verifier else None, pools, drafters)
