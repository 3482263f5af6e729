"""The embedded multi-process cluster, as a user runs it: `cosine serve --cluster FILE`.

Real processes on loopback: vLLM's OpenAI server as the verifier with CoSine's proposer under its
engine, a pool of two drafter replicas, a process each, talking gRPC (llama.cpp on the model's
GGUF file), a real small model (SmolLM2-135M-Instruct as both target and drafter, so it runs in
seconds), the official `openai` client. The reference is vLLM serving the same target alone
(`maxDraftLen: 0`), in float32: greedy outputs must be identical. Faults: a drafter replica
killed mid-stream costs speed, never a request (its requests move to the other replica), and is
restarted and rejoins; 50 requests at
concurrency 8 all complete exactly once; SIGTERM (a rollout) drains: requests in flight finish, a
new one is refused, and every process exits. The API contract users rely on (API key, 4xx naming the
field, 404 for an unknown model, streaming usage) is vLLM's server's.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import yaml

from cosine.embedded import serving
from cosine.model_store import pull
from cosine.processes import free_port
from tests.runtime.test_processes import assert_all_gone, descendants

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
PROMPTS = ["Name three colors.", "What is 7 times 6?", "Write a haiku about the sea.", "List two fruits."]
API_KEY = "test-key"
OPEN_ROUTES = {"/health", "/ping", "/load", "/version"}  # and /metrics (a mount: not in the OpenAPI list)
# the drain test's: each of the 8 is still mid-stream when SIGTERM lands after every first token
DRAIN_PROMPTS = [f"Write a long story about a {thing}." for thing in
                 ("lighthouse", "fox", "baker", "comet", "violin", "glacier", "market", "robot")]
DRAIN_TOKENS = 128


def _manifest(tmp_path_factory, max_draft_len: int, speculator: dict | None = None) -> str:
    manifest = {
        "apiVersion": "cosine.dev/v1alpha1",
        "kind": "CoSineCluster",
        "metadata": {"name": "test"},
        "spec": {
            # the drain test reads the grace period back from vLLM's --shutdown-timeout
            "verifier": {"model": MODEL, "threads": 1, "terminationGracePeriodSeconds": 60},
            # priced: the dashboards' accepted tokens per pool dollar (test_a_real_prometheus...)
            "drafterPools": [{"name": "small", "model": MODEL, "replicas": 2, "threads": 1, "pricePerHourUsd": 0.5}],
            # the same model drafts: always speculate, so every path is exercised
            "speculation": {"maxDraftLen": max_draft_len, "adaptive": False},
            "autoscaling": {"enabled": False},  # two replicas throughout (the autoscaler has its own test)
        },
    }
    if speculator:
        manifest["spec"]["verifier"]["speculator"] = speculator
    path = tmp_path_factory.mktemp("cluster") / "cluster.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return str(path)


def _start(cmd: list[str], base: str, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, start_new_session=True)
    deadline = time.monotonic() + 400
    while True:
        assert proc.poll() is None, f"{cmd[3:5]} exited during start-up"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server not healthy after 400 s"
        time.sleep(1)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:  # SIGKILLed by a test: its children are gone with it (test_processes)
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="class")
def cluster(tmp_path_factory):
    pull(MODEL, progress=False)
    path = _manifest(tmp_path_factory, 4)
    port, metrics_port, pools_port = free_port(), free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start([sys.executable, "-m", "cosine", "serve", "--cluster", path, "--port", str(port),
                   "--metrics-port", str(metrics_port), "--pools-metrics-port", str(pools_port),
                   "--placement", "split"], base, {"COSINE_API_KEY": API_KEY})
    yield base, proc, f"http://127.0.0.1:{metrics_port}/metrics", f"http://127.0.0.1:{pools_port}/metrics"
    _stop(proc)


@pytest.fixture(scope="class")
def long_reference(cluster):
    """DRAIN_PROMPTS' greedy answers (DRAIN_TOKENS tokens each, 8 at once) on the cluster undisturbed:
    what each must still be after a replica or the server is stopped under it."""
    client = _client(cluster[0])
    with cf.ThreadPoolExecutor(len(DRAIN_PROMPTS)) as pool:
        out = dict(zip(DRAIN_PROMPTS, pool.map(lambda p: _stream_long(client, p), DRAIN_PROMPTS), strict=True))
    assert all(out.values())
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """vLLM target-only greedy outputs (the same server without a speculative path)."""
    pull(MODEL, progress=False)
    path = _manifest(tmp_path_factory, 0)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start([sys.executable, "-m", "cosine", "verifier", "--cluster", path, "--http-port", str(port),
                   "--metrics-port", "0"], base, {})
    try:
        client = _client(base, "none")
        outputs = {p: _chat(client, p) for p in PROMPTS}
    finally:
        _stop(proc)  # not kept running: its cores go to the clusters under test
    return outputs


def _drafter_pids(serve_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(serve_pid), "-f", "cosine drafter"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _client(base: str, api_key: str = API_KEY):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=120)


def _chat(client, prompt: str, stream: bool = False) -> str:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=24)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)


def _stream_long(client, prompt: str, started: threading.Barrier | None = None) -> str:
    """A streamed greedy answer of DRAIN_TOKENS tokens; `started` is waited on at its first text."""
    text = []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=DRAIN_TOKENS,
            stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            if started is not None and not text:
                started.wait(timeout=120)
            text.append(chunk.choices[0].delta.content)
    return "".join(text)


def _counter(metrics_url: str, name: str, pool: str) -> float:
    """A `cosine_` counter of one draft source (prompt lookup is pool="lookup")."""
    for line in httpx.get(metrics_url).text.splitlines():
        if line.startswith(name + "{") and f'pool="{pool}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _pool_asked(metrics_url: str, pool: str = "small") -> float:
    """Draft calls the proposer made to a pool that were in flight or verified."""
    return (_counter(metrics_url, "cosine_spec_decode_drafts_late_total", pool)
            + _counter(metrics_url, "cosine_spec_decode_num_drafts_total", pool))


class TestFixedCluster:
    """One cluster of two replicas (no autoscaling) for the tests below; the last one drains it
    with SIGTERM, before the other tests start their own (the cores are few)."""

    def test_openai_client_gets_target_identical_output(self, cluster, reference):
        base, _, metrics_url, _ = cluster
        client = _client(base)
        for p in PROMPTS:
            assert _chat(client, p) == reference[p]
            assert _chat(client, p, stream=True) == reference[p]
        # the pool's drafts (llama.cpp on the same model's GGUF, its own core) reached vLLM and were
        # accepted: the output above is still the target's own
        assert _counter(metrics_url, "cosine_spec_decode_num_accepted_tokens_total", "small") > 0
        assert _pool_asked(metrics_url) > 0
        vllm_metrics = httpx.get(f"{base}/metrics").text
        assert "vllm:spec_decode_num_accepted_tokens_total" in vllm_metrics
        # the suffix-affinity gauges on the http port, where a router's endpoint picker scrapes
        # vLLM's series (written by the engine core, served by vLLM's server), and on CoSine's
        for text in (vllm_metrics, httpx.get(metrics_url).text):
            rates = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("cosine_suffix_tree_hit_rate{")]
            assert rates and 0 < rates[0] <= 1, text[-2000:]
            tokens = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("cosine_suffix_tree_tokens{")]
            assert tokens and tokens[0] > 0

    def test_api_contract(self, cluster):
        base, _, _, _ = cluster
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(f"{base}/v1/chat/completions", json=body).status_code == 401  # API key required
        auth = {"Authorization": f"Bearer {API_KEY}"}
        bad = httpx.post(f"{base}/v1/chat/completions", json={**body, "temperature": -1}, headers=auth)
        assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
        unknown = httpx.post(f"{base}/v1/chat/completions", json={**body, "model": "nope"}, headers=auth)
        assert unknown.status_code == 404
        stream = _client(base).chat.completions.create(
            model=MODEL, messages=body["messages"], max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True})
        usage = [c.usage for c in stream if c.usage is not None]
        assert usage and usage[-1].completion_tokens == 4

    def test_every_route_but_the_probes_needs_the_key(self, cluster):
        """`spec.gateway.apiKeySecretRef` on the verifier `cosine serve` starts as the operator
        starts it (`cosine verifier`, the key in `COSINE_API_KEY`): every route vLLM registered
        (its own OpenAPI list) refuses a request without the key, `/invocations` (SageMaker's,
        which runs chat and completions) among them; the probes' routes and `/metrics` stay open;
        with the key, completions are served on `/v1` and `/invocations` alike. Catches: vLLM's
        key check, which covers only /v1, /v2, /inference and /cohere, left as the only one:
        `/invocations` answered a chat request without the key (200)."""
        base, auth = cluster[0], {"Authorization": f"Bearer {API_KEY}"}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
        completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
        for body, path in ((chat, "/invocations"), (completion, "/invocations"), (chat, "/v1/chat/completions"),
                           (completion, "/v1/completions")):
            assert httpx.post(f"{base}{path}", json=body, timeout=120).status_code == 401, path
            served = httpx.post(f"{base}{path}", json=body, headers=auth, timeout=120)
            assert served.status_code == 200, (path, served.text)
        routes = httpx.get(f"{base}/openapi.json", headers=auth, timeout=30).json()["paths"]
        assert "/invocations" in routes and "/v1/chat/completions" in routes and "/tokenize" in routes
        refused, let_through = 0, []
        with httpx.Client(base_url=base, timeout=30) as http:
            for path, methods in routes.items():
                url = path.replace("{", "").replace("}", "")  # a path parameter, e.g. {response_id}
                for method in methods:
                    for headers in ({}, {"Authorization": "Bearer wrong"}):
                        status = http.request(method.upper(), url, json=chat, headers=headers).status_code
                        if path in OPEN_ROUTES or path.startswith("/metrics"):
                            assert status != 401, (method, path)
                        elif status == 401:
                            refused += 1
                        else:
                            let_through.append((method, path, headers, status))
        assert not let_through, let_through
        assert refused > 20
        for path in (*OPEN_ROUTES, "/metrics"):  # the probes, the scrapers (Prometheus, the endpoint picker)
            assert httpx.get(f"{base}{path}", timeout=30).status_code == 200, path

    def test_killed_drafter_costs_speed_not_requests(self, cluster, reference):
        base, proc, metrics_url, _ = cluster
        client = _client(base)
        pids = _drafter_pids(proc.pid)
        assert len(pids) == 2, "one drafter process per replica, visible as `cosine drafter` in ps"
        with cf.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_chat, client, p, True) for p in PROMPTS]
            time.sleep(1.0)
            os.kill(pids[0], signal.SIGKILL)  # a replica dies while requests are in flight
            results = [f.result(timeout=240) for f in futures]
        assert results == [reference[p] for p in PROMPTS]
        deadline = time.monotonic() + 120  # the supervisor restarts it
        while len(new := _drafter_pids(proc.pid)) < 2 or pids[0] in new:
            assert time.monotonic() < deadline, "drafter was not restarted"
            time.sleep(1)
        time.sleep(8)  # model load + the proposer's down window for a failed pool
        before = _counter(metrics_url, "cosine_drafter_calls_total", "small")
        for p in PROMPTS:
            assert _chat(client, p) == reference[p]
        assert _counter(metrics_url, "cosine_drafter_calls_total", "small") > before, (
            "the restarted drafter answers draft calls again")

    def test_a_finished_request_holds_nothing_on_the_replicas(self, cluster):
        """An idle verifier holds no request on any replica: a request is released on its pool when
        vLLM finishes it, not at the engine's next draft (an idle engine drafts no more, so its
        context would stay on the replica, and the replica's `requests` gauge up, until the next
        request). Catches, on the V1 runner this CPU serves through: a release left to the next
        step's schedule, a release that never reaches the pool (MRV2's seam, which plans at
        schedule time: `test_vllm_mrv2_lossless.py`)."""
        base, _, metrics_url, _ = cluster
        assert _chat(_client(base), PROMPTS[0], True)
        deadline = time.monotonic() + 10  # a release waits on the request's calls still out (deadlines)
        while (held := {a: r.get("held", 0) for a, r in _replicas(metrics_url).items()}) and any(held.values()):
            assert time.monotonic() < deadline, f"held at idle: {held}"
            time.sleep(0.2)
        assert held, "no replica known"

    def test_sigterm_to_a_replica_hands_its_requests_back(self, cluster, long_reference):
        """What a spot node's notice (or a scale-down) does to a replica: SIGTERM with 8 long
        requests in flight (128 tokens each, every one past its first token, so each has its
        replica and most of its tokens to go). Catches: its requests found out only by failed
        calls, an output changed, a replica that holds on to the end of its grace or exits
        failing. Every request completes with the greedy output it has without the SIGTERM
        (`long_reference`); the verifier moves the replica's requests off it on its health change
        (its `rehomed` series rises with no failed call on it); it exits 0 within its grace (the
        pool's 30 s)."""
        base, proc, metrics_url, pools_url = cluster
        client = _client(base)
        deadline = time.monotonic() + 120  # both replicas up (the test before restarts one)
        while (len(pids := _drafter_pids(proc.pid)) < 2
               or not {_address(p) for p in pids} <= set(_replicas(metrics_url))
               or not all(serving(_address(p), timeout_s=2) for p in pids)):
            assert time.monotonic() < deadline, "two replicas never served"
            time.sleep(1)
        # A replica the test before restarted may still be behind the verifier's circuit breaker
        # for it (the pool's `retry_s`, 5 s, from its last failed call); the verifier moves the
        # stopped replica's requests only to a replica it may call, else they finish where they are.
        time.sleep(5 + 1)
        by_address = {_address(p): p for p in pids}
        exits, clean = _exits(pools_url), _exits(pools_url, "0")
        started = threading.Barrier(len(DRAIN_PROMPTS) + 1)
        with cf.ThreadPoolExecutor(len(DRAIN_PROMPTS)) as pool:
            futures = {p: pool.submit(_stream_long, client, p, started) for p in DRAIN_PROMPTS}
            started.wait(timeout=120)  # every request has its first tokens: all 8 in flight
            # the replica to stop is the one holding the most requests (one scrape): which one
            # gets them is the pool's choice (the least loaded replica it may call)
            deadline = time.monotonic() + 30
            before = _replicas(metrics_url)
            while not any(r.get("held", 0) for r in before.values()):
                assert time.monotonic() < deadline, f"no replica holds a request: {before}"
                time.sleep(0.2)
                before = _replicas(metrics_url)
            address = max(by_address, key=lambda a: before.get(a, {}).get("held", 0))
            os.kill(by_address[address], signal.SIGTERM)
            sent = time.monotonic()
            results = {p: f.result(timeout=240) for p, f in futures.items()}
        assert results == long_reference
        while _exits(pools_url) == exits:  # the supervisor sees it exit (and starts it again)
            assert time.monotonic() - sent < 30 + 2, "not out within its 30 s grace"
            time.sleep(0.2)
        assert _exits(pools_url, "0") == clean + 1, "it exited failing"
        before, after = before[address], _replicas(metrics_url)[address]
        assert after["rehomed"] > before.get("rehomed", 0), (before, after)  # moved on its health change ...
        assert after.get("errors", 0) == before.get("errors", 0), (before, after)  # ... not by failed calls

    def test_fifty_requests_at_concurrency_eight(self, cluster):
        """Every request gets its own answer: 50 requests over 5 prompts whose greedy answers differ,
        at concurrency 8, each compared with its prompt's answer alone (a lost, duplicated or crossed
        answer fails)."""
        base, _, _, _ = cluster
        client = _client(base)
        prompts = ["1, 2, 3, 4,", "10, 11, 12, 13,", "Monday, Tuesday, Wednesday,", "January, February, March,",
                   "red, orange, yellow,"]  # sequences the model continues, each its own way

        def complete(prompt: str) -> str:
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

        alone = {p: complete(p) for p in prompts}
        assert len(set(alone.values())) == len(prompts), alone  # distinct answers: a crossed one would show

        def one(i: int) -> tuple[str, float]:
            t = time.perf_counter()
            return complete(prompts[i % len(prompts)]), time.perf_counter() - t

        with cf.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(50)))  # in the order submitted: the i-th answer is request i's
        assert [r[0] for r in results] == [alone[prompts[i % len(prompts)]] for i in range(50)]
        lat = sorted(r[1] for r in results)
        p50, p99 = statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]
        print(f"\n50 requests at concurrency 8: p50 {p50:.2f} s, p99 {p99:.2f} s")
        assert httpx.get(f"{base}/health").status_code == 200

    def test_prometheus_2_and_3_read_every_dashboard_panel_and_alert_series(self, cluster, tmp_path):
        """Debian's Prometheus 2.42 (bookworm) and 3.x (sid), side by side (cached,
        `tests/operator/prometheus_tools.py`), scrape this cluster's verifier (vLLM's `vllm:`
        series and the proposer's `cosine_`), its pool replicas and `cosine serve`'s own series
        while requests run, each target twice: as CoSineClusters "a" and "b" of namespace "prod",
        with the labels the chart's PodMonitor relabels on (`cosine_cluster`, `component`, its job), and
        with the chart's rules loaded. On both servers, every query of the speculation dashboard
        (`tools/dashboards.py`, its variables set to match all) returns a value for each of the two
        clusters, and so does every recorded series and every series an alert on the runtime's
        series reads. Catches: a name a server's scrape rewrites (Prometheus 2 stored CoSine's
        former `cosine:` names as `cosine_`: 12 of 19 panels were empty there), a misspelled or
        renamed metric, a label a query groups by that no series has, two clusters summed into
        one line, a counter that exists only once something went wrong (an empty panel on a
        healthy cluster)."""
        import importlib.util
        import json
        import re
        from pathlib import Path

        from tests.operator.prometheus_tools import chart_rules, servers_2_and_3

        root = Path(__file__).resolve().parents[2]
        spec = importlib.util.spec_from_file_location("dashboards", root / "tools" / "dashboards.py")
        dashboards = importlib.util.module_from_spec(spec)
        sys.modules.setdefault("dashboards", dashboards)  # dataclasses look their module up
        spec.loader.exec_module(dashboards)
        base, proc, metrics_url, pools_url = cluster
        drafters = []
        for pid in _drafter_pids(proc.pid):
            args = open(f"/proc/{pid}/cmdline").read().split("\0")
            drafters.append(f"127.0.0.1:{args[args.index('--metrics-port') + 1]}")
        hostport = re.compile(r"http://([^/]+)/")
        workloads = "cosine-system/cosine-workloads"  # the PodMonitor's job (the rules' __WORKLOADS_JOB__)
        # job -> (targets, component, job label): as the chart's PodMonitor labels a verifier's two
        # ports and a drafter's; `cosine serve`'s own series stand for the operator's
        jobs = {"vllm": ([hostport.match(base + "/").group(1)], "verifier", workloads),
                "proposer": ([hostport.match(metrics_url).group(1)], "verifier", workloads),
                "drafters": (drafters, "drafter", workloads),
                "embedded": ([hostport.match(pools_url).group(1)], "serve", "serve")}
        clusters = ("a", "b")
        scrape_configs = [
            {"job_name": f"{job}-{c}", "static_configs": [{"targets": targets}],
             "relabel_configs": [{"target_label": k, "replacement": v} for k, v in
                                 (("job", label), ("namespace", "prod"), ("cosine_cluster", c),
                                  ("component", component))]}
            for job, (targets, component, label) in jobs.items() for c in clusters]
        groups = chart_rules("operator", workloads)
        (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp_path / "rules.yaml")], "scrape_configs": scrape_configs}))
        with servers_2_and_3(tmp_path) as servers:
            expected_targets = sum(len(targets) for targets, _, _ in jobs.values()) * len(clusters)
            deadline = time.monotonic() + 90
            for version, api, prom in servers:  # every target scraped once before the load
                while True:
                    try:
                        targets = httpx.get(f"{api}/targets", timeout=2).json()["data"]["activeTargets"]
                    except (httpx.HTTPError, ValueError, KeyError):
                        targets = []
                    if len(targets) == expected_targets and all(t["health"] == "up" for t in targets):
                        break
                    assert time.monotonic() < deadline and prom.poll() is None, (version, targets)
                    time.sleep(0.5)
            client = _client(base)
            with cf.ThreadPoolExecutor(4) as pool:  # a pool under load while Prometheus scrapes
                list(pool.map(lambda p: _chat(client, p), PROMPTS * 3))
            time.sleep(5)  # scraped after the load, and the rules evaluated on it

            recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
            read_by_alerts = set()  # the series alerts on the runtime's series read
            for g in groups:
                for r in g["rules"]:
                    if "alert" in r and "cosine_operator_" not in r["expr"].replace("cosine_operator_cluster_info", ""):
                        expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(?:by|on)\s*\([^)]*\)", "", r["expr"])
                        read_by_alerts |= set(re.findall(r"[a-z_]+:[a-z0-9_:]+\b(?!\s*\()", expr))
            assert read_by_alerts and read_by_alerts - recorded == {"vllm:num_requests_waiting"}, read_by_alerts
            checks = [(title, expr.replace("$namespace", ".*").replace("$cluster", ".*").replace("$pool", ".*")
                       .replace("$usd_per_hour", "1")) for title, expr in dashboards.queries("cosine-speculation")]
            checks += [(f"recorded by the rules{' and read by an alert' if n in read_by_alerts else ''}", n)
                       for n in sorted(recorded | read_by_alerts)]
            answers, empty = {}, []
            for version, api, _ in servers:
                for title, q in checks:
                    result = httpx.get(f"{api}/query", params={"query": q}).json()
                    assert result["status"] == "success", (version, title, result)
                    series = result["data"]["result"]
                    answers[f"{version} {title}: {q[:70]}"] = [(s["metric"], s["value"][1]) for s in series]
                    # a series of NaN (0/0: nothing counted in the window) draws nothing either
                    drawn = {s["metric"].get("cosine_cluster") for s in series
                             if s["value"][1] not in ("NaN", "+Inf", "-Inf")}
                    if drawn != set(clusters):
                        empty.append((version, title, q, series))
            print("\n" + json.dumps(answers, indent=1))
            assert not empty, empty
            exprs = "\n".join(r["expr"] for g in groups for r in g["rules"])
            # series names only: not the labels of matchers, groupings and label_replace's strings
            exprs = re.sub(r'\{[^}]*\}|\b(?:by|on|without|ignoring)\s*\([^)]*\)|"[^"]*"', "", exprs)
            named = set(re.findall(r"(?<![:\w])(vllm:[a-z_]+|cosine_(?!operator_)[a-z_]+)\b", exprs))
            for version, api, _ in servers:  # every raw series a rule names, by the name the rule spells
                names = set(httpx.get(f"{api}/label/__name__/values").json()["data"])
                assert named and named <= names, (version, sorted(named - names))
                assert not {n for n in names if n.startswith("cosine:")}, version

    def test_sigterm_drains_the_requests_in_flight_refuses_new_ones_and_exits(self, cluster, long_reference):
        """Last of the class (it ends the cluster). A rollout drains: `cosine serve` sent SIGTERM
        with 8 requests in flight finishes all 8 (each with the greedy output it had before),
        refuses a new one, exits 0 by itself and leaves no child. The drain is vLLM's own
        (`--shutdown-timeout`, from `spec.verifier.terminationGracePeriodSeconds`:
        `VerifierSpec.shutdown_timeout_s`); on Kubernetes the pod's preStop wait comes first.
        Catches: a request cut off or changed by the drain, a new request served while draining,
        a server that holds on to the end of its grace or exits failing, a child left running."""
        base, proc, _, _ = cluster
        # vLLM's drain time comes from the grace period (60 s - 10 s preStop - 5 s): not a fixed 5 s
        verifier = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "vllm"], capture_output=True, text=True)
        argv = open(f"/proc/{verifier.stdout.split()[0]}/cmdline").read().split("\0")
        timeout = int(argv[argv.index("--shutdown-timeout") + 1])
        assert timeout == 45, argv
        client = _client(base)
        below = descendants(proc.pid)
        started = threading.Barrier(len(DRAIN_PROMPTS) + 1)
        with cf.ThreadPoolExecutor(len(DRAIN_PROMPTS)) as pool:
            futures = {p: pool.submit(_stream_long, client, p, started) for p in DRAIN_PROMPTS}
            started.wait(timeout=120)  # every request has its first tokens: all 8 in flight
            os.kill(proc.pid, signal.SIGTERM)  # what the kubelet sends after preStop
            sigterm_s = time.monotonic()
            # the signal reaches vLLM's server through `cosine serve`'s handler: a request sent in the
            # same instant can still be admitted before the drain begins (CI saw one served). In a pod
            # the preStop wait and the endpoint's removal come first; here the request waits 2 s, while
            # the 8 streams (128 tokens each) are still being drained
            time.sleep(2)
            # a new request is refused, not served: no text comes back (a drained server's listening
            # socket is closed, or vLLM's engine rejects the add, or the stream is cut off)
            try:
                served = _stream_long(client, "Say hi.")
            except (openai.APIConnectionError, openai.APIStatusError) as refused:
                served = f"refused: {type(refused).__name__}"
            assert served.startswith("refused: "), f"served while draining: {served!r}"
            done = {p: f.result(timeout=120) for p, f in futures.items()}
            drained_s = time.monotonic() - sigterm_s
        assert done == long_reference  # all 8 finished, each with its whole greedy output
        assert proc.wait(timeout=60) == 0  # exits by itself once drained
        assert_all_gone(below)  # vLLM's server, engine core and the drafter replicas with it
        print(f"drained 8 requests in {drained_s:.1f} s after SIGTERM (vLLM given {timeout} s); {served}")


def _address(pid: int) -> str:
    """The gRPC address of the drafter process `pid` (from its command line)."""
    cmd = open(f"/proc/{pid}/cmdline").read().split("\0")
    return f"127.0.0.1:{cmd[cmd.index('--grpc-port') + 1]}"


def _replicas(metrics_url: str) -> dict[str, dict[str, float]]:
    """Replica address -> the verifier's `cosine_drafter_replica_*` series of it (one scrape):
    calls, errors, held (requests assigned now), rehomed; replicas it does not know are absent."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {"cosine_drafter_replica_calls_total": "calls", "cosine_drafter_replica_errors_total": "errors",
             "cosine_drafter_replica_requests": "held", "cosine_drafter_replica_rehomed_total": "rehomed"}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url).text):
        for sample in family.samples:
            if sample.name in names and "replica" in sample.labels:
                out.setdefault(sample.labels["replica"], {})[names[sample.name]] = sample.value
    return out


def _exits(pools_url: str, code: str | None = None) -> float:
    """Drafter processes of `cosine serve` that exited (with `code`, or any)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(httpx.get(pools_url).text)
               for sample in family.samples
               if sample.name == "cosine_embedded_replica_exits_total" and code in (None, sample.labels["code"]))


def _replica_calls(metrics_url: str) -> dict[str, dict[str, float]]:
    """pool -> replica address -> draft calls that returned (`cosine_drafter_replica_calls_total`)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url).text):
        for s in family.samples:
            if s.name == "cosine_drafter_replica_calls_total":
                out.setdefault(s.labels["pool"], {})[s.labels["replica"]] = s.value
    return out


def _embedded(url: str) -> tuple[dict[str, int], float]:
    """(pool -> replica processes, autoscaling passes) from `cosine serve --pools-metrics-port`."""
    from prometheus_client.parser import text_string_to_metric_families

    replicas: dict[str, int] = {}
    passes = 0.0
    for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
        for sample in family.samples:
            if sample.name == "cosine_embedded_pool_replicas":
                replicas[sample.labels["pool"]] = int(sample.value)
            elif sample.name == "cosine_embedded_autoscaler_passes_total":
                passes = sample.value
    return replicas, passes


# With -m slow (a server start and four answers, about a minute on two cores; the default run must stay under
# 15 minutes): the same path is checked by the losslessness tests (test_vllm_lossless: vLLM's draft_model fused
# with lookup and a pool over gRPC, greedy and sampled), the verifier's arguments for it as vLLM's own parser
# reads them by tests/test_roles.py, and its engine arguments by test_vllm_hooks.
@pytest.mark.slow
def test_the_engines_own_drafter_serves_beside_lookup_and_the_pool(tmp_path_factory, reference):
    """`spec.verifier.speculator: {method: draftModel}`: vLLM drafts with the draft model inside the
    verifier (here the target's own weights), CoSine takes its draft per request beside prompt
    lookup's and the pool's; outputs stay the target's own, and the source's counters say its
    drafts were verified and accepted."""
    path = _manifest(tmp_path_factory, 4, {"method": "draftModel", "model": MODEL})
    port, metrics_port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start([sys.executable, "-m", "cosine", "serve", "--cluster", path, "--port", str(port),
                   "--metrics-port", str(metrics_port), "--placement", "split"], base, {"COSINE_API_KEY": API_KEY})
    try:
        client = _client(base)
        for p in PROMPTS:
            assert _chat(client, p) == reference[p]
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        # the draft model is the target itself here: its drafts win over lookup's (which the
        # losslessness tests verify beside it)
        assert _counter(metrics_url, "cosine_spec_decode_num_accepted_tokens_total", "draftModel") > 0
    finally:
        _stop(proc)


# 140-210 s on two cores, the slowest test the default run had, which must stay under 15 minutes: it
# runs with `-m slow` (README); the default run keeps the rule's tests (tests/spec) and the embedded
# autoscaler's (tests/runtime/test_embedded.py), without real replicas.
@pytest.mark.slow
def test_the_autoscaler_closes_the_loop_on_real_processes(tmp_path, reference):
    """`cosine serve` with `spec.autoscaling` on: the operator's rule (imported) on its own scrape,
    starting and stopping real llama.cpp replicas. Pool "small" (minReplicas 1, maxReplicas 3)
    grows to at least 2 under a load step at concurrency 8, each replica serving draft calls, and
    returns to 1 after it; pool "cold" starts at zero (minReplicas 0), stays there while no
    request arrives, and comes back to one replica process when requests do (its demand is
    counted where the proposer routes, as asks skipped for "down"; whether its drafts then arrive
    in time on two shared cores is not this test's). Pool "dear" (minReplicas 0, one replica at
    start) is priced far above what its tokens are worth: it goes to zero with no requests and is
    not brought back by the load (its probes are no demand, and its first replica is weighed by
    what it adds against its price). Every output equals vLLM's target-only."""
    pull(MODEL, progress=False)
    pools = [{"name": "small", "model": MODEL, "replicas": 1, "minReplicas": 1, "maxReplicas": 3, "threads": 1},
             {"name": "cold", "model": MODEL, "replicas": 0, "minReplicas": 0, "maxReplicas": 1, "threads": 1},
             {"name": "dear", "model": MODEL, "replicas": 1, "minReplicas": 0, "maxReplicas": 1, "threads": 1,
              "pricePerHourUsd": 1e6}]
    manifest = {"apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "auto"},
                "spec": {"verifier": {"model": MODEL, "threads": 1}, "drafterPools": pools,
                         # drafts without branches: a replica's round is short enough to be on time
                         # at one request, so more replicas help (on two shared cores)
                         "speculation": {"maxDraftLen": 4, "adaptive": False, "branches": 0},
                         "autoscaling": {"enabled": True, "intervalSeconds": 2, "stabilizationSeconds": 4,
                                         "acceptedTokenValuePerMillionUsd": 1.0}}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(manifest))
    port, metrics_port, pools_port = free_port(), free_port(), free_port()
    base, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    pools_url = f"http://127.0.0.1:{pools_port}/metrics"
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cosine", "serve", "--cluster", str(path), "--port", str(port),
                                 "--metrics-port", str(metrics_port), "--pools-metrics-port", str(pools_port),
                                 "--placement", "split"],
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _start_wait(proc, base)
        client = _client(base, "none")
        _, first = _embedded(pools_url)
        deadline = time.monotonic() + 60
        while True:  # three passes without requests: the cold pool stays at zero, the dear one goes there
            replicas, passes = _embedded(pools_url)
            assert replicas.get("cold") == 0 and replicas.get("small") == 1, (replicas, log_path.read_text()[-2000:])
            if passes >= first + 3 and replicas.get("dear") == 0:
                break
            assert time.monotonic() < deadline, f"{passes - first} autoscaling passes in 60 s"
            time.sleep(0.5)
        while len(_drafter_pids(proc.pid)) != 1:  # the dear pool's replica drains, then exits
            assert time.monotonic() < deadline + 60, _drafter_pids(proc.pid)
            time.sleep(0.5)

        outputs: list[tuple[str, str]] = []
        stop, started = threading.Event(), time.monotonic()
        most = {"small": 1, "cold": 0, "dear": 0}  # the most replica processes each pool ran

        def load(i: int) -> None:
            while not stop.is_set():
                p = PROMPTS[i % len(PROMPTS)]
                outputs.append((p, _chat(client, p)))

        def all_serve() -> bool:  # every replica of small listed so far, at least two, has served draft
            try:  # calls (one added late takes new requests only), and the cold pool is back from zero
                for pool, n in _embedded(pools_url)[0].items():
                    most[pool] = max(most.get(pool, 0), n)
                small = _replica_calls(metrics_url).get("small", {})
            except httpx.HTTPError:  # a scrape slower than 5 s on two loaded cores: ask again
                return False
            return len(small) >= 2 and all(c > 0 for c in small.values()) and most["cold"] >= 1

        with cf.ThreadPoolExecutor(8) as pool:  # the load step: concurrency 8, 20 s at least, 120 s at most
            futures = [pool.submit(load, i) for i in range(8)]
            try:  # the load stops whatever fails here: the pool's threads would otherwise never end
                while time.monotonic() - started < 120:
                    if all_serve() and time.monotonic() - started > 20:
                        break
                    time.sleep(2)
                served = _replica_calls(metrics_url)  # before a replica added later is listed
            finally:
                stop.set()
            for f in futures:
                f.result(timeout=240)
        calls = _replica_calls(metrics_url)
        assert outputs and all(out == reference[p] for p, out in outputs)
        small = served.get("small", {})
        assert most["small"] >= 2 and len(small) >= 2 and all(c > 0 for c in small.values()), (most, served, calls)
        assert most["cold"] == 1, (most, served, log_path.read_text()[-3000:])  # back from zero, to its max
        assert most["dear"] == 0, (most, log_path.read_text()[-3000:])  # it does not pay: no load brings it back

        # the load is over: back to minReplicas, one step at a time, each replica drained first (up
        # to its 27 s drain where a drafter still holds requests the verifier has finished)
        deadline = time.monotonic() + 120
        while _embedded(pools_url)[0].get("small") != 1:
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(1)
        for p in PROMPTS:  # the pool that shrank still drafts, and the outputs are still the target's
            assert _chat(client, p) == reference[p]
        print(f"\n{len(outputs)} requests; most replicas {most}; draft calls per replica {calls}")
    finally:
        _stop(proc)


def _start_wait(proc: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + 400
    while True:
        assert proc.poll() is None, "cosine serve exited during start-up"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server not healthy after 400 s"
        time.sleep(1)
