"""The load benchmark end to end on tiny chat models: closed loop at two concurrency levels and an
open-loop run produce the issue's fields, identity with target-only, and consistent ratios."""

from __future__ import annotations

import json

import pytest

from cosine.bench import BenchConfig
from cosine.load_bench import plot_load, run_load_bench
from cosine.runtime.speculation_control import SpeculationSettings
from cosine.workloads import Prompt

PROMPTS = [Prompt(f"p{i}", d, t) for i, (d, t) in enumerate([
    ("chat", "Hello, how are you today?"), ("code", "def add(a, b):\n    return a + b\n"),
    ("chat", "The quick brown fox jumps over the lazy dog."), ("code", "Speculative decoding drafts tokens."),
])]


@pytest.fixture
def pair(make_chat_runner):
    return make_chat_runner(seed=0, name="tiny-target"), make_chat_runner(seed=0, name="tiny-drafter")


def test_closed_loop_rows_have_the_issue_fields(pair, tmp_path):
    target, drafter = pair
    config = BenchConfig(max_tokens=12, threads=1, speculation=SpeculationSettings(max_draft_tokens=4))
    report = run_load_bench(PROMPTS, target, drafter, ["target-only", "single-coder", "cosine", "cosine-pipelined"],
                            config, concurrencies=(1, 3))
    rows = report["results"]
    assert {(r["system"], r["concurrency"]) for r in rows if r["domain"] == "all"} == {
        (s, c) for s in ("target-only", "single-coder", "cosine", "cosine-pipelined") for c in (1, 3)
    }
    for r in rows:
        assert r["identical_to_target"], r
        assert r["verifier_idle_fraction"] is None or 0 <= r["verifier_idle_fraction"] <= 1
        assert r["latency_s_p50"] <= r["latency_s_p99"]
    spec = next(r for r in rows if r["system"] == "single-coder" and r["domain"] == "all" and r["concurrency"] == 3)
    assert spec["mean_acceptance_length"] > 1  # the drafter is the target's twin: drafts get accepted
    base = next(r for r in rows if r["system"] == "target-only" and r["domain"] == "all" and r["concurrency"] == 3)
    assert base["speedup_vs_target_only"] == 1.0
    assert spec["speedup_vs_target_only"] == pytest.approx(
        spec["output_tokens_per_s"] / base["output_tokens_per_s"], rel=0.01)
    json.dumps(report)
    plot_load(report, tmp_path / "load.png")
    assert (tmp_path / "load.png").stat().st_size > 0


def test_open_loop_rows_carry_the_request_rate(pair):
    target, drafter = pair
    report = run_load_bench(PROMPTS, target, drafter, ["target-only", "cosine"], BenchConfig(max_tokens=8, threads=1),
                            request_rate=20.0)
    rows = [r for r in report["results"] if r["domain"] == "all"]
    assert {r["system"] for r in rows} == {"target-only", "cosine"}
    assert all(r["request_rate"] == 20.0 and r["concurrency"] is None for r in rows)
    with pytest.raises(ValueError, match="concurrency"):
        run_load_bench(PROMPTS, target, drafter, ["cosine"], BenchConfig(), concurrencies=(0,))
