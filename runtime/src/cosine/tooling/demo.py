"""`cosine demo` (what `make run` runs): start the embedded cluster, send it real workload prompts
through the official OpenAI client, print a short report, then keep serving (or exit).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from cosine_spec import metric_names as m
from cosine_spec.metric_names import total

from cosine.manifest import Manifest
from cosine.placement import Choice
from cosine.processes import free_port, start_cluster, stop_cluster, wait_ready
from cosine.tooling.workloads import Prompt


@dataclass(frozen=True)
class Answer:
    """One answered prompt: its text, completion tokens, time to first content chunk and wall time (seconds)."""

    prompt: Prompt
    text: str
    completion_tokens: int
    ttft_s: float
    wall_s: float


def ask(client, model: str, prompt: Prompt, max_tokens: int) -> Answer:
    """One streamed, greedy chat completion; TTFT is the arrival of the first content chunk."""
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    tokens = 0
    stream = client.chat.completions.create(
        model=model, messages=prompt.messages(), temperature=0, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(choice.delta.content)
    wall = time.perf_counter() - t0
    return Answer(prompt, "".join(parts), tokens, ttft if ttft is not None else wall, wall)


def spec_decode_counters(metrics_url: str, prefix: str = m.PREFIX + "spec_decode_") -> dict[str, float]:
    """Counters named `prefix*_total` from a Prometheus endpoint, summed over labels."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=5).text):
        for s in family.samples:
            if s.name.startswith(prefix) and s.name.endswith("_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def per_pool_counters(metrics_url: str) -> dict[str, dict[str, float]]:
    """`cosine_` per-pool counters by pool label ("lookup" = in-process prompt lookup):
    drafts, draft_tokens, accepted, late (each `cosine_spec_decode_*_total`)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = {total(m.DRAFTS): "drafts", total(m.DRAFT_TOKENS): "draft_tokens",
             total(m.ACCEPTED_TOKENS): "accepted", total(m.DRAFTS_LATE): "late"}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=5).text):
        for s in family.samples:
            if s.name in names and "pool" in s.labels:
                row = out.setdefault(s.labels["pool"], dict.fromkeys(names.values(), 0.0))
                row[names[s.name]] += s.value
    return out


def log_file() -> Path:
    """Where `cosine demo` writes the embedded cluster's logs (vLLM's, the drafters'): a new file
    per run under the cache, `logs/serve-<time>.log`."""
    from cosine.model_store import cache_root

    return cache_root() / "logs" / f"serve-{time.strftime('%Y%m%d-%H%M%S')}.log"


def run_demo(manifest: Manifest, prompts: list[Prompt], max_tokens: int, port: int, keep_serving: bool,
             placement: Choice | None = None) -> int:
    """Start `cosine serve` on `port` (0: a free one) with `placement` (its mode and why, printed;
    default: `split`), its logs to a file (:func:`log_file`), with
    a spinner while models load; ask it each prompt (greedy, at most `max_tokens` tokens), print
    per-prompt and per-source results and the serving URL, then keep serving until Ctrl-C unless
    `keep_serving` is False; the cluster is stopped on return. Returns 0.

    Raises:
        ValueError: an invalid manifest.
        RuntimeError: the cluster exited or was not ready in time.
    """
    from openai import OpenAI
    from rich.console import Console

    spec = manifest.spec
    model = spec.verifier.model
    port = port or free_port()
    base = f"http://127.0.0.1:{port}"
    logs = log_file()
    placement = placement or Choice("split", "asked for")
    pools = [p.name for p in spec.drafter_pools] if placement.mode != "lookup" else "off"
    print(f"embedded cluster: verifier {model}, drafter pools {pools}; logs in {logs}", flush=True)
    print(f"placement {placement.mode}: {placement.reason}", flush=True)
    metrics_port = free_port()
    proc = start_cluster(manifest, port, metrics_port=metrics_port, log_path=logs, placement=placement.mode)
    try:
        t0 = time.monotonic()
        with Console(stderr=True).status("loading the models and starting the servers ..."):
            try:
                wait_ready(base, proc)
            except RuntimeError as e:
                raise RuntimeError(f"{e}; see {logs}") from None
        print(f"ready on {base} after {time.monotonic() - t0:.0f} s", flush=True)
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
        print(f"{'id':>14}  {'domain':>6}  {'tokens':>6}  {'TTFT s':>6}  {'tok/s':>6}  answer")
        answers = []
        for p in prompts:
            a = ask(client, model, p, max_tokens)
            answers.append(a)
            rate = a.completion_tokens / max(1e-9, a.wall_s - a.ttft_s) if a.completion_tokens > 1 else 0.0
            snippet = " ".join(a.text.split())[:60]
            print(f"{p.id:>14}  {p.domain:>6}  {a.completion_tokens:>6}  {a.ttft_s:6.2f}  {rate:6.2f}  {snippet}",
                  flush=True)
        c = spec_decode_counters(f"http://127.0.0.1:{metrics_port}/metrics")
        drafts = c.get(total(m.DRAFTS), 0.0)
        drafted = c.get(total(m.DRAFT_TOKENS), 0.0)
        accepted = c.get(total(m.ACCEPTED_TOKENS), 0.0)
        late = c.get(total(m.DRAFTS_LATE), 0.0)
        total_tokens = sum(a.completion_tokens for a in answers)
        total_s = sum(a.wall_s for a in answers)
        print(f"\n{len(answers)} requests, {total_tokens} tokens in {total_s:.1f} s "
              f"({total_tokens / max(total_s, 1e-9):.2f} tok/s), TTFT p50 "
              f"{statistics.median(a.ttft_s for a in answers):.2f} s")
        if drafts:
            print(f"acceptance rate {accepted / max(drafted, 1):.2f}, mean acceptance length "
                  f"{1 + accepted / drafts:.2f} ({int(drafted)} draft tokens; {int(late)} pool drafts late)")
        for pool, row in sorted(per_pool_counters(f"http://127.0.0.1:{metrics_port}/metrics").items()):
            if row["drafts"]:
                print(f"  {pool:>8}: acceptance length {1 + row['accepted'] / row['drafts']:.2f} over "
                      f"{int(row['drafts'])} drafts ({int(row['accepted'])}/{int(row['draft_tokens'])} draft tokens "
                      f"accepted, {int(row['late'])} late)")
        print(f"\nServing on {base}/v1 — try:\n  curl -s {base}/v1/chat/completions -H 'content-type: "
              f"application/json' -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": "
              f"\"Write a Python function that reverses a string.\"}}], \"temperature\": 0}}'")
        if keep_serving:
            print("Ctrl-C stops the cluster.", flush=True)
            try:
                proc.wait()
            except KeyboardInterrupt:
                pass
        return 0
    finally:
        stop_cluster(proc)
