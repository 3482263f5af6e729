"""`cosine` command line: errors are one line and exit code 2, before any engine starts."""

import json

import pytest

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
    from cosine.manifest import load_manifest
    from cosine.model_store import last_bench_path
    from cosine.placement import EVIDENCE_KEY
    from cosine.roles import placement_choice
    from cosine.tooling import bench_results

    for command in (["serve"], ["demo"]):
        args = build_parser().parse_args(command)
        assert args.placement == "auto" and args.evidence is None  # the last bench, in the cache
    # the evidence is the last bench kept in the cache, wherever the command runs
    monkeypatch.setenv("COSINE_CACHE", str(tmp_path / "cache"))
    bench_results.write_report({"rows": []}, tmp_path / "elsewhere" / "bench.json")
    assert last_bench_path() == tmp_path / "cache" / "bench" / "last.json"
    assert last_bench_path().read_text() == (tmp_path / "elsewhere" / "bench.json").read_text()
    assert EVIDENCE_KEY in json.loads(last_bench_path().read_text())  # a finished run carries its evidence
    # a checkpoint
    bench_results.write_report({"rows": [], "complete": False}, tmp_path / "partial.json", evidence=False)
    assert (tmp_path / "partial.json").exists() and "complete" not in last_bench_path().read_text()
    # a bench that measured no pool: the pool is unmeasured and stays off this CPU verifier's cores
    c = placement_choice("auto", load_manifest(None).spec, None)
    assert c.mode == "lookup" and "not measured" in c.reason
    # no bench run at all, or one from before the evidence format: the same, with the reason
    assert placement_choice("auto", load_manifest(None).spec, tmp_path / "none.json").mode == "lookup"
    (tmp_path / "old.json").write_text(json.dumps({"rows": []}))
    assert "not measured" in placement_choice("auto", load_manifest(None).spec, tmp_path / "old.json").reason
    assert placement_choice("split", load_manifest(None).spec, None).mode == "split"


def test_the_placement_evidence_round_trips_and_refuses_a_wrong_type():
    """Catches: the bench writing figures serve cannot read (the format is the only contract)."""
    import pytest

    from cosine.placement import Evidence, evidence_document, read_evidence

    measured = Evidence(2, 1, pass_s=0.26, kept_pass_s=0.57, draft_token_s=0.04, pool_alpha=0.7, pool_use=0.9,
                        lookup_hit=0.5, lookup_alpha=0.4, lookup_tokens=3, source="bench")
    doc = json.loads(json.dumps(evidence_document(measured)))
    assert read_evidence(doc, Evidence(2, 1)) == measured
    assert read_evidence(evidence_document(Evidence(0, 0)), Evidence(4, 2)).pool_alpha is None
    doc["measured"]["pool_alpha"] = "0.7"
    with pytest.raises(ValueError, match=r"placement_evidence\.measured\.pool_alpha"):
        read_evidence(doc, Evidence(2, 1))
    with pytest.raises(ValueError, match="not a cosine.dev/placement-evidence/v1 document"):
        read_evidence({"rows": []}, Evidence(2, 1))


def test_serve_and_simulate_refuse_a_typo_naming_the_field(tmp_path, capsys):
    """Catches: a manifest read with no API server in front (`cosine serve`, `cosine simulate`)
    taking `maxDraftLenn: 4` as the default 8, `replicas: true` as 1 or `model: 123` as "123"."""
    from importlib import resources

    import yaml

    for name in ("default_cluster.yaml", "simulation/default_cluster.yaml"):
        base = yaml.safe_load(resources.files("cosine").joinpath(name).read_text())
        for path, value, field in (
            (("speculation", "maxDraftLenn"), 4, "spec.speculation.maxDraftLenn"),
            (("drafterPools", 0, "replicas"), True, "spec.drafterPools[0].replicas"),
            (("verifier", "model"), 123, "spec.verifier.model"),
        ):
            obj = yaml.safe_load(yaml.safe_dump(base))
            node = obj["spec"]
            for key in path[:-1]:
                node = node[key] if isinstance(key, int) else node.setdefault(key, {})
            node[path[-1]] = value
            manifest = tmp_path / "cluster.yaml"
            manifest.write_text(yaml.safe_dump(obj))
            command = ["serve"] if name == "default_cluster.yaml" else ["simulate", "--out", str(tmp_path / "s.json")]
            assert main([*command, "--cluster", str(manifest)]) == 2, (name, field)
            assert field in capsys.readouterr().err, (name, field)


@pytest.mark.parametrize("arg", ["--speculative_config", "--async_scheduling", "--scheduler_cls=x.Y",
                                 "--max_model_len=4096"])
def test_serve_and_verifier_refuse_an_engine_arg_cosine_sets_in_any_spelling(tmp_path, capsys, arg):
    """`cosine serve` and `cosine verifier` (a plain-manifest pod: no webhook saw it) run the
    webhook's engine-argument check before starting anything. Catches: vLLM's spellings
    (underscores, `--flag=value`) starting a server whose speculative config, scheduler or
    length a user's argument silently replaced."""
    import yaml

    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(yaml.safe_dump({
        "apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "t"},
        "spec": {"verifier": {"model": "m", "engineArgs": [arg, "{}"] if "=" not in arg else [arg]},
                 "drafterPools": [{"name": "p", "kind": "ngram"}]}}))
    for command in (["serve"], ["verifier"]):
        assert main([*command, "--cluster", str(manifest)]) == 2, command
        err = capsys.readouterr().err
        assert "spec.verifier.engineArgs[0]: --" in err and "is set by CoSine" in err, err


def test_simulate_refuses_an_unknown_study_or_mode(capsys):
    assert main(["simulate", "--studies", "paper,papr"]) == 2
    assert "--studies: unknown papr" in capsys.readouterr().err
    assert main(["simulate", "--mode", "cosin"]) == 2
    assert "--mode: unknown 'cosin'" in capsys.readouterr().err


def test_serve_reads_its_placement_without_the_bench_or_the_simulator():
    """Catches: the serving path importing tooling (the bench, the demo) or the simulator again."""
    import subprocess
    import sys

    code = ("import sys; from cosine.cli import build_parser; from cosine.roles import placement_choice; "
            "from cosine.manifest import load_manifest; import cosine.embedded; build_parser(); "
            "placement_choice('auto', load_manifest(None).spec, None); "
            "print(sorted(m for m in sys.modules if m.startswith(('cosine.tooling', 'cosine.simulation'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_bench_help_names_every_system():
    from cosine.cli import BENCH_SYSTEMS_HELP
    from cosine.tooling.bench_results import ABLATIONS, DEFAULT_SYSTEMS

    assert BENCH_SYSTEMS_HELP.startswith(",".join(DEFAULT_SYSTEMS) + " (the default), ")
    assert all(a in BENCH_SYSTEMS_HELP for a in ABLATIONS)
