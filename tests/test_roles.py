"""The verifier spec as vLLM engine arguments and server flags (`cosine.roles`), without starting vLLM."""

from __future__ import annotations

import json

import pytest
from cosine_spec.cluster_spec import SpeculationSpec, parse_cluster_spec

from cosine import roles
from cosine.manifest import load_manifest


def _verifier(**fields):
    return parse_cluster_spec({"verifier": {"model": "m", **fields}, "drafterPools": [{"name": "p"}]}).verifier


def test_cpu_verifier_maps_onto_vllm_engine_arguments():
    v = _verifier(dtype="float32", maxBatchTokens=256, maxModelLen=4096, maxNumSeqs=8, kvCacheSpaceGiB=2)
    pools = [{"name": "p", "addresses": ["a:1"], "expertise": ["code"]}]
    args = roles.vllm_engine_args(v, "/models/m", SpeculationSpec(max_draft_len=6), pools, metrics_port=9091)
    assert args["model"] == "/models/m" and args["served_model_name"] == ["m"]
    assert args["dtype"] == "float32" and args["max_num_batched_tokens"] == 256
    assert args["max_model_len"] == 4096 and args["max_num_seqs"] == 8
    assert args["enforce_eager"] is True and "tensor_parallel_size" not in args
    assert args["speculative_config"]["num_speculative_tokens"] == 6
    cosine = args["additional_config"]["cosine"]
    assert cosine["pools"] == [{"name": "p", "addresses": ["a:1"], "expertise": ["code"]}]
    assert cosine["metrics_port"] == 9091
    assert roles.vllm_cpu_env(v)["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_gpus_per_pod_are_the_tensor_parallel_size():
    v = _verifier(resources={"limits": {"nvidia.com/gpu": 4}}, gpuMemoryUtilization=0.85)
    args = roles.vllm_engine_args(v, "/models/m", SpeculationSpec(), [])
    assert args["tensor_parallel_size"] == 4 and args["gpu_memory_utilization"] == 0.85
    assert "enforce_eager" not in args
    assert roles.vllm_cpu_env(v) == {}


def test_a_gpu_vllm_pool_gets_cuda_graphs_and_its_memory_share():
    """Catches: GPU drafter pools run eager and take vLLM's default 90% of the GPU."""
    cluster = parse_cluster_spec({"verifier": {"model": "m", "dtype": "bfloat16"}, "drafterPools": [
        {"name": "gpu", "model": "d", "engine": "vllm", "gpuMemoryUtilization": 0.3,
         "resources": {"limits": {"nvidia.com/gpu": 1}}},
        {"name": "cpu", "model": "d", "engine": "vllm", "gpuMemoryUtilization": 0.3}]})
    gpu, cpu = cluster.drafter_pools
    assert roles.vllm_drafter_options(gpu, cluster.verifier) == {
        "dtype": "bfloat16", "enforce_eager": False, "gpu_memory_utilization": 0.3}
    assert roles.vllm_drafter_options(cpu, cluster.verifier) == {
        "dtype": "bfloat16", "enforce_eager": True, "gpu_memory_utilization": None}


def test_no_speculation_is_plain_vllm():
    args = roles.vllm_engine_args(_verifier(), "/models/m", SpeculationSpec(max_draft_len=0), [])
    assert "speculative_config" not in args and "scheduler_cls" not in args


def test_cli_flags():
    flags = roles.cli_flags({"model": "x", "served_model_name": ["a"], "enforce_eager": True, "seed": 0,
                             "speculative_config": {"method": "ngram"}, "off": False, "none": None})
    assert flags == ["--model", "x", "--served-model-name", "a", "--enforce-eager", "--seed", "0",
                     "--speculative-config", json.dumps({"method": "ngram"}, separators=(",", ":")), "--no-off"]


def test_verifier_command_rejects_a_drafter_not_in_the_manifest():
    with pytest.raises(ValueError, match="POOL=ADDRESS"):
        roles.verifier_command(load_manifest(None), 8000, "127.0.0.1", ["nope"], None)
    with pytest.raises(ValueError, match="no drafter pool 'other'"):
        roles.verifier_command(load_manifest(None), 8000, "127.0.0.1", ["other=1.2.3.4:5"], None)


def test_verifier_command_gathers_a_pools_replicas(monkeypatch, tmp_path):
    """`cosine serve` names a pool once per replica: the proposer gets one pool with every
    replica's address (distinct pool names, as it requires)."""
    import cosine.model_store

    monkeypatch.setattr(cosine.model_store, "resolve", lambda model: tmp_path)
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(json.dumps({
        "apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "t"},
        "spec": {"verifier": {"model": "m"}, "autoscaling": {"acceptedTokenValuePerMillionUsd": 2},
                 "drafterPools": [{"name": "coder", "model": "d", "replicas": 2, "pricePerHourUsd": 0.7}]}}))
    argv, _ = roles.verifier_command(load_manifest(manifest), 8000, "127.0.0.1",
                                     ["coder=127.0.0.1:1", "coder=127.0.0.1:2"], None)
    config = json.loads(argv[argv.index("--additional-config") + 1])["cosine"]
    assert [(p["name"], p["addresses"]) for p in config["pools"]] == [("coder", ["127.0.0.1:1", "127.0.0.1:2"])]
    # what the proposer prices an ask by (`PoolPolicy.ask_pays`): the replica's price, a token's value
    assert config["pools"][0]["price_per_hour_usd"] == 0.7 and config["token_value_usd"] == pytest.approx(2e-6)


LWS_ENV = {"LWS_LEADER_ADDRESS": "llama-verifier-0.llama-verifier.ns", "LWS_WORKER_INDEX": "1"}


def _vllm_serve_parse(argv):
    """argv (`vllm serve MODEL ...`) through vLLM's own `serve` parser and the engine's argument
    reader: what `vllm serve` would run with."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    args.model = args.model_tag
    return args, AsyncEngineArgs.from_cli_args(args)


def test_a_verifier_across_nodes_runs_vllm_multi_node_from_leader_worker_set_env(tmp_path, monkeypatch):
    """Leader and worker get one layout (tensor 8 x pipeline 2 over 2 nodes), the worker its rank
    and the leader's address, as vLLM's own `serve` parser reads them; the worker is headless and
    carries the leader's speculative path (every rank builds the same model). Catches: a worker
    with another layout than its leader (vLLM's ranks would hang), a rank or address not taken
    from LeaderWorkerSet's env, flags `vllm serve` does not know."""
    gpu = {"resources": {"limits": {"nvidia.com/gpu": 8}}, "parallelism": {"nodes": 2, "pipeline": 2}}
    v = _verifier(**gpu)
    assert v.tensor_parallel == 8
    leader = roles.vllm_engine_args(v, "/models/m", SpeculationSpec(), [], env={**LWS_ENV, "LWS_WORKER_INDEX": "0"})
    assert leader["nnodes"] == 2 and leader["node_rank"] == 0
    manifest_path = tmp_path / "cluster.yaml"
    manifest_path.write_text(json.dumps({"apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster",
                                         "metadata": {"name": "llama"},
                                         "spec": {"verifier": {"model": "m", **gpu},
                                                  "drafterPools": [{"name": "p", "kind": "ngram"}]}}))
    monkeypatch.setattr("cosine.model_store.resolve", lambda model: f"/models/{model}")
    argv = roles.worker_command(load_manifest(manifest_path), LWS_ENV)
    assert argv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/models/m"]
    args, engine = _vllm_serve_parse(argv[4:])
    assert args.headless is True
    assert (engine.tensor_parallel_size, engine.pipeline_parallel_size) == (8, 2)
    assert (engine.nnodes, engine.node_rank, engine.master_addr) == (2, 1, LWS_ENV["LWS_LEADER_ADDRESS"])
    assert engine.distributed_executor_backend == "mp"
    # the leader's speculative path: a GPU verifier runs vLLM's Model Runner V2, so CoSine's MRV2 seam
    # (vLLM's device lookup inside, async scheduling on)
    assert engine.speculative_config["method"] == "ngram_gpu" and engine.async_scheduling is True
    with pytest.raises(KeyError):
        roles.parallel_args(v, {})  # not started by a LeaderWorkerSet
    one_node = tmp_path / "one.yaml"
    one_node.write_text(manifest_path.read_text().replace('"nodes": 2', '"nodes": 1'))
    with pytest.raises(ValueError, match="parallelism.nodes is 1"):
        roles.worker_command(load_manifest(one_node), LWS_ENV)


def test_the_engines_own_drafter_and_extra_engine_args_reach_vllm_serve(tmp_path, monkeypatch):
    """`spec.verifier.speculator` and `engineArgs` as vLLM's own `serve` parser reads the verifier's
    argv: vLLM's draft_model method on the draft model's path with greedy draft sampling, async
    scheduling off (else the engine never hands the drafts to CoSine's scheduler), vLLM-CPU's
    repaired worker on a CPU pod, and the extra arguments after CoSine's. Catches: flags `vllm
    serve` does not know, `False` dropped instead of written as `--no-...`."""
    (tmp_path / "m").mkdir()
    (tmp_path / "d").mkdir()
    monkeypatch.setattr("cosine.model_store.resolve", lambda model: tmp_path / model)
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(json.dumps({
        "apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "t"},
        "spec": {"verifier": {"model": "m", "speculator": {"method": "draftModel", "model": "d"},
                              "engineArgs": ["--kv-cache-dtype", "fp8", "--served-model-name", "team-model"]},
                 "drafterPools": [{"name": "p", "kind": "ngram"}], "speculation": {"maxDraftLen": 3}}}))
    argv, _ = roles.verifier_command(load_manifest(manifest), 8000, "127.0.0.1", [], None)
    flags = argv[argv.index(roles.VLLM_SERVER) + 1:]
    i = flags.index("--model")
    _, engine = _vllm_serve_parse([flags[i + 1], *flags[:i], *flags[i + 2:]])
    assert engine.speculative_config == {"method": "draft_model", "model": str(tmp_path / "d"),
                                         "draft_sample_method": "greedy", "num_speculative_tokens": 3}
    assert engine.async_scheduling is False and engine.worker_cls == "cosine.vllm_cpu_worker.LosslessCPUWorker"
    assert engine.kv_cache_dtype == "fp8" and engine.served_model_name == ["team-model"]
    config = json.loads(argv[argv.index("--additional-config") + 1])["cosine"]
    assert config["engine_source"] == "draftModel"


def test_the_api_key_guards_every_route_through_vllms_middleware_flag(tmp_path, monkeypatch):
    """With a key (`COSINE_API_KEY`, from `spec.gateway.apiKeySecretRef`) the verifier's argv asks
    vLLM's own parser for CoSine's middleware, which puts the key on every route; the key itself
    travels in the environment. Catches: the key left to vLLM's check alone (paths under /v1, /v2,
    /inference and /cohere only: /invocations runs completions without it)."""
    monkeypatch.setattr("cosine.model_store.resolve", lambda model: tmp_path / model)
    (tmp_path / "m").mkdir()
    manifest = tmp_path / "cluster.yaml"
    spec = {"verifier": {"model": "m"}, "drafterPools": [{"name": "p", "kind": "ngram"}]}
    manifest.write_text(json.dumps({"apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster",
                                    "metadata": {"name": "t"}, "spec": spec}))
    for key, middleware in (("s3cret", ["cosine.vllm_hooks.ApiKeyOnEveryRoute"]), (None, [])):
        argv, env = roles.verifier_command(load_manifest(manifest), 8000, "127.0.0.1", [], key)
        flags = argv[argv.index(roles.VLLM_SERVER) + 1:]
        i = flags.index("--model")
        args, _ = _vllm_serve_parse([flags[i + 1], *flags[:i], *flags[i + 2:]])
        assert args.middleware == middleware and args.api_key is None
        assert env.get("VLLM_API_KEY") == key and "s3cret" not in argv


def test_reserved_engine_args_are_every_spelling_of_their_flags_in_vllms_parser():
    """`RESERVED_ENGINE_ARGS` against vLLM 0.32's own `serve` parser: every option string of a
    reserved flag's destination is listed (aliases: `-sc`, `-n`, `-r`,
    `--device-memory-utilization`), no other option is refused (no false alarm on a flag CoSine
    leaves to users), and each odd spelling the check refuses is one vLLM reads as that flag.
    Catches: a vLLM upgrade adding an alias, a check of dash spellings only."""
    from cosine_spec.verifier_spec import RESERVED_ENGINE_ARGS, reserved_flag, vllm_flag
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    dest = {o: a.dest for a in parser._actions for o in a.option_strings}
    reserved_dests = {dest[f] for f in RESERVED_ENGINE_ARGS}
    assert {o for o, d in dest.items() if d in reserved_dests} == set(RESERVED_ENGINE_ARGS)
    assert [o for o, d in dest.items() if d not in reserved_dests and reserved_flag(vllm_flag(o))] == []
    defaults = vars(parser.parse_args([]))
    for argv, name in ((["--speculative_config", '{"method": "ngram"}'], "speculative_config"),
                       (["--speculative-config.method", "ngram"], "speculative_config"),
                       (["--speculative_config.num_speculative_tokens=5"], "speculative_config"),
                       (["-sc.method", "ngram"], "speculative_config"), (["-s", "{}"], "speculative_config"),
                       (["--async_scheduling"], "async_scheduling"), (["--no-async"], "async_scheduling"),
                       (["--scheduler_cls=x.Y"], "scheduler_cls"), (["--max_model_len=4096"], "max_model_len"),
                       (["--max-model", "4096"], "max_model_len"), (["-tp=2"], "tensor_parallel_size"),
                       (["-n2"], "nnodes"), (["-r1"], "node_rank"), (["--api_key=k"], "api_key"),
                       (["--device_memory_utilization=0.5"], "gpu_memory_utilization")):
        assert vars(parser.parse_args(argv))[name] != defaults[name], argv  # vLLM sets the flag
        assert reserved_flag(vllm_flag(argv[0])) in RESERVED_ENGINE_ARGS, argv  # CoSine refuses it


def test_pool_prices_and_the_token_value_reach_the_proposer():
    """What the proposer prices a pool's ask by (`PoolPolicy.ask_pays`) travels from the spec to the
    engine core: each pool's replica price with its addresses, the value of an accepted token
    (`spec.autoscaling.acceptedTokenValuePerMillionUsd` / 1e6) beside them."""
    from cosine import vllm_hooks

    pools = [{"name": "p", "addresses": ["127.0.0.1:1"], "expertise": [], "price_per_hour_usd": 0.7}]
    args = roles.vllm_engine_args(_verifier(), "/models/m", SpeculationSpec(), pools, token_value_usd=2e-6)
    config = {**args["additional_config"]["cosine"], "model": None}  # (no tokenizer to load here)
    proposer = vllm_hooks.build_proposer(config)
    try:
        assert proposer.settings.pool.token_value_usd == pytest.approx(2e-6)
        assert proposer.settings.pool.pool_prices == (("p", 0.7),)
    finally:
        proposer.close()
    unpriced = vllm_hooks.build_proposer(vllm_hooks.proposer_config(pools=[{"name": "q", "addresses": ["h:1"]}]))
    assert unpriced.settings.pool.token_value_usd == 0 and unpriced.settings.pool.pool_prices == (("q", 0.0),)
    unpriced.close()
