"""Admission checks beyond CEL: tokenizer compatibility and child-name length, with field paths."""

from __future__ import annotations

import pytest
from cosine_spec.catalogue import tokenizer_family

from cosine_operator.webhook import validate_cluster


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("qwen2.5-coder-1.5b-instruct", "qwen2"),
        ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "qwen2"),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "qwen2"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2"),
        ("google/gemma-3-270m", "gemma3"),
        ("/models/my-own-model", None),
    ],
)
def test_tokenizer_family(name: str, family: str | None) -> None:
    assert tokenizer_family(name) == family


def spec(*pools: dict) -> dict:
    return {"verifier": {"model": "qwen2.5-coder-1.5b-instruct"}, "drafterPools": list(pools)}


def test_same_family_ngram_and_unknown_models_pass() -> None:
    assert (
        validate_cluster(
            "demo",
            spec(
                {"name": "code", "model": "Qwen/Qwen2.5-Coder-0.5B-Instruct"},
                {"name": "ngram", "kind": "ngram"},
                {"name": "local", "model": "/models/custom"},
            ),
        )
        == []
    )


def test_incompatible_tokenizer_is_rejected_with_the_field_path() -> None:
    problems = validate_cluster(
        "demo",
        spec(
            {"name": "code", "model": "qwen2.5-coder-0.5b-instruct"},
            {"name": "chat", "model": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        ),
    )
    assert len(problems) == 1
    assert problems[0].startswith("spec.drafterPools[1].model: tokenizer family 'smollm2'")
    assert "spec.drafterPools[1].translateTokenizer: true" in problems[0]


def test_translate_tokenizer_or_declared_tokenizer_decide() -> None:
    assert (
        validate_cluster(
            "demo",
            spec(
                {"name": "chat", "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "translateTokenizer": True}
            ),
        )
        == []
    )
    problems = validate_cluster("demo", spec({"name": "x", "model": "/models/x", "tokenizer": "gemma-3"}))
    assert problems and problems[0].startswith("spec.drafterPools[0].tokenizer:")


def test_child_names_must_fit_a_dns_label() -> None:
    problems = validate_cluster("a" * 40, spec({"name": "b" * 20, "kind": "ngram"}))
    assert problems and problems[0].startswith("spec.drafterPools[0].name:")


def test_the_model_pull_job_name_must_fit_a_label() -> None:
    body = spec({"name": "p", "kind": "ngram"})
    body["modelCache"] = {"size": "10Gi"}
    assert validate_cluster("a" * 47, body) == []
    problems = validate_cluster("a" * 48, body)
    assert problems and problems[0].startswith("spec.modelCache:")


def test_either_engine_on_either_device_passes() -> None:
    gpu = {"limits": {"nvidia.com/gpu": 1}}
    assert validate_cluster(
        "demo",
        spec(
            {"name": "offload", "model": "qwen2.5-coder-0.5b-instruct", "engine": "llamacpp", "resources": gpu},
            {"name": "cpu", "model": "qwen2.5-coder-0.5b-instruct", "engine": "vllm"},
        ),
    ) == []


def test_a_spec_the_schema_would_reject_names_its_field() -> None:
    body = {**spec({"name": "ngram", "kind": "ngram"}), "speculation": {"maxDraftLen": 64}}
    problems = validate_cluster("demo", body)
    assert problems == ["spec.speculation.maxDraftLen must be in [0, 32], got 64"]


def test_a_negative_price_or_objective_is_refused_with_the_field() -> None:
    body = spec({"name": "code", "model": "qwen2.5-coder-0.5b-instruct", "pricePerHourUsd": -1})
    assert validate_cluster("demo", body) == ["spec.drafterPools[0].pricePerHourUsd must be >= 0, got -1.0"]
    body = {**spec({"name": "ngram", "kind": "ngram"}), "autoscaling": {"acceptedTokenValuePerMillionUsd": -2}}
    assert validate_cluster("demo", body) == ["spec.autoscaling.acceptedTokenValuePerMillionUsd must be >= 0, got -2.0"]


def test_pass_through_pod_fields_beyond_restricted_are_refused_with_the_field() -> None:
    host = {"name": "host", "hostPath": {"path": "/var/run"}}
    problems = validate_cluster("demo", {
        "verifier": {"model": "qwen2.5-coder-1.5b-instruct", "volumes": [{"name": "ok", "emptyDir": {}}, host]},
        "drafterPools": [{"name": "ngram", "kind": "ngram",
                          "volumes": [{"name": "n", "nfs": {"server": "x", "path": "/"}}],
                          "volumeMounts": [{"name": "n", "mountPath": "/n", "mountPropagation": "Bidirectional"}]}]})
    assert [p.split(":")[0] for p in problems] == [
        "spec.verifier.volumes[1].hostPath", "spec.drafterPools[0].volumes[0].nfs",
        "spec.drafterPools[0].volumeMounts[0].mountPropagation"]
    # what restricted admits passes
    assert validate_cluster("demo", {
        "verifier": {"model": "qwen2.5-coder-1.5b-instruct",
                     "volumes": [{"name": "c", "configMap": {"name": "x"}}, {"name": "p", "persistentVolumeClaim":
                                                                             {"claimName": "y"}}]},
        "drafterPools": [{"name": "ngram", "kind": "ngram"}]}) == []


def test_a_llamacpp_pool_needs_a_gguf_source() -> None:
    """llama.cpp loads GGUF files: a CPU pool (llama.cpp by default) on a safetensors-only Hub model
    would crash-loop; refused naming the field and the ways out."""
    def problems(pool: dict) -> list[str]:
        return validate_cluster("demo", spec({"name": "p", **pool}))

    (bad,) = problems({"model": "Qwen/Qwen2.5-Coder-3B-Instruct"})
    assert bad.startswith("spec.drafterPools[0].model:") and "GGUF" in bad and "engine: vllm" in bad
    assert problems({"model": "Qwen/Qwen2.5-Coder-3B-Instruct-GGUF"}) == []
    assert problems({"model": "Qwen/Qwen2.5-Coder-3B-Instruct", "engine": "vllm"}) == []
    assert problems({"model": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}) == []  # its GGUF is on PyPI
    assert problems({"model": "/models/mine/model.gguf"}) == []
    gpu = {"resources": {"limits": {"nvidia.com/gpu": 1}}}
    assert problems({"model": "Qwen/Qwen2.5-Coder-3B-Instruct", **gpu}) == []  # vLLM on a GPU pod


@pytest.mark.parametrize(
    ("pool", "speculation", "field"),
    [
        ({}, {"maxDraftLenn": 4}, "spec.speculation.maxDraftLenn"),
        ({"replicas": True}, {}, "spec.drafterPools[0].replicas"),
        ({"model": 123}, {}, "spec.drafterPools[0].model"),
    ],
)
def test_a_typo_or_a_coercible_value_is_refused_at_admission(pool, speculation, field) -> None:
    body = {**spec({"name": "code", "model": "qwen2.5-coder-0.5b-instruct", **pool}), "speculation": speculation}
    (problem,) = validate_cluster("demo", body)
    assert problem.startswith(field + ":")


def test_a_model_uri_of_an_unknown_scheme_is_refused_at_admission() -> None:
    """The pull would fail in the cluster; admission names the field instead."""
    got = validate_cluster("demo", {"verifier": {"model": "azure://c/qwen2.5-coder-1.5b-instruct"},
                                    "drafterPools": [{"name": "p", "model": "s3://bucket/qwen2.5-coder-0.5b.gguf"}]})
    assert len(got) == 1 and got[0].startswith("spec.verifier.model: unknown URI scheme 'azure'")
    assert validate_cluster("demo", {"verifier": {"model": "hf://Qwen/Qwen2.5-Coder-1.5B-Instruct"},
                                     "drafterPools": [{"name": "p", "model": "gs://b/Qwen2.5-Coder-0.5B-GGUF"}]}) == []


def test_a_llamacpp_pool_by_uri_needs_a_gguf_there() -> None:
    """An hf:// URI names the Hub alone: a registry model by hf:// has no GGUF from PyPI, so a
    llama.cpp pool on it would crash-loop; an object store's .gguf object or *-GGUF repo passes."""
    def problems(model: str) -> list[str]:
        return validate_cluster("demo", spec({"name": "p", "model": model}))

    (bad,) = problems("hf://Qwen/Qwen2.5-Coder-0.5B-Instruct")
    assert bad.startswith("spec.drafterPools[0].model:") and "s3:// or gs:// object" in bad
    assert problems("s3://b/models/qwen2.5-coder-0.5b-instruct") != []
    assert problems("hf://Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF@main") == []
    assert problems("s3://b/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") == []


GPU = {"resources": {"limits": {"nvidia.com/gpu": 1}}}


def test_one_gpu_verifier_that_cannot_surge_is_admitted_with_a_warning() -> None:
    """Catches: a lone GPU verifier (``maxSurge`` 0 by default) admitted without a word, though
    every roll takes it down for a whole model load; a warning where a successor starts first."""
    from cosine_operator.webhook import cluster_warnings, cosinecluster_validate

    def warned(verifier: dict, **rest: object) -> list[str]:
        body = {"verifier": {"model": "qwen2.5-coder-1.5b-instruct", **verifier},
                "drafterPools": [{"name": "ngram", "kind": "ngram"}], **rest}
        assert validate_cluster("demo", body) == []  # admitted either way
        warnings: list[str] = []
        cosinecluster_validate(name="demo", spec=body, warnings=warnings)
        assert warnings == cluster_warnings(body)
        return warnings

    (warning,) = warned(GPU)
    assert warning.startswith("spec.verifier.replicas:") and "spec.verifier.rollout.maxSurge: 1" in warning
    assert warned({**GPU, "strategy": {"type": "Recreate"}})
    assert warned({**GPU, "rollout": {"maxSurge": 0}})
    assert warned({**GPU, "parallelism": {"nodes": 2}})  # a group rolls without a surge too
    assert warned({**GPU, "rollout": {"maxSurge": 1}}) == []
    assert warned({**GPU, "rollout": {"maxSurge": 1}, "parallelism": {"nodes": 2}}) == []
    assert warned({**GPU, "replicas": 2}) == []  # one goes at a time, one serves
    assert warned({**GPU, "replicas": 2, "strategy": {"type": "Recreate"}})
    assert warned({**GPU, "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "10%",
                                                                                   "maxUnavailable": 0}}}) == []
    # a surge that may still take the old pod down first, or percentages that both round to 0
    assert warned({**GPU, "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1,
                                                                                   "maxUnavailable": 1}}})
    assert warned({**GPU, "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "0%",
                                                                                   "maxUnavailable": "10%"}}})
    assert warned({}) == []  # a CPU verifier surges by Kubernetes' default (25%, one pod)
    assert cluster_warnings({"verifier": {}}) == []  # refused elsewhere, no warning to add


def test_rollout_surge_and_a_verbatim_strategy_are_one_or_the_other() -> None:
    (problem,) = validate_cluster("demo", {
        "verifier": {"model": "qwen2.5-coder-1.5b-instruct", **GPU, "rollout": {"maxSurge": 1},
                     "strategy": {"type": "Recreate"}},
        "drafterPools": [{"name": "ngram", "kind": "ngram"}]})
    assert problem.startswith("spec.verifier.rollout.maxSurge and spec.verifier.strategy: set one")


@pytest.mark.parametrize(("arg", "flag"), [("--speculative_config", "--speculative-config"),
                                           ("--async_scheduling", "--async-scheduling"),
                                           ("--scheduler_cls=x.Y", "--scheduler-cls"),
                                           ("--max_model_len=4096", "--max-model-len")])
def test_an_engine_arg_cosine_sets_is_refused_in_vllms_other_spellings(arg: str, flag: str) -> None:
    """Catches: the webhook comparing dash spellings only, so that underscores or `--flag=value`
    (vLLM reads both, and takes the last value) replaced CoSine's speculative config, scheduler
    or lengths."""
    body = {"verifier": {"model": "qwen2.5-coder-1.5b-instruct", "engineArgs": ["--enforce-eager", arg]},
            "drafterPools": [{"name": "ngram", "kind": "ngram"}]}
    (problem,) = validate_cluster("demo", body)
    assert problem.startswith(f"spec.verifier.engineArgs[1]: {flag} is set by CoSine (vLLM reads {arg!r}"), problem
