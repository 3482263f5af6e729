"""Process roles: `cosine drafter`, `cosine verifier`, `cosine serve` (embedded multi-process cluster).

Wiring only. A role reads a `CoSineCluster` manifest (the object the operator
reconciles; in a pod it is the ConfigMap's `cluster.yaml`), loads its model and serves:
- drafter: the gRPC drafter service for one pool (+ Prometheus /metrics on its own port);
- verifier: vLLM's OpenAI-compatible server on the target model (completions, chat, streaming,
  `/health`, `/metrics` with vLLM's `vllm:` series), CoSine's proposer under its engine
  (`runtime/src/cosine/vllm_hooks.py`) with the remote drafter pools at the given addresses, and CoSine's
  per-pool `cosine_` series on `--metrics-port`;
- serve: the embedded cluster (`cosine.embedded`): one `cosine drafter` process per drafter
  replica on loopback ports, then `cosine verifier` as a child, on the cores `placement.plan`
  gives them; every child dies with it however it dies (`cosine.processes`).
Manifests are read by `cosine.manifest`.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cosine_spec.contract import LWS_LEADER_ADDRESS, LWS_WORKER_INDEX

from cosine.manifest import Manifest, load_manifest
from cosine.processes import wait_for_signal

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- drafter


DRAIN_MARGIN_S = 3  # of a drafter's grace, kept to stop its server and exit before SIGKILL


def run_drafter(manifest: Manifest, pool: str, grpc_port: int, metrics_port: int, host: str,
                tls_dir: str | None = None) -> int:
    """Serve one pool's drafter over gRPC (TLS with `tls_dir`'s tls.crt/tls.key, else plaintext)
    until SIGTERM or SIGINT, then drain (`drafter_service.drain`): NOT_SERVING on gRPC health,
    calls answered until its requests are handed back or the pool's grace (less a margin) is
    over; returns 0."""
    from prometheus_client import start_http_server

    from cosine.transport.drafter_service import DrafterMetrics, DrafterServicer, drain, serve

    spec = manifest.spec
    p = spec.pool(pool)
    engine, vocab, family = drafter_engine(p, spec.verifier)
    metrics = DrafterMetrics(pool)
    metrics.manifest_unknown_fields.set(len(manifest.unknown))
    servicer = DrafterServicer(engine, pool, family, model=p.model or p.kind, metrics=metrics, vocab_size=vocab,
                               min_confidence=spec.speculation.min_confidence)
    server = serve(servicer, grpc_port, host=host, tls_dir=tls_dir)
    if metrics_port:
        start_http_server(metrics_port, addr=host, registry=metrics.registry)
    wait_for_signal()
    # SIGTERM (a scale-down, a rollout, a spot node's notice): hand the requests back within the
    # pod's grace, less the time to stop the server and exit
    drain(server, servicer, timeout_s=max(1, p.grace_s(spec.spot) - DRAIN_MARGIN_S))
    servicer.close()
    return 0


def drafter_engine(pool, verifier):
    """(engine, vocabulary size, tokenizer family) a pool drafts on and reports to the verifier.

    - `kind: ngram`: the model-free n-gram drafter;
    - `engine: llamacpp` (CPU pools' default): llama.cpp on the model's GGUF file, `threads` threads;
    - `engine: vllm` (GPU pools' default): the model on a vLLM engine with prefix caching;
    - `translateTokenizer: true` with another vocabulary than the verifier's: the model drafts on
      llama.cpp through a `CrossTokenizerDrafter` (in the verifier's vocabulary, so the pool
      reports the verifier's vocabulary size and tokenizer family; the verifier's tokenizer must
      be in the model store).

    Raises:
        cosine.model_store.ModelNotAvailable: the drafter's (or, to translate, the
            verifier's) model, or its GGUF file, is not in the local cache.
    """
    from cosine import draft_engine
    from cosine.model_store import resolve, resolve_gguf, tokenizer_family

    if pool.kind == "ngram":
        from cosine.lookup import LookupDrafter

        return draft_engine.SequentialEngine(LookupDrafter(name=pool.name)), 0, ""
    if pool.translate_tokenizer:
        from transformers import AutoConfig, AutoTokenizer

        from cosine.cross_tokenizer_drafter import CrossTokenizerDrafter, same_vocabulary

        path = resolve(verifier.model)
        target_tokenizer = AutoTokenizer.from_pretrained(path)
        own_tokenizer = AutoTokenizer.from_pretrained(resolve(pool.model))
        if not same_vocabulary(own_tokenizer, target_tokenizer):
            log.info("pool %s: translating drafts of %s into %s's vocabulary (llama.cpp)", pool.name, pool.model,
                     verifier.model)
            engine = draft_engine.LlamaCppEngine(str(resolve_gguf(pool.model)), pool.name, threads=pool.threads)
            runner = draft_engine.LlamaCppRunner(engine, own_tokenizer, pool.name)
            drafter = CrossTokenizerDrafter(runner, target_tokenizer, name=pool.name)
            vocab = int(AutoConfig.from_pretrained(path).vocab_size)
            return draft_engine.SequentialEngine(drafter, vocab), vocab, tokenizer_family(verifier.model) or ""
        log.info("pool %s: %s shares %s's vocabulary; no translation needed", pool.name, pool.model, verifier.model)
    family = tokenizer_family(pool.model) or ""
    if pool.resolved_engine == "vllm":
        engine = draft_engine.VllmEngine(str(resolve(pool.model)), pool.name, **vllm_drafter_options(pool, verifier))
        return engine, engine.vocab_size, family
    engine = draft_engine.LlamaCppEngine(str(resolve_gguf(pool.model)), pool.name, threads=pool.threads)
    return engine, engine.vocab_size, family


def vllm_drafter_options(pool: Any, verifier: Any) -> dict[str, Any]:
    """`VllmEngine` options of an `engine: vllm` pool (`DrafterPoolSpec`): the verifier's dtype;
    on a pod that requests GPUs, CUDA graphs (a drafter's steps are small: launch overhead is most
    of them) and the pool's `gpuMemoryUtilization` (None: vLLM's 0.9, too much for pools that
    share a GPU); on CPU, eager (no CUDA graphs; torch.compile's start-up does not pay)."""
    gpu = pool.pod.requests_gpu
    return {"dtype": verifier.dtype, "enforce_eager": not gpu,
            "gpu_memory_utilization": pool.gpu_memory_utilization if gpu else None}


# ---------------------------------------------------------------- verifier


def run_verifier(
    manifest: Manifest, http_port: int, host: str, drafters: list[str], api_key: str | None,
    metrics_port: int = 0, drafter_tls_dir: str | None = None, drafter_tls_server_name: str | None = None,
    cores: Sequence[int] = (),
) -> int:
    """Replace this process with vLLM's OpenAI-compatible server running the target model, with
    CoSine's proposer under its engine (`vllm_hooks`) and the given remote drafter pools; on a
    CPU, its engine threads bound to `cores` when given."""
    argv, env = verifier_command(manifest, http_port, host, drafters, api_key, metrics_port, cores,
                                 drafter_tls_dir=drafter_tls_dir, drafter_tls_server_name=drafter_tls_server_name)
    log.info("verifier: vLLM OpenAI server on http://%s:%d/v1 (drafters %s)", host, http_port, drafters or "none")
    os.execve(sys.executable, argv, env)
    return 0  # not reached


def verifier_command(
    manifest: Manifest, http_port: int, host: str, drafters: list[str], api_key: str | None,
    metrics_port: int = 0, cores: Sequence[int] = (), *, drafter_tls_dir: str | None = None,
    drafter_tls_server_name: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the verifier: `python -m <vLLM's API server> <engine flags>`; on a
    CPU, its engine threads bound to `cores` when given (else vLLM's own binding). With
    `drafter_tls_dir` the proposer dials the pools over TLS (`transport.tls`), checking their
    certificate against `drafter_tls_server_name` (default: each address's host). With `api_key`
    (passed in the environment), every route but the probes' and `/metrics` asks for it
    (`vllm_hooks.ApiKeyOnEveryRoute`, through vLLM's `--middleware`).

    Raises:
        ValueError: a `--drafter` that is not POOL=ADDRESS, or a pool not in the manifest.
        cosine.model_store.ModelNotAvailable: the target is not in the model cache.
    """
    from cosine.model_store import resolve

    spec = manifest.spec
    by_name: dict[str, dict[str, Any]] = {}
    for item in drafters:  # a pool named again adds a replica address
        name, _, address = item.partition("=")
        if not address:
            raise ValueError(f"--drafter must be POOL=ADDRESS, got {item!r}")
        try:
            pool = spec.pool(name)
        except KeyError:
            raise ValueError(f"--drafter {item!r}: no drafter pool {name!r} in the manifest") from None
        entry = by_name.setdefault(name, {"name": name, "addresses": [], "expertise": list(pool.expertise),
                                          "price_per_hour_usd": pool.replica_price_per_hour_usd})
        entry["addresses"].append(address)
        if drafter_tls_dir:
            entry.update(tls_dir=drafter_tls_dir, tls_server_name=drafter_tls_server_name)
    pools = list(by_name.values())
    model_path = str(resolve(spec.verifier.model))
    args = vllm_engine_args(spec.verifier, model_path, spec.speculation, pools, metrics_port,
                            token_value_usd=spec.autoscaling.accepted_token_value_per_million_usd / 1e6)
    argv = [sys.executable, "-m", VLLM_SERVER, *cli_flags(args), "--host", host, "--port", str(http_port),
            "--uvicorn-log-level", "warning"]
    if api_key:  # vLLM's own check guards only /v1, /v2, /inference and /cohere: the key on every route
        from cosine.vllm_hooks import API_KEY_MIDDLEWARE

        argv += ["--middleware", API_KEY_MIDDLEWARE]
    argv += spec.verifier.engine_args
    env = {**os.environ, **vllm_cpu_env(spec.verifier, cores)}
    # prometheus_client's multi-process mode, fresh for this server: vLLM's OpenAI server then
    # serves on its /metrics what its engine-core process writes too, the proposer's
    # cosine_suffix_tree_* gauges among it (`metrics.SuffixAffinity`), where an endpoint picker reads
    env.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="cosine-verifier-metrics-"))
    if api_key:
        env["VLLM_API_KEY"] = api_key  # not on the command line, where `ps` shows it
    return argv, env


VLLM_SERVER = "vllm.entrypoints.launchers.api_server.entry"  # `vllm serve` (the `vllm` CLI needs the `vllm` dist name)


def vllm_engine_args(verifier, model_path: str, speculation, pools: list[dict[str, Any]],
                     metrics_port: int = 0, env: Mapping[str, str] | None = None,
                     token_value_usd: float = 0.0) -> dict[str, Any]:
    """The verifier spec (`spec.verifier`) as vLLM engine arguments (`EngineArgs` field names):
    model, dtype, maxBatchTokens -> max_num_batched_tokens, maxModelLen, maxNumSeqs,
    gpuMemoryUtilization (GPU pods; kvCacheSpaceGiB is the CPU pods' `vllm_cpu_env`).

    `spec.verifier.parallelism` becomes vLLM's parallel layout (`parallel_args`: by default the
    pod's GPUs are the tensor-parallel size; across nodes, the node rank and the leader's address
    come from `env`, default this process's); without GPUs the engine runs eagerly on the CPU (`vllm-cpu`).
    `speculation` (`spec.speculation`, a `SpeculationSpec`) goes to the proposer as itself; its
    `max_draft_len` 0 serves the target alone (no speculative path at all). The engine's own drafter
    (`spec.verifier.speculator`) is pulled through the model store like the target.
    `token_value_usd`: an accepted draft token's value, with each pool's `price_per_hour_usd` what
    the proposer prices a pool's ask by (`pool_policy.PoolPolicy.ask_pays`).

    Raises:
        cosine.model_store.ModelNotAvailable: the speculator's model is not in the model cache.
    """
    from cosine import vllm_hooks
    from cosine.model_store import resolve

    gpus = verifier.pod.gpu_count
    args: dict[str, Any] = {
        "model": model_path,
        "served_model_name": [verifier.model],
        "dtype": verifier.dtype,
        "max_num_batched_tokens": verifier.max_batch_tokens,
        "seed": 0,
        # drain on SIGTERM: in-flight requests finish, new ones are refused, within what the pod's
        # grace period leaves (spec.verifier.terminationGracePeriodSeconds)
        "shutdown_timeout": verifier.shutdown_timeout_s,
    }
    args.update(parallel_args(verifier, env))
    if gpus == 0:
        args["enforce_eager"] = True  # CPU: no CUDA graphs; torch.compile start-up does not pay here
    for key, value in (("max_model_len", verifier.max_model_len), ("max_num_seqs", verifier.max_num_seqs),
                       ("gpu_memory_utilization", verifier.gpu_memory_utilization if gpus else None)):
        if value is not None:
            args[key] = value
    if speculation.max_draft_len > 0:
        sp = verifier.speculator
        sp_model = str(resolve(sp.model)) if sp is not None and sp.model else None
        if sp is not None:
            _check_speculator(sp.method, Path(model_path), Path(sp_model) if sp_model else None)
        args.update(vllm_hooks.engine_kwargs(speculation, sp, sp_model, cpu=gpus == 0, pools=pools,
                                             model=model_path, metrics_port=metrics_port,
                                             token_value_usd=token_value_usd))
    return args


def _check_speculator(method: str, target: Path, drafter: Path | None) -> None:
    """Raise ValueError (the field named) when the engine drafter cannot run on this target, from
    the models' configs (`sources.engine.fit_problems`); a directory without a config.json (a name
    vLLM resolves itself) is not checked here."""
    import json

    from cosine.sources.engine import fit_problems

    def config(path: Path | None) -> dict[str, Any] | None:
        file = path / "config.json" if path is not None else None
        return json.loads(file.read_text()) if file is not None and file.exists() else None

    target_config = config(target)
    if target_config is None or (drafter is not None and config(drafter) is None):
        return
    problems = fit_problems(method, target_config, config(drafter))
    if problems:
        raise ValueError("; ".join(problems))


MASTER_PORT = 29500  # torch.distributed's store on the leader (vLLM's --master-port default)


def parallel_args(verifier, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """vLLM's parallel layout of one verifier replica (`spec.verifier.parallelism`): tensor- and
    pipeline-parallel sizes; with `nodes` > 1 vLLM's multi-node mode without Ray (`nnodes`,
    `node_rank` from LeaderWorkerSet's `LWS_WORKER_INDEX`, `master_addr` its `LWS_LEADER_ADDRESS`,
    the `mp` executor). Empty for one rank. Raises KeyError when `nodes` > 1 and `env` (default:
    this process's) lacks LeaderWorkerSet's variables: the pod was not started by a LeaderWorkerSet."""
    p = verifier.parallelism
    tensor = verifier.tensor_parallel
    out: dict[str, Any] = {}
    if tensor > 1:
        out["tensor_parallel_size"] = tensor
    if p.pipeline > 1:
        out["pipeline_parallel_size"] = p.pipeline
    if p.nodes > 1:
        env = os.environ if env is None else env
        out.update(distributed_executor_backend="mp", nnodes=p.nodes, node_rank=int(env[LWS_WORKER_INDEX]),
                   master_addr=env[LWS_LEADER_ADDRESS], master_port=MASTER_PORT)
    return out


def worker_command(manifest: Manifest, env: Mapping[str, str] | None = None) -> list[str]:
    """argv of a multi-node verifier's worker (`cosine verifier-worker`, a LeaderWorkerSet worker
    pod): `vllm serve --headless`, the engine alone with the leader's engine arguments (so every
    rank builds the same model, speculative path included) and its own node rank; no API server,
    no proposer (the leader's engine core schedules and drafts).

    Raises:
        ValueError: the verifier does not span nodes (`parallelism.nodes` is 1).
        KeyError: LeaderWorkerSet's variables are missing from `env`.
        cosine.model_store.ModelNotAvailable: the target is not in the model cache.
    """
    from cosine.model_store import resolve

    spec = manifest.spec
    if spec.verifier.nodes < 2:
        raise ValueError("cosine verifier-worker runs a worker of a multi-node verifier: "
                         "spec.verifier.parallelism.nodes is 1")
    model_path = str(resolve(spec.verifier.model))
    args = vllm_engine_args(spec.verifier, model_path, spec.speculation, [], 0, env)
    model = args.pop("model")
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--headless", *cli_flags(args),
            *spec.verifier.engine_args]


def run_verifier_worker(manifest: Manifest) -> int:
    """Replace this process with a multi-node verifier's engine worker (`worker_command`)."""
    argv = worker_command(manifest)
    log.info("verifier worker: vLLM headless engine, node rank %s of %d", os.environ.get(LWS_WORKER_INDEX),
             manifest.spec.verifier.nodes)
    os.execve(sys.executable, argv, dict(os.environ))
    return 0  # not reached


def vllm_cpu_env(verifier, cores: Sequence[int] = ()) -> dict[str, str]:
    """Environment vLLM's CPU backend wants: the KV cache size in GiB (instead of a share of
    RAM), Intel OpenMP preloaded (vLLM warns that speculative decoding is much slower without
    it) and, given `cores`, its OpenMP threads bound to exactly those (`VLLM_CPU_OMP_THREADS_BIND`,
    no core reserved: without it vLLM's "auto" binding keeps one core of a 2-core machine for its
    scheduler process and computes on the other); empty on GPU pods."""
    if verifier.pod.gpu_count:
        return {}
    space = verifier.kv_cache_space_gib
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{space:g}" if space else os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    if cores:
        from cosine.placement import cpu_list

        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cores)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists() and "libiomp5" not in os.environ.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(x for x in (str(iomp), os.environ.get("LD_PRELOAD", "")) if x)
    return env


def cli_flags(args: dict[str, Any]) -> list[str]:
    """Engine arguments as `vllm serve` flags: dicts as JSON, lists as repeated values, True as a
    bare flag, False as its `--no-` form (vLLM's boolean flags are argparse's BooleanOptionalAction),
    None left out."""
    import json

    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        elif value is None:
            continue
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        elif isinstance(value, list | tuple):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


# ---------------------------------------------------------------- serve (embedded cluster)


def run_serve(cluster: Path | None, mode: str, evidence: Path | None, port: int, host: str,
              metrics_port: int, pools_metrics_port: int = 0) -> int:
    """`cosine serve`: the manifest at `cluster` (None: the shipped one) as an embedded cluster on
    this machine (`embedded.serve`), placed by `mode` (`auto`: weighed against the bench report at
    `evidence`, `placement.plan`).

    Raises:
        ValueError: an invalid manifest (naming the field) or mode.
    """
    from cosine.embedded import serve
    from cosine.placement import plan

    report, source = bench_evidence(evidence)
    manifest = load_manifest(cluster)
    choice, where = plan(mode, manifest.spec, sorted(os.sched_getaffinity(0)), report, source)
    log.info("placement %s: %s", choice.mode, choice.reason)
    if where.shared and choice.mode == "split":
        log.warning("too few CPU cores for disjoint placement: drafters share the verifier's cores %s",
                    list(where.verifier))
    return serve(manifest, where, choice.mode, port, host, metrics_port, pools_metrics_port)


def placement_choice(mode: str, spec, evidence: Path | None):
    """`placement.decide` on this process's cores and the bench report at `evidence`: the
    placement `cosine serve --placement mode` would run (for `cosine demo` and `cosine bench`)."""
    from cosine.placement import decide

    return decide(mode, spec, sorted(os.sched_getaffinity(0)), *bench_evidence(evidence))


def bench_evidence(path: Path | None) -> tuple[Any, str]:
    """(the `cosine bench` report at `path` (default: the last bench run's,
    `model_store.last_bench_path`), its path) for `placement.decide`; the report is None when the
    file does not exist or is not JSON (logged)."""
    import json

    from cosine.model_store import last_bench_path

    path = path or last_bench_path()
    if not path.exists():
        log.info("placement evidence: none (no bench at %s)", path)
        return None, str(path)
    log.info("placement evidence: %s", path)
    try:
        return json.loads(path.read_text()), str(path)
    except ValueError as e:  # json.JSONDecodeError included
        log.warning("placement: %s is not a bench report (%s); deciding without it", path, e)
        return None, str(path)
