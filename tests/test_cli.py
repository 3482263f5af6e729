"""`cosine` command line: errors are one line and exit code 2, before any engine starts."""

from cosine.cli import build_parser, main


def test_generate_errors_are_clear(capsys):
    assert main(["generate", "--prompt", "hi", "--max-tokens", "0"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--target", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_generate_and_bench_flags():
    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert (args.max_tokens, args.max_draft_len, args.temperature) == (128, 8, 0.0)
    args = build_parser().parse_args(["bench"])
    assert (args.concurrency, args.placement, args.systems) == ("1,4,8", "auto", "")


def test_serve_and_demo_place_by_measurement_by_default(tmp_path, monkeypatch):
    from cosine.cli import _placement_choice
    from cosine.roles import load_manifest
    from cosine.tooling import vllm_bench

    for command in (["serve"], ["demo"]):
        args = build_parser().parse_args(command)
        assert args.placement == "auto" and args.evidence is None  # the last bench, in the cache
    # the evidence is the last bench kept in the cache, wherever the command runs
    monkeypatch.setenv("COSINE_CACHE", str(tmp_path / "cache"))
    vllm_bench.write_report({"rows": []}, tmp_path / "elsewhere" / "bench.json")
    assert vllm_bench.last_bench_path() == tmp_path / "cache" / "bench" / "last.json"
    assert vllm_bench.last_bench_path().read_text() == (tmp_path / "elsewhere" / "bench.json").read_text()
    vllm_bench.write_report({"rows": [], "complete": False}, tmp_path / "partial.json", evidence=False)  # a checkpoint
    assert (tmp_path / "partial.json").exists() and "complete" not in vllm_bench.last_bench_path().read_text()
    # no bench run yet: the pool is unmeasured and stays off this CPU verifier's cores
    c = _placement_choice("auto", load_manifest(None), tmp_path / "bench.json")
    assert c.mode == "lookup" and "not measured" in c.reason
    assert _placement_choice("split", load_manifest(None), None).mode == "split"
