"""`cosine bench`, without servers or models: the order of runs (a fresh server per level, the
reference first and last), the warm-up, the manifest copies (fusion off, split threads), the suffix
speculative config, the split placement's environment, the pool and drafter figures, /proc readings
and the repeat workload."""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import sys

import pytest
import yaml

from cosine.manifest import load_manifest, parse_spec
from cosine.tooling import bench_results, vllm_bench, workloads
from cosine.tooling.bench_results import Record
from cosine.tooling.workloads import Prompt


def test_plan_runs_fresh_server_per_level_reference_first_and_last():
    runs = vllm_bench.plan_runs(bench_results.DEFAULT_SYSTEMS, [1, 4])
    middle = ["vllm-ngram", "vllm-suffix", "vllm-draft", "cosine-lookup", "cosine", "cosine-draft"]
    for c in (1, 4):
        level = [r for r in runs if r.concurrency == c]
        assert [r.system for r in level] == ["vllm", *middle, "vllm"]
        assert [r.run for r in level] == list(range(len(middle) + 2))
    assert [r.concurrency for r in runs] == [1] * 8 + [4] * 8  # level by level: each level bracketed
    for ablation in ("cosine-nofusion", "cosine-nobranch"):
        assert ablation not in bench_results.DEFAULT_SYSTEMS and ablation in bench_results.SYSTEMS
    with pytest.raises(ValueError, match="unknown systems"):
        vllm_bench.plan_runs(["vllm", "sglang"], [1])


def test_run_bench_starts_a_fresh_server_per_level_and_warms_it_up_off_the_measured_set(monkeypatch, tmp_path):
    servers, commands = [], []

    class FakeServer:
        def __init__(self, argv, env, port, metrics_port, quiet):
            self.base, self.metrics_port, self.sent = f"http://fake:{port}", metrics_port, []
            servers.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.stopped = True

        def bindings(self):
            return [{"pid": 1, "role": "VLLM::Worker", "cpus": [0, 1]}]

        def drafters(self):
            return []

        def scrape(self):
            return {}

    async def fake_loop(base, model, prompts, concurrency, max_tokens, system, run, done=lambda: None, rate=None):
        server = next(s for s in servers if s.base == base)
        server.sent.append([p.id for p in prompts])
        for _ in prompts:
            done()
        # a fixed wall time per run, so tokens per second follow the tokens below rather than
        # microseconds of scheduling noise (a vllm-ngram run measured 0.6x vllm here once)
        await asyncio.sleep(0.02)
        n = 10 if system == "vllm" else 20
        return [Record(system, run, concurrency, p.id, p.domain, "same", n, 0.1, 1.0) for p in prompts]

    def fake_command(system, manifest, port, metrics_port, drafter_model, peer_k, suffix_k, placement, extra_env):
        commands.append((system, manifest, extra_env))
        return [system], {}

    monkeypatch.setattr(vllm_bench, "_Server", FakeServer)
    monkeypatch.setattr(vllm_bench, "_load", fake_loop)
    monkeypatch.setattr(vllm_bench, "_server_command", fake_command)
    prompts = [Prompt("a", "code", "def f():"), Prompt("b", "chat", "hi")]
    systems = ["vllm", "vllm-ngram", "cosine", "cosine-nofusion"]
    progress = []
    real_progress = vllm_bench._progress

    def recorded():
        progress.append(real_progress())
        return progress[-1]

    monkeypatch.setattr(vllm_bench, "_progress", recorded)
    saved = []  # what each checkpoint would write: a run stopped midway keeps the runs it measured

    def checkpoint(partial):
        saved.append((partial["complete"], [(r["system"], r["concurrency"]) for r in partial["rows"]],
                      partial["rows"][-1]["speedup_vs_vllm"]))

    report = vllm_bench.run_bench(prompts, systems, [1, 2], 16, load_manifest(None), "drafter", placement="split",
                                  checkpoint=checkpoint)
    assert len(servers) == 2 * 5 and all(s.stopped for s in servers)  # one server per (system, level)
    assert [len(rows) for _, rows, _ in saved] == list(range(1, 11)) and not any(done for done, _, _ in saved)
    assert saved[6][1][-2:] == [("vllm", 2), ("vllm-ngram", 2)] and saved[6][2] > 1  # ratios so far
    assert report["complete"] is True
    overall = progress[0].tasks[0]  # prompts done over all runs (the warm-up not counted)
    assert (overall.completed, overall.total) == (2 * 5 * 2, 2 * 5 * 2)
    for s in servers:  # the warm-up first, then the measured prompts, once
        assert s.sent == [["warmup"], ["a", "b"]]
    assert vllm_bench.WARMUP.prompt not in {p.prompt for p in prompts}
    rows = report["rows"]
    assert [(r["system"], r["run"], r["concurrency"]) for r in rows][:5] == [
        ("vllm", 0, 1), ("vllm-ngram", 1, 1), ("cosine", 2, 1), ("cosine-nofusion", 3, 1), ("vllm", 4, 1)]
    assert rows[1]["per_domain_speedup_vs_vllm"]["code"] == pytest.approx(2.0)  # wall times are real here
    assert rows[1]["identical_to_vllm"] == 2 and rows[1]["speedup_vs_vllm"] is not None
    # decoding after the first token: vllm 9 tokens in 0.9 s, the others 19 in 0.9 s
    assert rows[2]["decode_tokens_per_s"] == pytest.approx(19 / 0.9)
    assert rows[2]["decode_speedup_vs_vllm"] == pytest.approx(19 / 9)
    assert rows[2]["decode_speedup_vs_best_vllm_speculation"] == pytest.approx(1.0)  # vllm-ngram decodes as fast
    per_domain = rows[2]["per_domain_decode_speedup_vs_vllm"]
    assert per_domain == {"code": pytest.approx(19 / 9), "chat": pytest.approx(19 / 9)}
    assert rows[0]["binding"]["env"] == {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, report["cpus"]))}
    assert report["placement"] == "split" and rows[0]["binding"]["processes"][0]["cpus"] == [0, 1]
    manifests = {system: manifest for system, manifest, _ in commands}
    assert manifests["vllm"].path is None and manifests["vllm-ngram"].path is None
    assert manifests["cosine"].path != manifests["cosine-nofusion"].path  # written copies, gone after the run
    assert not manifests["cosine"].path.exists()
    assert manifests["cosine-nofusion"].spec.speculation.fusion is False
    assert report["draft_cost"] == []  # not asked for


def test_run_bench_times_every_drafter_engine_on_the_pools_models_on_a_pools_cores(monkeypatch):
    from cosine.tooling import draft_cost

    asked = []

    def fake_child(engine, model, prompts, k, batches, cores):
        asked.append((engine, model, k, tuple(batches), tuple(cores), len(prompts)))
        return [draft_cost.DraftCost(engine, model, tuple(cores), len(cores), b, 100, 50.0, 0.04 * b, 0.04, 8 * b)
                for b in batches]

    monkeypatch.setattr(vllm_bench, "plan_runs", lambda systems, levels: [])
    monkeypatch.setattr(draft_cost, "measure_in_child", fake_child)
    monkeypatch.setattr(vllm_bench.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    prompts = [Prompt(str(i), "code", f"def f{i}():") for i in range(9)]
    report = vllm_bench.run_bench(prompts, [], [1, 8], 16, load_manifest(None), "smollm2-135m-instruct",
                                  draft_cost_models=[])
    pool_model = load_manifest(None).spec.drafter_pools[0].model
    assert [a[:2] for a in asked] == [("llamacpp", pool_model), ("vllm", pool_model),
                                      ("llamacpp", "smollm2-135m-instruct"), ("vllm", "smollm2-135m-instruct")]
    assert {a[2:] for a in asked} == {(8, (1, 8), (2, 3), 9)}  # k 8; alone and at c=8; a pool's half of 4 cores
    assert len(report["draft_cost"]) == 8 and report["draft_cost"][1]["batch"] == 8
    table = bench_results.format_table(report)
    assert "ms/draft token" in table and "smollm2-135m-instruct" in table and " 40 " in table
    vllm_bench.run_bench(prompts[:3], [], [1, 8], 16, load_manifest(None), "x", draft_cost_models=["y"])
    assert asked[-1][:4] == ("vllm", "y", 8, (1, 3))  # batched at most as many requests as there are prompts


def test_a_failing_drafter_engine_leaves_an_error_row_and_the_bench_its_rows(monkeypatch):
    from cosine.tooling import draft_cost

    def failing(engine, model, prompts, k, batches, cores):
        if engine == "vllm":
            raise RuntimeError("draft cost of vllm on y failed (exit 1): ValueError: no such model")
        return [draft_cost.DraftCost(engine, model, tuple(cores), 1, 1, 100, 50.0, 0.04, 0.04, 8)]

    monkeypatch.setattr(vllm_bench, "plan_runs", lambda systems, levels: [])
    monkeypatch.setattr(draft_cost, "measure_in_child", failing)
    report = vllm_bench.run_bench([Prompt("a", "code", "x")], [], [1], 16, load_manifest(None), "y",
                                  draft_cost_models=["y"])
    assert [("error" in c, c["engine"]) for c in report["draft_cost"]] == [(False, "llamacpp"), (True, "vllm")]
    assert "failed: draft cost of vllm on y failed" in bench_results.format_table(report)


def test_derived_manifest_ablations_and_split_threads():
    source = load_manifest(None).obj
    kept = copy.deepcopy(source)
    off = vllm_bench.derived_manifest(source, speculation={"fusion": False})
    assert off["spec"]["speculation"]["fusion"] is False
    assert off["spec"]["speculation"]["maxDraftLen"] == source["spec"]["speculation"]["maxDraftLen"]
    assert source == kept  # the input is not modified
    split = vllm_bench.derived_manifest(source, threads=vllm_bench.placement_threads("split", 2))
    assert split["spec"]["verifier"]["threads"] == 1
    assert [p["threads"] for p in split["spec"]["drafterPools"]] == [1] * len(source["spec"]["drafterPools"])
    four = vllm_bench.derived_manifest(source, threads=vllm_bench.placement_threads("split", 4))
    assert four["spec"]["verifier"]["threads"] == 2 and four["spec"]["drafterPools"][0]["threads"] == 2
    overlap = vllm_bench.derived_manifest(source, threads=vllm_bench.placement_threads("overlap", 2))
    assert overlap["spec"]["verifier"]["threads"] == 2 and overlap["spec"]["drafterPools"][0]["threads"] == 1
    assert vllm_bench.placement_threads("shared", 2) is None
    spec = parse_spec(yaml.safe_load(yaml.safe_dump(off)))  # still a valid CoSineCluster spec
    assert spec.verifier.model == source["spec"]["verifier"]["model"]
    assert vllm_bench._manifest_variant("cosine-nofusion", "shared", [0, 1]) == ((("fusion", False),), None, ())
    assert vllm_bench._manifest_variant("cosine-nobranch", "split", [0, 1]) == ((("branches", 0),), (1, 1), ())
    assert vllm_bench._manifest_variant("cosine-lookup", "split", [0, 1]) == ((), (1, 1), ())
    assert vllm_bench._manifest_variant("cosine", "overlap", [0, 1]) == ((), (2, 1), ())
    assert vllm_bench._manifest_variant("vllm-draft", "split", [0, 1]) == ((), None, ())
    # the engine's own drafter: vllm-draft's model at vllm-draft's k, with and without lookup
    assert vllm_bench._manifest_variant("cosine-draft", "lookup", [0, 1], "qwen-0.5b", 4) == (
        (("maxDraftLen", 4),), (2, 1), ("draftModel", "qwen-0.5b"))
    assert vllm_bench._manifest_variant("cosine-draft-nolookup", "lookup", [0, 1], "qwen-0.5b", 3)[0] == (
        ("maxDraftLen", 3), ("promptLookup", False))
    assert vllm_bench._manifest_variant("cosine-draft-k8", "lookup", [0, 1], "qwen-0.5b", 4)[0] == (
        ("maxDraftLen", 8),)  # its own bound, the drafter's depth following the k chosen
    with_head = vllm_bench.derived_manifest(source, speculator={"method": "draftModel", "model": "qwen-0.5b"})
    assert with_head["spec"]["verifier"]["speculator"] == {"method": "draftModel", "model": "qwen-0.5b"}
    nobranch = vllm_bench.derived_manifest(source, speculation=dict(bench_results.ABLATIONS["cosine-nobranch"]))
    assert parse_spec(nobranch).speculation.branches == 0  # the ablation is a valid spec the runtime reads
    by_rate = vllm_bench.derived_manifest(source, speculation=dict(bench_results.ABLATIONS["cosine-acceptance"]))
    assert parse_spec(by_rate).speculation.draft_length == "acceptanceRate"


def test_profile_top_sums_a_py_spy_collapsed_profile():
    collapsed = "\n".join([
        "main (engine.py:1);step (engine.py:9);sched_yield (utils.py:3) 80",
        "main (engine.py:1);step (engine.py:9);propose (cosine/proposer.py:10);speculate (cosine/lookup.py:5) 15",
        'process 7:"python -m cosine serve --cluster /cache/cosine/x.yaml";main (engine.py:1);'
        "step (engine.py:12);propose (cosine/proposer.py:11) 5",
        " 7",  # py-spy's idle line: no stack
    ])
    top = vllm_bench.profile_top(collapsed, top=2)
    assert top["samples"] == 100 and top["match_share"] == 0.2
    assert top["top_self"] == [("sched_yield (utils.py)", 0.8), ("speculate (cosine/lookup.py)", 0.15)]
    assert top["top_match"][0] == ("propose (cosine/proposer.py)", 0.2)  # one frame, lines folded


def test_suffix_speculative_config_uses_vllm_defaults_but_k():
    assert vllm_bench.peer_speculative_config("vllm-suffix", "", 4, 4) == {"method": "suffix",
                                                                            "num_speculative_tokens": 4}
    assert vllm_bench.peer_speculative_config("vllm-suffix", "", 4, 0) == {"method": "suffix"}
    assert vllm_bench.peer_speculative_config("vllm", "", 4, 4) is None
    assert vllm_bench.peer_speculative_config("vllm-draft", "/m", 3, 4)["num_speculative_tokens"] == 3
    with pytest.raises(ValueError):
        vllm_bench.peer_speculative_config("cosine", "", 4, 4)
    # the defaults the module documents are vLLM 0.32's (a vLLM upgrade that changes them fails here)
    from vllm.config.speculative import SpeculativeConfig

    fields = SpeculativeConfig.__dataclass_fields__
    assert {k: fields[k].default for k in fields if k.startswith("suffix_decoding_")} == {
        "suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
        "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}


def test_split_placement_binds_peers_to_every_core_and_leaves_cosine_to_its_manifest():
    assert vllm_bench.placement_env("vllm", "split", [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    assert vllm_bench.placement_env("vllm-suffix", "split", [2, 3, 5]) == {"VLLM_CPU_OMP_THREADS_BIND": "2,3,5"}
    assert vllm_bench.placement_env("cosine", "split", [0, 1]) == {}  # `cosine serve` places its roles
    assert vllm_bench.placement_env("cosine-lookup", "split", [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert vllm_bench.placement_env("cosine-lookup", "split", [0, 1, 2, 3]) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    assert vllm_bench.placement_env("vllm", "shared", [0, 1]) == {}
    # overlap: every verifier on every core, cosine-lookup's too
    assert vllm_bench.placement_env("cosine-lookup", "overlap", [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    assert vllm_bench.placement_env("cosine", "overlap", [0, 1]) == {}
    with pytest.raises(ValueError, match="unknown placement"):
        vllm_bench.placement_env("vllm", "spread", [0, 1])


def test_summarize_pool_and_drafter_figures():
    before = {("cosine_spec_decode_num_draft_tokens_total", "coder"): 10.0,
              ("cosine_verifier_steps_total", ""): 5.0, ("cosine_verifier_busy_seconds_total", ""): 1.0}
    after = {("cosine_spec_decode_num_draft_tokens_total", "coder"): 30.0,
             ("cosine_spec_decode_num_accepted_tokens_total", "coder"): 15.0,
             ("cosine_spec_decode_num_draft_tokens_total", "lookup"): 4.0,
             ("cosine_spec_decode_drafts_late_total", "coder"): 3.0,
             ("cosine_drafter_rtt_seconds", "coder"): 0.25,
             ("cosine_verifier_steps_total", ""): 25.0, ("cosine_verifier_steps_with_draft_total", ""): 10.0,
             ("cosine_verifier_busy_seconds_total", ""): 5.0}
    drafter = [("coder", {("cosine_drafter_busy_seconds_total", "coder"): 1.0},
                {("cosine_drafter_busy_seconds_total", "coder"): 5.0,
                 ("cosine_drafter_draft_tokens_total", "coder"): 40.0}),
               ("coder", {}, {})]  # a second replica whose /metrics did not answer
    row = bench_results.summarize([Record("cosine", 1, 1, "a", "code", "x", 9, 0.5, 2.5)], 8.0, before, after, drafter)
    assert row["pools"]["coder"]["draft_tokens"] == 20 and row["pools"]["coder"]["acceptance_rate"] == 0.75
    assert row["pools"]["coder"]["rtt_s"] == 0.25 and row["pools"]["lookup"]["draft_tokens"] == 4
    assert row["drafts_late"] == 3 and row["steps_with_draft_fraction"] == 0.5
    assert row["verifier_step_s"] == pytest.approx(4.0 / 20)
    assert row["drafters"] == {"coder": {"busy_fraction": 0.5, "draft_s_per_token": 0.1, "draft_tokens": 40.0,
                                         "replicas": 1}}
    assert row["output_tokens_per_s"] == pytest.approx(9 / 8) and row["tpot_ms_p50"] == pytest.approx(250)


def test_process_binding_and_drafter_metrics_ports_from_proc():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "drafter", "--pool", "coder",
                              "--metrics-port", "41234"])
    try:
        tree = vllm_bench._process_tree(os.getpid())
        assert child.pid in tree
        assert vllm_bench._drafter_metrics(tree) == [("coder", "http://127.0.0.1:41234/metrics")]
        mine = vllm_bench.process_binding(os.getpid())
        assert mine["cpus"] == sorted(os.sched_getaffinity(0)) and mine["threads"] >= 1
    finally:
        child.kill()
        child.wait()
    assert vllm_bench._parse_cpu_list("0-2,5\n") == {0, 1, 2, 5}


def test_repeat_workload_asks_every_prompt_twice_after_its_round(monkeypatch, tmp_path):
    mixed = [Prompt(f"{d}{i}", d, f"{d} {i}") for i in range(2) for d in workloads.DOMAINS]
    again = workloads.repeated(mixed)
    assert [p.id for p in again[:8]] == [*(p.id for p in mixed[:4]), *(f"{p.id}-again" for p in mixed[:4])]
    assert len(again) == 16 and [p.prompt for p in again[4:8]] == [p.prompt for p in mixed[:4]]
    monkeypatch.setenv("COSINE_CACHE", str(tmp_path))
    workloads.write(workloads.workloads_dir() / "mixed.jsonl", mixed)
    assert workloads.load(workloads.resolve_workload("repeat")) == again  # derived from mixed on first use


def test_auto_runs_cosine_as_serve_chose_and_every_other_system_on_every_core():
    assert vllm_bench.system_placement("cosine", "auto", "lookup") == ("cosine", "lookup")
    assert vllm_bench.system_placement("cosine-nofusion", "auto", "split") == ("cosine-nofusion", "split")
    assert vllm_bench.system_placement("cosine-lookup", "auto", "split") == ("cosine-lookup", "overlap")
    assert vllm_bench.system_placement("vllm-suffix", "auto") == ("vllm-suffix", "overlap")
    assert vllm_bench.placement_threads("lookup", 2) == (2, 1)


def test_a_system_may_carry_its_own_placement():
    assert vllm_bench.system_placement("cosine@shared", "split") == ("cosine", "shared")
    assert vllm_bench.system_placement("vllm-suffix", "split") == ("vllm-suffix", "split")
    runs = vllm_bench.plan_runs(["cosine", "cosine@shared"], [1])
    assert [r.system for r in runs] == ["vllm", "cosine", "cosine@shared", "vllm"]
    with pytest.raises(ValueError, match="placement"):
        vllm_bench.system_placement("cosine@both", "split")
    with pytest.raises(ValueError, match="unknown system"):
        vllm_bench.plan_runs(["cosyne@shared"], [1])


def test_peer_command_runs_vllm_alone_or_with_its_own_method(monkeypatch, tmp_path):
    """Catches: a vLLM-only system started with CoSine's proposer, or not started at all (the
    command built from the manifest's verifier as the real servers are)."""
    from cosine import model_store

    monkeypatch.setattr(model_store, "resolve", lambda name: tmp_path / name)
    for system, method in (("vllm", None), ("vllm-ngram", "ngram"), ("vllm-suffix", "suffix")):
        argv, _ = vllm_bench.peer_command(system, load_manifest(None), 8000, "drafter", 4, 4, {})
        text = " ".join(argv)
        assert "CoSineScheduler" not in text and "cosine.vllm_hooks" not in text, system
        assert (f'"method":"{method}"' in text) == (method is not None), (system, text)


def test_repeats_interleave_and_ratios_come_from_medians_with_their_spread():
    runs = vllm_bench.plan_runs(["vllm", "vllm-suffix", "cosine"], [1], repeat=3)
    assert [r.system for r in runs] == ["vllm", "vllm-suffix", "cosine", "cosine", "vllm-suffix", "vllm",
                                        "vllm", "vllm-suffix", "cosine"]
    with pytest.raises(ValueError, match="repeat"):
        vllm_bench.plan_runs(["vllm"], [1], repeat=0)
    tps = {"vllm": [10.0, 8.0, 9.0], "vllm-suffix": [11.0, 8.0, 10.0], "cosine": [12.0, 9.0, 9.0]}
    rows = [{"system": r.system, "run": r.run, "concurrency": 1, "tpot_ms_p50": 50.0, "mean_acceptance_length": 1.4,
             "steps_with_draft_fraction": 0.4, "output_tokens_per_s": tps[r.system].pop(0)} for r in runs]
    summary = {e["system"]: e for e in bench_results.summarize_repeats(rows)}
    cosine = summary["cosine"]
    assert cosine["runs"] == 3 and cosine["output_tokens_per_s"] == 9.0
    assert cosine["ratio_vs_vllm"] == 9.0 / 8.0 and cosine["ratio_vs_vllm_spread"] == [1.0, 1.2]  # 12/10, 9/8, 9/9
    assert cosine["best_vllm_speculation"] == "vllm-suffix"
    assert cosine["ratio_vs_best_vllm_speculation_spread"] == [0.9, 9 / 8]  # 12/11, 9/8, 9/10
    report = {"rows": [], "summary": list(summary.values()), "repeat": 3}
    assert "medians over 3 runs" in bench_results.format_table(report)


def test_the_summary_gives_each_domain_and_its_slowest_prompt_against_vllm():
    """Catches: a domain's loss hidden in the level's total, per-domain ratios not paired run by run
    with the reference's, or a prompt's slowdown hidden in its domain's mean."""
    runs = vllm_bench.plan_runs(["vllm", "cosine"], [4], repeat=2)  # vllm cosine cosine vllm
    chat = {"vllm": [10.0, 8.0], "cosine": [9.0, 8.0]}
    rows = [{"system": r.system, "run": r.run, "concurrency": 4, "output_tokens_per_s": 10.0,
             "per_domain_tokens_per_s": {"chat": chat[r.system].pop(0), "code": 10.0 if r.system == "vllm" else 30.0}}
            for r in runs]

    def rec(system: str, run: int, prompt: str, domain: str, latency: float) -> bench_results.Record:
        return bench_results.Record(system, run, 4, prompt, domain, "", 48, 1.0, latency)

    records = [rec("vllm", 0, "chat-a", "chat", 4.0), rec("vllm", 3, "chat-a", "chat", 4.0),
               rec("vllm", 0, "chat-b", "chat", 4.0), rec("vllm", 3, "chat-b", "chat", 4.0),
               rec("cosine", 1, "chat-a", "chat", 3.0), rec("cosine", 2, "chat-a", "chat", 3.0),
               rec("cosine", 1, "chat-b", "chat", 5.0), rec("cosine", 2, "chat-b", "chat", 5.0)]
    cosine = {e["system"]: e for e in bench_results.summarize_repeats(rows, records)}["cosine"]
    # i-th run against the i-th: 9/10 and 8/8
    assert cosine["ratio_vs_vllm_per_domain"] == {"chat": [0.95, 0.9, 1.0], "code": [3.0, 3.0, 3.0]}
    prompt, ratio = cosine["slowest_prompt_vs_vllm"]["chat"]
    assert prompt == "chat-b" and ratio == pytest.approx(4.0 / 5.0)
    table = bench_results.format_table({"rows": [], "summary": [cosine], "repeat": 2})
    assert "chat 0.95 [0.9-1] (slowest 0.8)" in table
    open_loop = bench_results.format_table({"rows": [], "summary": [cosine], "repeat": 2, "request_rate": 0.2})
    assert "open loop at 0.2 requests/s: tok/s follows the arrival rate" in open_loop


def test_the_closed_loop_sends_the_next_prompt_when_a_client_is_free(monkeypatch):
    """Two clients, four prompts of 0.2 s each: two are sent at once, the next two when the first
    two answers end; each record keeps when it was sent (`start_s`, from the run's start)."""
    import asyncio
    import time

    from cosine.tooling import demo

    def slow_ask(client, model, prompt, max_tokens):
        time.sleep(0.2)
        return demo.Answer(prompt, prompt.id, 3, 0.05, 0.2)

    monkeypatch.setattr(demo, "ask", slow_ask)
    prompts = [Prompt(f"p{i}", "chat", "hi") for i in range(4)]
    records = asyncio.run(vllm_bench._load("http://127.0.0.1:9", "m", prompts, 2, 8, "vllm", 0))
    starts = sorted(r.start_s for r in records)
    assert starts[1] < 0.1 and 0.2 <= starts[2] < 0.35 and starts[3] < 0.35, starts
    assert sorted(r.text for r in records) == ["p0", "p1", "p2", "p3"]


def test_the_open_loop_sends_at_vllms_poisson_times_the_same_for_every_run(monkeypatch):
    """`--request-rate`: prompts arrive at vLLM's own Poisson times (`get_request`), the same in
    every run, whatever the answers take; the level caps the requests in flight, and a request that
    arrives with the cap reached is sent when a slot frees."""
    import asyncio
    import time

    from cosine.tooling import demo

    def slow_ask(client, model, prompt, max_tokens):
        time.sleep(0.3)
        return demo.Answer(prompt, prompt.id, 3, 0.05, 0.3)

    monkeypatch.setattr(demo, "ask", slow_ask)
    prompts = [Prompt(f"p{i}", "chat", "hi") for i in range(6)]

    def starts(concurrency):
        records = asyncio.run(vllm_bench._load("http://127.0.0.1:9", "m", prompts, concurrency, 8, "vllm", 0,
                                               request_rate=10.0))
        return [r.start_s for r in sorted(records, key=lambda r: r.prompt_id)]

    first, again = starts(8), starts(8)
    assert all(abs(a - b) < 0.05 for a, b in zip(first, again, strict=True)), (first, again)  # seeded
    assert first == sorted(first) and first[-1] == pytest.approx(len(prompts) / 10.0, abs=0.05)  # vLLM normalises
    capped = starts(2)  # two in flight: the third waits for the first answer, the rest for theirs
    assert capped[:2] == pytest.approx(first[:2], abs=0.05)
    assert all(c >= a - 0.01 for c, a in zip(capped, first, strict=True))
    assert capped[2] >= capped[0] + 0.3 - 0.01 and capped[-1] >= 2 * 0.3 - 0.01, (capped, first)
    with pytest.raises(ValueError, match="--request-rate must be > 0"):
        asyncio.run(vllm_bench._load("http://127.0.0.1:9", "m", prompts, 2, 8, "vllm", 0, request_rate=0.0))
