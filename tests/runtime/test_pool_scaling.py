"""A pool scaled out and in under load, on real processes: what the operator's autoscaler does to a
pool's Deployment, as the verifier sees it through the headless Service's addresses.

Real pieces: two `cosine drafter` processes (llama.cpp on SmolLM2-135M-Instruct's GGUF, one core
each at most), vLLM on the same model as the verifier with CoSine's proposer under its engine (in
a subprocess, engine in-process so the script reads the proposer), closed-loop load at
concurrency 8 (vLLM's `max_num_seqs`), greedy, float32. The address list the pool re-resolves is
a list the script controls (on Kubernetes: the Service's DNS records, one per ready pod).
- scale 1 -> 2: once the list is re-resolved (at most one interval later), new requests go to the
  new replica (one of the first three placed); over the 2-replica phase each serves 30-70% of the
  pool's calls;
- no request's calls are split across replicas, except after a re-home;
- scale 2 -> 1: a replica killed mid-run and dropped from the list; every request completes;
- every output is identical to vLLM target-only; at the end no per-request context is left in the
  proposer, the pool client or the surviving replica.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import httpx
import llama_cpp  # noqa: F401 - required, as vLLM is: a broken install fails here, never skips
import pytest
import vllm  # noqa: F401
import yaml

# Slow (-m slow, 52 s here): the default suite's closed loop (test_serve's autoscaling test) starts
# and stops real replicas through the same address re-resolution, and test_serve kills a replica
# mid-stream; this one's hand-driven address list and call-split figures run on request.
pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
RESOLVE_EVERY_S = 0.5
TOKENS = 24
WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "piano", "lemon", "candle", "forest",
         "silver", "rocket", "garden", "winter", "planet"]
PROMPTS = ([f"Count from {i} to {i + 30}, separated by commas: {i}," for i in range(1, 49, 3)]
           + [f"Write the word {w} ten times, separated by spaces: {w} {w}" for w in WORDS]
           + [f"The alphabet starting at {c}: {c}," for c in "ABCDEFGHIJKLMNOP"])  # 48 prompts

_SCRIPT = textwrap.dedent('''
    import json, os, signal, sys, threading, time
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if __name__ == "__main__":
        from vllm import SamplingParams
        from cosine import vllm_hooks
        from cosine.model_store import resolve
        from cosine_spec.cluster_spec import SpeculationSpec
        args = json.loads(sys.argv[1])
        model, prompts = str(resolve(args["model"])), args["prompts"]
        greedy = SamplingParams(temperature=0, max_tokens=args["tokens"], ignore_eos=True)
        if not args["replicas"]:  # the reference: vLLM target-only
            llm = vllm_hooks.cosine_llm(model, None, dtype="float32", enforce_eager=True, max_model_len=512,
                                        max_num_seqs=8, seed=0)
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            print("RESULT" + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs]}))
            sys.exit(0)
        r0, r1 = args["replicas"]
        llm = vllm_hooks.cosine_llm(model, SpeculationSpec(max_draft_len=4, adaptive=False),
                                    {"pools": [{"name": "small", "addresses": [r0], "expertise": ["chat"]}]},
                                    dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8, seed=0)
        proposer = llm.llm_engine.engine_core.engine_core.scheduler.cosine
        # ask the pool at every step (not only where it pays): enough calls to measure the spread
        import dataclasses
        from cosine.pool_policy import PoolPolicy
        proposer.settings = dataclasses.replace(proposer.settings, pool=PoolPolicy(probe_every=1))
        pool = proposer.pools.pools["small"]
        current = [r0]
        pool.resolve, pool.resolve_every_s = (lambda: list(current)), args["resolve_every_s"]
        calls, lock = [], threading.Lock()  # (start seconds, request id, replica) per draft call that returned

        def traced(connect):
            def make(address):
                remote = connect(address)
                inner = remote.propose
                def propose(rid, *a, **kw):
                    started = time.monotonic()
                    d = inner(rid, *a, **kw)
                    with lock:
                        calls.append((started, rid, address))
                    return d
                remote.propose = propose
                return remote
            return make
        pool._connect = traced(pool._connect)
        pool.close()  # reconnect r0 through the tracer
        pool._refresh(force=True)

        n = len(prompts) // 3
        phases, outputs = {}, []
        t = time.monotonic()
        outputs += llm.generate(prompts[:n], greedy, use_tqdm=False)  # one replica
        phases["one"] = (t, time.monotonic())
        current.append(r1)  # scale 1 -> 2: the Service gains a ready pod
        t = time.monotonic()
        outputs += llm.generate(prompts[n:2 * n], greedy, use_tqdm=False)
        phases["two"] = (t, time.monotonic())

        def scale_in():  # scale 2 -> 1 mid-run: the replica is killed and leaves the list
            while True:
                with lock:
                    if sum(1 for c in calls if c[0] > phases["two"][1] and c[2] == r1) >= 3:
                        break
                time.sleep(0.01)
            phases["killed"] = time.monotonic()
            os.kill(args["pids"][1], signal.SIGKILL)
            current.remove(r1)
        killer = threading.Thread(target=scale_in, daemon=True)
        killer.start()
        t = time.monotonic()
        outputs += llm.generate(prompts[2 * n:], greedy, use_tqdm=False)
        phases["in"] = (t, time.monotonic())
        killer.join(timeout=5)
        deadline = time.monotonic() + 10  # releases run on the proposer's pool threads
        while (proposer.num_requests() or pool.num_requests()) and time.monotonic() < deadline:
            time.sleep(0.1)
        result = {"outputs": [list(o.outputs[0].token_ids) for o in outputs], "calls": calls, "phases": phases,
                  "proposer_requests": proposer.num_requests(), "pool_requests": pool.num_requests(),
                  "rehomes": pool.rehomes, "accepted": proposer.stats.accepted_tokens,
                  "errors": proposer.stats.pool_errors}
        llm.llm_engine.engine_core.shutdown()
        print("RESULT" + json.dumps(result))
''')


def _run(tmp_path, args: dict) -> dict:
    script = tmp_path / "run_scaling.py"
    script.write_text(_SCRIPT)
    out = subprocess.run([sys.executable, str(script), json.dumps(args)], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=800)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT"):])


def _contexts(metrics_port: int) -> float:
    for line in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text.splitlines():
        if line.startswith("cosine_drafter_contexts{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no cosine_drafter_contexts series")


def test_pool_scales_out_and_in_under_load(tmp_path):
    from cosine import embedded
    from cosine.manifest import load_manifest
    from cosine.model_store import pull

    pull(MODEL, progress=False)
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(yaml.safe_dump({
        "apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "scaling"},
        "spec": {"verifier": {"model": MODEL, "threads": 1},
                 "drafterPools": [{"name": "small", "model": MODEL, "replicas": 2, "threads": 1}]}}))
    reference = _run(tmp_path, {"model": MODEL, "prompts": PROMPTS, "tokens": TOKENS, "replicas": []})
    loaded = load_manifest(manifest)
    pool = loaded.spec.drafter_pools[0]
    children = [embedded.start_replica(loaded, pool, f"small-{i}") for i in range(2)]
    try:
        embedded.wait_healthy(children, timeout_s=300)
        replicas = [f"127.0.0.1:{c.grpc_port}" for c in children]
        out = _run(tmp_path, {"model": MODEL, "prompts": PROMPTS, "tokens": TOKENS, "replicas": replicas,
                              "pids": [c.process.pid for c in children], "resolve_every_s": RESOLVE_EVERY_S})
        survivor_metrics = int(children[0].cmd[children[0].cmd.index("--metrics-port") + 1])
        survivor_contexts = _contexts(survivor_metrics)
    finally:
        embedded.stop_children(children)

    # lossless through every scale event
    assert out["outputs"] == reference["outputs"]
    assert out["accepted"].get("small", 0) > 0, out["accepted"]  # the pool's drafts were verified and accepted
    r0, r1 = replicas
    calls, phases = out["calls"], out["phases"]
    two_start, two_end = phases["two"]
    in_two = [c for c in calls if two_start <= c[0] <= two_end]
    first_r1 = min(c[0] for c in calls if c[2] == r1)
    print(f"\nfirst call on the new replica {first_r1 - two_start:.2f} s after it joined; "
          f"2-replica phase: {len(in_two)} calls, rehomes {out['rehomes']}")
    assert all(c[2] == r0 for c in calls if c[0] < two_start)  # one replica until it scaled out
    # The pool re-resolves on the first call starting one interval after the scale-out (or earlier,
    # if the last re-resolve was earlier). From then on a new request goes to the least-held replica:
    # the first one placed may still go to r0 (a tie, when r0's first batch has just been released),
    # but it stays held there, so the next goes to r1. Calls of concurrent placements may start in
    # another order than they were assigned: among the first three placed after the re-resolve, one
    # is on r1. When requests are placed depends on when earlier ones finish, i.e. on the machine's
    # speed: ordering is asserted, not time (0.1 s covers a call that entered the pool just before
    # the interval ended).
    seen_before = {c[1] for c in calls if c[0] < two_start}
    first_call = {}
    for t, rid, address in sorted(calls):
        first_call.setdefault(rid, (t, address))
    placed_after = sorted((t, a) for rid, (t, a) in first_call.items()
                          if rid not in seen_before and two_start + RESOLVE_EVERY_S + 0.1 <= t <= two_end)
    assert len(placed_after) < 3 or r1 in [a for _, a in placed_after[:3]], placed_after[:3]
    share = sum(1 for c in in_two if c[2] == r1) / len(in_two)
    print(f"share of the 2-replica phase's calls on the new replica: {share:.2f}")
    assert 0.3 <= share <= 0.7
    # affinity: a request's calls stay on one replica, unless it was re-homed off the killed one
    killed = phases["killed"]
    for rid in {c[1] for c in calls}:
        seq = [(t, a) for t, r, a in calls if r == rid]
        moves = [(t, a) for (_, a0), (t, a) in zip(seq, seq[1:], strict=False) if a != a0]
        assert all(a == r0 and t >= killed for t, a in moves) and len(moves) <= 1, (rid, seq)
    assert out["rehomes"] >= 1
    # nothing left behind
    assert out["proposer_requests"] == 0 and out["pool_requests"] == 0
    assert survivor_contexts == 0
