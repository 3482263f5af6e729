"""Typed spec views (cosine_spec.cluster_spec and its parts): the strict parser, bounds against the CRD (whose
field facts `make crds` writes from these declarations: tests/spec/test_crdgen.py), the drafter
engine's default rule, the one tokenizer-family table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from cosine_spec.catalogue import KNOWN_MODELS, gguf_source, model_source_problems, tokenizer_family
from cosine_spec.cluster_spec import (
    DRAFTER_ENGINES,
    MAX_DRAFT_LEN,
    ClusterSpec,
    ModelCacheSpec,
    ModelCredentialsSecretRef,
    SpeculationSpec,
    parse_cluster_spec,
)
from cosine_spec.verifier_spec import SpeculatorSpec, engine_args_problems, speculator_problems

from cosine_operator.config import OperatorConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
GPU = {"limits": {"nvidia.com/gpu": 1}}


def _spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "cosine.dev_cosineclusters.yaml").read_text())
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])


def _speculation_schema() -> dict[str, Any]:
    return dict(_spec_schema()["properties"]["speculation"]["properties"])


def _engine_schema() -> dict[str, Any]:
    return dict(_spec_schema()["properties"]["drafterPools"]["items"]["properties"]["engine"])


def _cluster(*pools: dict[str, Any], **spec: Any) -> ClusterSpec:
    return parse_cluster_spec({"verifier": {"model": "m"}, "drafterPools": list(pools), **spec})


def test_parse_names_the_offending_field() -> None:
    """Catches: bounds not enforced by the parser, or errors that do not say where."""
    with pytest.raises(ValueError, match=r"^spec\.drafterPools\[1\]\.replicas must be >= 0"):
        _cluster({"name": "a", "model": "m"}, {"name": "b", "model": "m", "replicas": -1})
    with pytest.raises(ValueError, match=r"^spec\.verifier\.dtype must be one of"):
        parse_cluster_spec({"verifier": {"model": "m", "dtype": "int4"}, "drafterPools": [{"name": "p"}]})
    with pytest.raises(ValueError, match=r"^spec\.drafterPools\[0\]\.name is required"):
        _cluster({"model": "m"})
    with pytest.raises(ValueError, match=r"^spec\.autoscaling\.enabled: expected true or false"):
        _cluster({"name": "p"}, autoscaling={"enabled": "no"})


def test_gpu_count_from_limits_or_requests() -> None:
    assert _cluster({"name": "p", "resources": GPU}).drafter_pools[0].pod.gpu_count == 1
    requested = {"requests": {"nvidia.com/gpu": "2"}}
    assert _cluster({"name": "p", "resources": requested}).drafter_pools[0].pod.gpu_count == 2
    assert _cluster({"name": "p"}).drafter_pools[0].pod.gpu_count == 0


def test_the_model_store_reads_the_one_tokenizer_table() -> None:
    """Catches: a second family table (the model store naming a family the webhook does not)."""
    from cosine import model_store

    for source in KNOWN_MODELS.values():
        assert source.tokenizer_family == tokenizer_family(source.name) == tokenizer_family(source.hf_repo)
        assert model_store.tokenizer_family(source.hf_repo) == source.tokenizer_family
    assert model_store.tokenizer_family("meta-llama/Llama-3.2-1B") == tokenizer_family("Llama-3.2-1B") == "llama3"


def test_speculation_is_parsed() -> None:
    got = _cluster(
        {"name": "p", "model": "m"},
        speculation={"maxDraftLen": 4, "adaptive": False, "fusion": False, "minConfidence": 0.4},
    ).speculation
    assert got == SpeculationSpec(max_draft_len=4, adaptive=False, fusion=False, min_confidence=0.4)


def test_speculation_bounds_agree_with_the_crd() -> None:
    crd = _speculation_schema()
    k_min, k_max = crd["maxDraftLen"]["minimum"], crd["maxDraftLen"]["maximum"]
    c_min, c_max = crd["minConfidence"]["minimum"], crd["minConfidence"]["maximum"]
    assert MAX_DRAFT_LEN == k_max
    assert (c_min, c_max) == (0, 1)
    SpeculationSpec(max_draft_len=k_min, min_confidence=c_min)
    SpeculationSpec(max_draft_len=k_max, min_confidence=c_max)
    for bad in ({"max_draft_len": k_min - 1}, {"max_draft_len": k_max + 1},
                {"min_confidence": c_min - 0.01}, {"min_confidence": c_max + 0.01}):
        with pytest.raises(ValueError, match=r"^spec\.speculation\."):
            SpeculationSpec(**bad)


def test_engine_enum_and_documented_default_match_the_code() -> None:
    crd = _engine_schema()
    assert tuple(crd["enum"]) == DRAFTER_ENGINES
    assert "default" not in crd  # it depends on the device: resolved_engine decides
    assert "default: llamacpp when the pool requests no nvidia.com/gpu, vllm otherwise" in " ".join(
        crd["description"].split()
    )


@pytest.mark.parametrize(
    ("pool", "engine"),
    [
        ({"model": "m"}, "llamacpp"),
        ({"model": "m", "resources": {"requests": {"cpu": "2"}}}, "llamacpp"),
        ({"model": "m", "resources": GPU}, "vllm"),
        ({"model": "m", "resources": {"requests": {"nvidia.com/gpu": 1}}}, "vllm"),
        ({"model": "m", "engine": "llamacpp", "resources": GPU}, "llamacpp"),  # llama.cpp offloads
        ({"model": "m", "engine": "vllm"}, "vllm"),  # vLLM's CPU build
        ({"kind": "ngram"}, None),
    ],
)
def test_resolved_engine(pool: dict[str, Any], engine: str | None) -> None:
    got = _cluster({"name": "p", **pool}).drafter_pools[0]
    assert got.engine == pool.get("engine")
    assert got.resolved_engine == engine


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_name_each_model_pools_engine_for_its_device(path: Path) -> None:
    cluster = parse_cluster_spec(yaml.safe_load(path.read_text())["spec"])
    for pool in cluster.drafter_pools:
        if pool.kind == "model":
            assert pool.engine == ("vllm" if pool.pod.requests_gpu else "llamacpp"), pool.name
        else:
            assert pool.engine is None


def test_network_policy_and_drafter_tls_parse() -> None:
    """Catches: policies off by default, metricsFrom not kept verbatim, a drafterTLS without its
    Secret accepted, the operator's identity not read from its environment."""
    plain = _cluster({"name": "p", "kind": "ngram"})
    assert plain.network_policy.enabled and plain.network_policy.metrics_from == () and plain.drafter_tls is None
    peer = {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}
    c = _cluster({"name": "p", "kind": "ngram"}, networkPolicy={"enabled": False, "metricsFrom": [peer]},
                 drafterTLS={"secretName": "tls", "serverName": "drafters"})
    assert not c.network_policy.enabled and c.network_policy.metrics_from == (peer,)
    assert (c.drafter_tls.secret_name, c.drafter_tls.server_name) == ("tls", "drafters")
    with pytest.raises(ValueError, match=r"spec\.drafterTLS\.secretName is required"):
        _cluster({"name": "p", "kind": "ngram"}, drafterTLS={"serverName": "x"})
    config = OperatorConfig.from_env(
        {"COSINE_OPERATOR_NAMESPACE": "ops", "COSINE_OPERATOR_POD_LABELS": "a=1, b=two"}
    )
    assert (config.namespace, dict(config.pod_labels)) == ("ops", {"a": "1", "b": "two"})
    assert OperatorConfig.from_env({}).pod_labels == {}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"speculation": {"maxDraftLenn": 4}},
         r"^spec\.speculation\.maxDraftLenn: unknown field; did you mean 'maxDraftLen'\?"),
        ({"speculation": {"maxDraftLen": 3.9}},
         r"^spec\.speculation\.maxDraftLen: expected an integer, got number 3\.9"),
        ({"drafterPools": [{"name": "p", "replicas": True}]},
         r"^spec\.drafterPools\[0\]\.replicas: expected an integer, got boolean"),
        ({"drafterPools": [{"name": "p", "maxReplica": 9}]},
         r"^spec\.drafterPools\[0\]\.maxReplica: unknown field; did you mean 'maxReplicas'\?"),
        ({"verifier": {"model": 123}}, r"^spec\.verifier\.model: expected a string, got integer 123"),
        ({"verifier": {"model": "m", "image": {"tagg": "x"}}}, r"^spec\.verifier\.image\.tagg: unknown field"),
        ({"drafterPools": [{"name": "p", "resources": []}]},
         r"^spec\.drafterPools\[0\]\.resources: expected an object, got array"),
        ({"drafterPools": [{"name": "p", "expertise": ["code", 1]}]},
         r"^spec\.drafterPools\[0\]\.expertise: expected a string, got integer 1"),
        ({"gateway": {"apiKeySecretRef": {"name": "a", "key": "b", "keys": "c"}}},
         r"^spec\.gateway\.apiKeySecretRef\.keys: unknown field"),
        ({"drafterPool": []}, r"^spec\.drafterPool: unknown field; did you mean 'drafterPools'\?"),
        ({"router": {"weights": {"prefix": 1}}},
         r"^spec\.router\.weights\.prefix: unknown field; did you mean 'prefixCache'\?"),
        ({"router": {"enabled": True}}, r"^spec\.router\.gatewayName is required"),
        ({"router": {"failureMode": "Open"}}, r"^spec\.router\.failureMode must be one of"),
        ({"verifier": {"model": "m", "parallelism": {"node": 2}}},
         r"^spec\.verifier\.parallelism\.node: unknown field; did you mean 'nodes'\?"),
        ({"verifier": {"model": "m", "parallelism": {"nodes": "2"}}},
         r"^spec\.verifier\.parallelism\.nodes: expected an integer, got string"),
        ({"verifier": {"model": "m", "speculator": {"method": "medusa"}}},  # V1 runner only in vLLM 0.32
         r"^spec\.verifier\.speculator\.method must be one of \['eagle3', 'eagle', 'mtp', 'draftModel', 'dflash', "
         r"'dspark'\]"),
        ({"verifier": {"model": "m", "speculator": {"method": "ngram_gpu"}}},  # prompt lookup is CoSine's own
         r"^spec\.verifier\.speculator\.method must be one of"),
        ({"verifier": {"model": "m", "speculator": {"model": "h"}}},
         r"^spec\.verifier\.speculator\.method is required"),
        ({"verifier": {"model": "m", "speculator": {"method": "mtp", "models": "h"}}},
         r"^spec\.verifier\.speculator\.models: unknown field; did you mean 'model'\?"),
        ({"gateway": {"loadBalancerSourceRanges": ["10.0.0.0/8"]}},
         r"^spec\.gateway\.loadBalancerSourceRanges needs spec\.gateway\.serviceType: LoadBalancer"),
        ({"gateway": {"serviceType": "NodePort", "loadBalancerClass": "service.k8s.aws/nlb"}},
         r"^spec\.gateway\.loadBalancerClass needs spec\.gateway\.serviceType: LoadBalancer"),
        ({"router": {"provider": "gcp"}}, r"^spec\.router\.provider must be one of"),
    ],
)
def test_a_typo_or_a_wrong_type_is_refused_naming_the_field(spec: dict[str, Any], message: str) -> None:
    """Catches: a misspelt key silently left at its default (``maxDraftLenn: 4`` leaving 8), a value
    coerced into another (``3.9`` → 3, ``true`` → 1, ``123`` → ``"123"``): the API server's strict
    field validation refuses both, so ``cosine serve``, ``cosine simulate`` and the webhook must."""
    full = {"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}], **spec}
    with pytest.raises(ValueError, match=message):
        parse_cluster_spec(full)


def test_integral_numbers_and_ints_for_numbers_are_read_as_the_server_reads_them() -> None:
    """Catches: strictness refusing what JSON decoding gives the API server (``3.0`` for an integer,
    ``1`` for a number)."""
    got = _cluster({"name": "p", "kind": "ngram", "pricePerHourUsd": 1}, speculation={"maxDraftLen": 3.0})
    assert got.speculation.max_draft_len == 3 and isinstance(got.speculation.max_draft_len, int)
    assert got.drafter_pools[0].price_per_hour_usd == 1.0


def test_speculator_problems_name_what_the_spec_alone_shows() -> None:
    """Catches: an engine drafter without the model it drafts with, an MTP speculator given a model,
    and pipeline parallelism (vLLM drafts on the last stage only, through a batch queue)."""
    def problems(speculator: dict[str, Any], **verifier: Any) -> list[str]:
        cluster = _cluster({"name": "p", "kind": "ngram"}, verifier={"model": "m", "speculator": speculator,
                                                                     **verifier})
        return speculator_problems(cluster.verifier)

    assert problems({"method": "draftModel", "model": "qwen2.5-coder-0.5b-instruct"}) == []
    assert problems({"method": "mtp"}) == []
    assert problems({"method": "eagle3"}) == ["spec.verifier.speculator.model is required for method eagle3"]
    assert problems({"method": "mtp", "model": "x"})[0].startswith("spec.verifier.speculator.model must be empty")
    assert "pipeline" in problems({"method": "mtp"}, parallelism={"pipeline": 2})[0]
    parsed = _cluster({"name": "p", "kind": "ngram"}, verifier={"model": "m", "speculator": {"method": "mtp"}})
    assert parsed.verifier.speculator == SpeculatorSpec("mtp") and parsed.verifier.speculator.vllm_method == "mtp"


def test_engine_args_that_cosine_sets_itself_are_refused_naming_the_entry() -> None:
    """Catches: a user's `--speculative-config` or `--port` silently replacing CoSine's (its proposer
    would be gone), or two ways to set the dtype."""
    def problems(*args: str) -> list[str]:
        return engine_args_problems(_cluster({"name": "p", "kind": "ngram"},
                                               verifier={"model": "m", "engineArgs": list(args)}).verifier)

    assert problems("--quantization", "fp8", "--kv-cache-dtype=fp8", "--served-model-name", "x") == []
    got = problems("--kv-cache-dtype", "fp8", "--speculative-config={}", "--dtype", "half")
    assert [p.split(":")[0] for p in got] == ["spec.verifier.engineArgs[2]", "spec.verifier.engineArgs[3]"]
    assert problems("--enable_prefix_caching", "-q", "awq", "-O3", "--limit-mm-per-prompt.image=2", "-dp", "1",
                    "--max-loras", "-1", "--model-impl=vllm", "--served_model_name=x", "--no-enable-log-requests") == []


@pytest.mark.parametrize(("arg", "flag", "field"), [
    # vLLM's parser reads each of these as the flag (tests/test_roles.py checks that with its own parser)
    ("--speculative_config", "--speculative-config", "spec.speculation"),
    ("--speculative-config.method", "--speculative-config", "spec.speculation"),
    ("--speculative_config.num_speculative_tokens=5", "--speculative-config", "spec.speculation"),
    ("-sc", "-sc", "spec.speculation"),
    ("--async_scheduling", "--async-scheduling", "proposer"),
    ("--no-async", "--no-async-scheduling", "proposer"),
    ("--scheduler_cls=x.Y", "--scheduler-cls", "proposer"),
    ("--max_model_len=4096", "--max-model-len", "spec.verifier.maxModelLen"),
    ("--max-model", "--max-model-len", "spec.verifier.maxModelLen"),
    ("--device_memory_utilization=0.5", "--device-memory-utilization", "spec.verifier.gpuMemoryUtilization"),
    ("-tp=2", "-tp", "spec.verifier.parallelism.tensor"),
    ("-n2", "-n", "spec.verifier.parallelism.nodes"),
    ("--api_key=k", "--api-key", "spec.gateway.apiKeySecretRef"),
    ("--config=extra.yaml", "--config", "a config file"),
])
def test_every_spelling_vllm_reads_of_a_flag_cosine_sets_is_refused(arg: str, flag: str, field: str) -> None:
    """Catches: underscores, `--flag=value`, a JSON field (`--flag.key`), an abbreviation or an
    alias slipping past a check of dash spellings only, so that vLLM (the last value wins) silently
    replaced CoSine's speculative config, scheduler or lengths."""
    spec = _cluster({"name": "p", "kind": "ngram"}, verifier={"model": "m", "engineArgs": ["--seed", "1", arg, "v"]})
    (problem,) = engine_args_problems(spec.verifier)
    assert problem.startswith(f"spec.verifier.engineArgs[2]: {flag} is set by CoSine") and field in problem, problem
    with pytest.raises(ValueError, match=r"^spec\.verifier\.engineArgs: expected a string, got integer 8"):
        _cluster({"name": "p", "kind": "ngram"}, verifier={"model": "m", "engineArgs": ["--x", 8]})


def test_a_model_uri_of_an_unknown_scheme_is_refused_naming_its_field() -> None:
    """Catches: a pull Job that fails in the cluster (or a pod that waits for a model never pulled)
    on a URI scheme no puller serves, or one naming no model, where admission could say which field."""
    def problems(verifier: str, pool: str = "qwen2.5-coder-0.5b-instruct", speculator: str | None = None
                 ) -> list[str]:
        sp = {"speculator": {"method": "draftModel", "model": speculator}} if speculator else {}
        return model_source_problems(_cluster({"name": "p", "model": pool}, verifier={"model": verifier, **sp}))

    assert problems("hf://Qwen/Qwen2.5-Coder-1.5B-Instruct@main", "s3://bucket/models/qwen-0.5b",
                    "gs://bucket/qwen/draft") == []
    assert problems("/models/mine", "Qwen/Qwen2.5-Coder-0.5B-Instruct") == []
    (bad,) = problems("azure://container/model")
    assert bad.startswith("spec.verifier.model: unknown URI scheme 'azure'") and "hf://, s3://, gs://" in bad
    assert [p.split(":")[0] for p in problems("m", "HTTP://host/x", "ftp://h/x")] == [
        "spec.verifier.speculator.model", "spec.drafterPools[0].model"]
    assert problems("s3://bucket-only/") == ["spec.verifier.model: 's3://bucket-only/' names no model: "
                                             "s3:// takes BUCKET/PATH"]
    assert "OWNER/NAME" in problems("hf://just-a-name")[0]


def test_gguf_sources_of_uris() -> None:
    """A llama.cpp pool's GGUF by URI: an object or prefix naming a GGUF, a Hub repo of GGUF files."""
    assert gguf_source("s3://b/models/qwen2.5-0.5b-q4_k_m.gguf") == "uri"
    assert gguf_source("gs://b/Qwen2.5-0.5B-GGUF/") == "uri"
    assert gguf_source("s3://b/models/qwen2.5-0.5b") is None  # safetensors: llama.cpp cannot load it
    assert gguf_source("hf://Qwen/Qwen2.5-Coder-3B-Instruct-GGUF@main") == "hub"
    assert gguf_source("hf://Qwen/Qwen2.5-Coder-0.5B-Instruct") is None  # hf:// names the Hub alone, not PyPI
    assert gguf_source("hf://Qwen/Qwen2.5-Coder-3B-Instruct") is None


def test_a_prepopulated_cache_and_model_credentials_parse() -> None:
    """Catches: a pre-populated cache on a claim the operator would create (empty: every pod would
    wait for models nobody pulls), and a credentials Secret the spec drops."""
    cluster = _cluster({"name": "p", "kind": "ngram"}, modelCache={"claimName": "weights", "prePopulated": True},
                       modelCredentialsSecretRef={"name": "store-keys"})
    assert cluster.model_cache is not None and cluster.model_cache.pre_populated
    assert cluster.model_credentials == ModelCredentialsSecretRef("store-keys")
    assert _cluster({"name": "p", "kind": "ngram"}, modelCache={}).model_cache == ModelCacheSpec()
    with pytest.raises(ValueError, match=r"^spec\.modelCache\.prePopulated needs spec\.modelCache\.claimName"):
        _cluster({"name": "p", "kind": "ngram"}, modelCache={"prePopulated": True})
    with pytest.raises(ValueError, match=r"^spec\.modelCredentialsSecretRef\.key: unknown field"):
        _cluster({"name": "p", "kind": "ngram"}, modelCredentialsSecretRef={"name": "x", "key": "y"})
    schema = _spec_schema()["properties"]
    assert schema["modelCredentialsSecretRef"]["required"] == ["name"]
    assert "prePopulated" in schema["modelCache"]["properties"]
