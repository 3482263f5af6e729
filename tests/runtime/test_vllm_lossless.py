"""Lossless through vLLM: CoSine's drafts change speed, never the output distribution.

A real small model (SmolLM2-135M-Instruct) in vLLM, engine in-process so the test can read the
proposer's counters. Each engine runs in its own subprocess (vLLM holds process-wide state), two
at a time on two cores, each bound to its own. CoSine drafts k = 4 tokens every step (`adaptive: false`):
- sampling (temperature 1): the distribution of each generated position, and the joint of
  adjacent positions, matches vLLM target-only by chi-square two-sample tests, on a prompt where
  the drafts are partly accepted: prompt lookup alone; then prompt lookup and a drafter pool over
  gRPC (llama.cpp on the same model's GGUF, in the subprocess: the path `cosine serve` runs),
  fused by confidence; then the engine's own drafter (`spec.verifier.speculator`) fused with
  prompt lookup and the pool: vLLM's `draft_model` (the target's own weights as the draft model,
  so drafts are often accepted) and `eagle3` (a test-made head, `eagle3_head.py`);
- greedy: identical token ids to vLLM target-only, with drafts verified, on every path.
vLLM verifies our drafts as point-mass proposals (accept x with p(x), else sample from p without
x), which is exact (Leviathan et al. 2023, arXiv:2211.17192, with q a point mass) once vLLM-CPU's
expand_kernel is repaired (vllm-project/vllm#55005; `vllm_hooks.ensure_lossless_cpu_sampling`):
without the repair this test fails (position 1: '.' 61/600 against 4/600, at 600 samples).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import queue
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import vllm  # noqa: F401 - required (the losslessness claim is vLLM's): a broken install fails here, never skips

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
PROMPT = "Repeat this list exactly, five times: red, green, blue, red, green, blue, red, green, blue,"
SAMPLES = 400
TOKENS = 6

_SCRIPT = textwrap.dedent('''
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if __name__ == "__main__":
        from vllm import SamplingParams
        from cosine import vllm_hooks
        from cosine.model_store import resolve
        from cosine_spec.cluster_spec import SpeculationSpec
        system, prompt, samples, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        model = str(resolve("MODEL"))
        speculation, proposer, speculator, speculator_model = None, {}, None, None
        if system == "cosine":
            speculation = SpeculationSpec(max_draft_len=4, adaptive=False)
        if system in ("cosine-draft", "cosine-eagle3"):
            from cosine_spec.verifier_spec import SpeculatorSpec
            speculator_model = model if system == "cosine-draft" else sys.argv[5]
            speculator = SpeculatorSpec("draftModel" if system == "cosine-draft" else "eagle3", speculator_model)
        if system in ("cosine-pool", "cosine-draft", "cosine-eagle3"):
            from cosine.draft_engine import LlamaCppEngine
            from cosine.model_store import resolve_gguf
            from cosine.transport.drafter_service import DrafterServicer, serve
            engine = LlamaCppEngine(str(resolve_gguf("MODEL")), "pool", threads=1)
            server = serve(DrafterServicer(engine, "pool"), port=0)
            pools = [{"name": "pool", "addresses": [f"127.0.0.1:{server.bound_port}"], "expertise": ["chat"]}]
            speculation, proposer = SpeculationSpec(max_draft_len=4, adaptive=False), {"pools": pools}
        llm = vllm_hooks.cosine_llm(model, speculation, proposer, speculator, speculator_model, dtype="float32",
                                    enforce_eager=True, max_model_len=512, seed=0)
        sampled = llm.generate([prompt] * samples, SamplingParams(temperature=1.0, max_tokens=tokens, seed=None,
                                                                  ignore_eos=True), use_tqdm=False)
        greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
        stats = {}
        if system != "vllm":
            s = llm.llm_engine.engine_core.engine_core.scheduler.cosine.stats
            stats = {"draft_tokens": s.draft_tokens, "accepted": s.accepted_tokens}
        # Shut the engine down before exit: CoSineScheduler.shutdown stops the proposer's pool-call
        # threads, which the interpreter would otherwise join only after running every queued call.
        llm.llm_engine.engine_core.shutdown()
        if system not in ("vllm", "cosine"):
            server.stop(0)
        print("RESULT" + json.dumps({"samples": [list(o.outputs[0].token_ids) for o in sampled],
                                     "greedy": list(greedy[0].outputs[0].token_ids), "stats": stats}))
''').replace("MODEL", MODEL)


def _run(system: str, tmp_path, samples: int = SAMPLES, *extra: str, cpu: int | None = None) -> dict:
    """One engine's samples, greedy output and CoSine's counters (a subprocess of its own); `cpu`:
    the core its one OpenMP thread is bound to (None: vLLM's own choice)."""
    script = tmp_path / f"run_{system}.py"  # never `vllm.py` or `cosine.py`: its folder is first on sys.path
    script.write_text(_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    out = subprocess.run([sys.executable, str(script), system, PROMPT, str(samples), str(TOKENS), *extra],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory) -> dict[str, dict | BaseException]:
    """Every engine of this module, run two at a time where two cores are ours: each engine uses
    one OpenMP thread, bound to a core of its own, so two run side by side in about the time of
    one. system -> its result, or the exception its run raised (the test that reads it fails)."""
    from cosine.model_store import pull, resolve

    from .eagle3_head import write_eagle3_head

    pull(MODEL, progress=False)
    tmp = tmp_path_factory.mktemp("lossless")
    head = write_eagle3_head(resolve(MODEL), tmp / "eagle3-head")
    jobs = {"cosine-draft": (200,), "vllm": (SAMPLES,), "cosine": (SAMPLES,), "cosine-eagle3": (200, str(head)),
            "cosine-pool": (200,)}  # the longest first
    cores = sorted(os.sched_getaffinity(0))[:2]
    free: queue.Queue[int | None] = queue.Queue()
    for c in cores if len(cores) == 2 else [None]:
        free.put(c)

    def one(system: str) -> dict:
        cpu = free.get()
        try:
            return _run(system, tmp, jobs[system][0], *jobs[system][1:], cpu=cpu)
        finally:
            free.put(cpu)

    with cf.ThreadPoolExecutor(free.qsize()) as pool:
        futures = {system: pool.submit(one, system) for system in jobs}
    return {system: f.exception() or f.result() for system, f in futures.items()}


def _result(all_runs: dict[str, dict | BaseException], system: str) -> dict:
    r = all_runs[system]
    if isinstance(r, BaseException):
        raise r
    return r


@pytest.fixture(scope="module")
def runs(all_runs) -> tuple[dict, dict]:
    return _result(all_runs, "vllm"), _result(all_runs, "cosine")


def _chi2_same(a: Counter, b: Counter, min_count: int = 5) -> float:
    """p-value of a chi-square test that two samples come from one categorical distribution
    (categories rarer than `min_count` in both samples pooled into one)."""
    from scipy.stats import chi2_contingency

    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= min_count]
    rest_a = sum(v for k, v in a.items() if k not in keys)
    rest_b = sum(v for k, v in b.items() if k not in keys)
    columns = [(a[k], b[k]) for k in keys] + [(rest_a, rest_b)]
    columns = [c for c in columns if sum(c) > 0]
    if len(columns) < 2:
        return 1.0
    table = [[c[0] for c in columns], [c[1] for c in columns]]
    return float(chi2_contingency(table)[1])


def _same_distribution(ref: dict, cos: dict, sources: tuple[str, ...]) -> None:
    drafted, accepted = cos["stats"]["draft_tokens"], cos["stats"]["accepted"]
    print(f"draft tokens {drafted}, accepted {accepted}")
    for source in sources:  # every source's drafts were verified, some accepted, some rejected
        assert drafted.get(source, 0) > 50, drafted
        assert 0 < accepted.get(source, 0) < drafted[source], (source, accepted, drafted)
    for pos in range(TOKENS):
        a = Counter(s[pos] for s in ref["samples"])
        b = Counter(s[pos] for s in cos["samples"])
        assert _chi2_same(a, b) > 1e-3, f"position {pos}: {a.most_common(5)} vs {b.most_common(5)}"
    # and the joint of adjacent positions (a draft's accepted token changes the next one's context)
    for pos in range(TOKENS - 1):
        a = Counter(tuple(s[pos:pos + 2]) for s in ref["samples"])
        b = Counter(tuple(s[pos:pos + 2]) for s in cos["samples"])
        assert _chi2_same(a, b) > 1e-3, f"positions {pos}, {pos + 1}"


def test_sampled_distribution_matches_target_only(runs):
    ref, cos = runs
    _same_distribution(ref, cos, ("lookup",))


def test_sampled_and_greedy_with_pool_drafts_match_target_only(runs, all_runs):
    """The path `cosine serve` runs: lookup and a llama.cpp pool over gRPC, fused (200 samples,
    compared with the target-only run's 400), and its greedy output token for token."""
    ref, _ = runs
    cos = _result(all_runs, "cosine-pool")
    _same_distribution(ref, cos, ("lookup", "pool"))
    assert cos["greedy"] == ref["greedy"]


def test_greedy_identical_to_target_only(runs):
    ref, cos = runs
    assert cos["greedy"] == ref["greedy"]


def test_sampled_and_greedy_with_the_engines_draft_model_fused_match_target_only(runs, all_runs):
    """`spec.verifier.speculator: {method: draftModel}`: vLLM's draft_model drafts inside the
    engine, CoSine offers its draft beside lookup's and the pool's and verifies the fused choice."""
    ref, _ = runs
    cos = _result(all_runs, "cosine-draft")
    _same_distribution(ref, cos, ("draftModel", "lookup"))
    assert cos["greedy"] == ref["greedy"]


def test_sampled_and_greedy_with_a_test_made_eagle3_head_fused_match_target_only(runs, all_runs):
    """`spec.verifier.speculator: {method: eagle3}`, with a random EAGLE-3 head written by the
    fixture: its drafts are verified (rarely accepted) and nothing changes the target's distribution."""
    ref, _ = runs
    cos = _result(all_runs, "cosine-eagle3")
    assert cos["stats"]["draft_tokens"].get("eagle3", 0) > 0, cos["stats"]
    _same_distribution(ref, cos, ("lookup",))
    assert cos["greedy"] == ref["greedy"]
