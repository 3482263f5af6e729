"""Gather the autoscaler's observations: scrape the pods' ``/metrics`` (or ask Prometheus).

Three layers: ``parse_*`` (Prometheus text → per-pod samples, pure), :func:`observe` (two scrapes
``dt`` seconds apart → :class:`~cosine_operator.autoscaling.Observations`, pure), and the async
fetchers :func:`scrape_pods` / :func:`scrape_prometheus` (HTTP only).

Metric names are the runtime's (vLLM-style ``cosine:`` prefix). Verifier:
``cosine:verifier_busy_seconds_total``, ``cosine:verifier_idle_seconds_total``,
``cosine:num_requests_running``, ``cosine:num_requests_waiting``,
``cosine:spec_decode_num_draft_tokens_total{pool}``, ``cosine:spec_decode_num_accepted_tokens_total{pool}``,
``cosine:verifier_tokens_verified_total``. Drafter: ``cosine:drafter_draft_tokens_total``,
``cosine:drafter_busy_seconds_total``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from cosine_operator import metric_names as names
from cosine_operator.autoscaling import Observations, PoolObservation, VerifierObservation
from cosine_operator.metric_names import total


@dataclass(frozen=True)
class VerifierSample:
    """Counter and gauge values of one verifier pod at one instant."""

    busy_s: float = 0.0
    idle_s: float = 0.0
    requests_running: float = 0.0
    requests_waiting: float = 0.0
    tokens_verified: float = 0.0
    draft_tokens: Mapping[str, float] = field(default_factory=dict)  # by pool
    accepted_tokens: Mapping[str, float] = field(default_factory=dict)  # by pool


@dataclass(frozen=True)
class DrafterSample:
    """Counter values of one drafter pod at one instant."""

    draft_tokens: float = 0.0
    busy_s: float = 0.0


@dataclass(frozen=True)
class Scrape:
    """Every pod's sample at ``time_s``; keys are pod names."""

    time_s: float
    verifiers: Mapping[str, VerifierSample]
    drafters: Mapping[str, Mapping[str, DrafterSample]]  # pool -> pod -> sample
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


def _samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, dict(sample.labels), float(sample.value)


def parse_verifier(text: str) -> VerifierSample:
    """A verifier pod's ``/metrics`` body → :class:`VerifierSample` (absent metrics are 0)."""
    scalars: dict[str, float] = {}
    draft: dict[str, float] = {}
    accepted: dict[str, float] = {}
    for name, labels, value in _samples(text):
        if name == total(names.DRAFT_TOKENS):
            pool = labels.get("pool", "")
            draft[pool] = draft.get(pool, 0.0) + value
        elif name == total(names.ACCEPTED_TOKENS):
            pool = labels.get("pool", "")
            accepted[pool] = accepted.get(pool, 0.0) + value
        else:
            scalars[name] = scalars.get(name, 0.0) + value
    return VerifierSample(
        busy_s=scalars.get(total(names.VERIFIER_BUSY_SECONDS), 0.0),
        idle_s=scalars.get(total(names.VERIFIER_IDLE_SECONDS), 0.0),
        requests_running=scalars.get(names.REQUESTS_RUNNING, 0.0),
        requests_waiting=scalars.get(names.REQUESTS_WAITING, 0.0),
        tokens_verified=scalars.get(total(names.VERIFIER_TOKENS_VERIFIED), 0.0),
        draft_tokens=draft,
        accepted_tokens=accepted,
    )


def parse_drafter(text: str) -> DrafterSample:
    """A drafter pod's ``/metrics`` body → :class:`DrafterSample`."""
    values: dict[str, float] = {}
    for name, _, value in _samples(text):
        values[name] = values.get(name, 0.0) + value
    return DrafterSample(
        draft_tokens=values.get(total(names.DRAFTER_DRAFT_TOKENS), 0.0),
        busy_s=values.get(total(names.DRAFTER_BUSY_SECONDS), 0.0),
    )


def _delta(now: float, before: float | None) -> float:
    """Counter increase; a counter that went down was reset (pod restart), so count from 0."""
    if before is None or now < before:
        return now
    return now - before


def observe(prev: Scrape, cur: Scrape, pool_replicas: Mapping[str, tuple[int, int]]) -> Observations:
    """Rates between two scrapes → observations; ``pool_replicas``: pool → (replicas, ready).

    Only pods present in both scrapes count (a new pod's counters cover an unknown span).
    """
    dt_s = cur.time_s - prev.time_s
    verifier: VerifierObservation | None = None
    both = [pod for pod in cur.verifiers if pod in prev.verifiers]
    draft_by_pool: dict[str, float] = {}
    accepted_by_pool: dict[str, float] = {}
    if both and dt_s > 0:
        busy = idle = verified = running = waiting = 0.0
        for pod in both:
            a, b = prev.verifiers[pod], cur.verifiers[pod]
            busy += _delta(b.busy_s, a.busy_s)
            idle += _delta(b.idle_s, a.idle_s)
            verified += _delta(b.tokens_verified, a.tokens_verified)
            running += b.requests_running
            waiting += b.requests_waiting
            for pool, value in b.draft_tokens.items():
                draft_by_pool[pool] = draft_by_pool.get(pool, 0.0) + _delta(value, a.draft_tokens.get(pool))
            for pool, value in b.accepted_tokens.items():
                accepted_by_pool[pool] = accepted_by_pool.get(pool, 0.0) + _delta(
                    value, a.accepted_tokens.get(pool)
                )
        utilization = busy / (busy + idle) if busy + idle > 0 else 0.0
        verifier = VerifierObservation(
            utilization=min(max(utilization, 0.0), 1.0),
            tokens_verified_per_s=verified / dt_s,
            requests_running=running,
            requests_waiting=waiting,
        )
    total_drafted = sum(draft_by_pool.values())
    pools: list[PoolObservation] = []
    for pool, (replicas, ready) in pool_replicas.items():
        drafted_per_s = busy_s = 0.0
        measured = 0
        cur_pods = cur.drafters.get(pool, {})
        prev_pods = prev.drafters.get(pool, {})
        for pod, sample in cur_pods.items():
            if pod in prev_pods and dt_s > 0:
                drafted_per_s += _delta(sample.draft_tokens, prev_pods[pod].draft_tokens) / dt_s
                busy_s += _delta(sample.busy_s, prev_pods[pod].busy_s)
                measured += 1
        drafted = draft_by_pool.get(pool, 0.0)
        pools.append(
            PoolObservation(
                name=pool,
                replicas=replicas,
                ready_replicas=ready,
                draft_tokens_per_s=drafted_per_s,
                acceptance_rate=accepted_by_pool.get(pool, 0.0) / drafted if drafted > 0 else None,
                share=drafted / total_drafted if total_drafted > 0 else None,
                utilization=min(1.0, busy_s / (measured * dt_s)) if measured else None,
            )
        )
    return Observations(verifier=verifier, pools=tuple(pools))


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
    verifiers: dict[str, VerifierSample] = {}
    drafters: dict[str, dict[str, DrafterSample]] = {}
    failures: list[tuple[ScrapeTarget, str]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        results = await asyncio.gather(*(_fetch(session, t) for t in targets))
    for target, text, why in results:
        if text is None:
            failures.append((target, why))
            continue
        if target.role == "verifier":
            verifiers[target.pod] = parse_verifier(text)
        elif target.pool is not None:
            drafters.setdefault(target.pool, {})[target.pod] = parse_drafter(text)
    return Scrape(time_s=time_s, verifiers=verifiers, drafters=drafters, failures=tuple(failures))


_POD_SUFFIX = re.compile(r"-[a-z0-9]+-[a-z0-9]+$")  # Deployment pods: <deployment>-<rs hash>-<id>


def _exposition(results: list[dict[str, object]]) -> dict[str, str]:
    """Prometheus instant-vector results → per-pod Prometheus text (to reuse the parsers)."""
    lines: dict[str, list[str]] = {}
    for item in results:
        metric = dict(item.get("metric") or {})  # type: ignore[call-overload]
        name = str(metric.pop("__name__", ""))
        pod = str(metric.get("pod", ""))
        value = item.get("value") or [0, "0"]
        labels = ",".join(f'{k}="{v}"' for k, v in metric.items() if k == "pool")
        sample = f"{name}{{{labels}}}" if labels else name
        lines.setdefault(pod, []).append(f"{sample} {value[1]}")  # type: ignore[index]
    return {pod: "\n".join(body) + "\n" for pod, body in lines.items()}


async def scrape_prometheus(
    prometheus_url: str, namespace: str, cluster: str, pools: Iterable[str], timeout_s: float, time_s: float
) -> Scrape:
    """The same samples, read from Prometheus (``/api/v1/query``) instead of the pods.

    Assumes the usual ``namespace`` and ``pod`` target labels (kube-prometheus, the chart's
    ServiceMonitor/PodMonitor relabelling).
    """
    query = f'{{__name__=~"cosine:.*",namespace="{namespace}",pod=~"{cluster}-(verifier|drafter)-.*"}}'
    url = prometheus_url.rstrip("/") + "/api/v1/query"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(url, params={"query": query}) as response:
            response.raise_for_status()
            payload = await response.json()
    by_pod = _exposition(list(payload.get("data", {}).get("result", [])))
    verifiers: dict[str, VerifierSample] = {}
    drafters: dict[str, dict[str, DrafterSample]] = {}
    pool_names = sorted(pools, key=len, reverse=True)  # longest first: "code" vs "code-large"
    for pod, text in by_pod.items():
        deployment = _POD_SUFFIX.sub("", pod)
        if deployment == f"{cluster}-verifier":
            verifiers[pod] = parse_verifier(text)
            continue
        for pool in pool_names:
            if deployment == f"{cluster}-drafter-{pool}":
                drafters.setdefault(pool, {})[pod] = parse_drafter(text)
                break
    return Scrape(time_s=time_s, verifiers=verifiers, drafters=drafters)
