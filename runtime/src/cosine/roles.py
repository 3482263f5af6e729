"""Process roles: `cosine drafter`, `cosine verifier`, `cosine serve` (embedded multi-process cluster).

Wiring only. A role reads a `CoSineCluster` manifest (the object the operator
reconciles; in a pod it is the ConfigMap's `cluster.yaml`), loads its model and serves:
- drafter: the gRPC drafter service for one pool (+ Prometheus /metrics on its own port);
- verifier: vLLM's OpenAI-compatible server on the target model (completions, chat, streaming,
  `/health`, `/metrics` with vLLM's `vllm:` series), CoSine's proposer under its engine
  (`runtime/src/cosine/vllm_hooks.py`) with the remote drafter pools at the given addresses, and CoSine's
  per-pool `cosine:` series on `--metrics-port`;
- serve: a supervisor that starts one `cosine drafter` process per drafter replica on loopback
  ports, waits for their health checks, then runs the verifier as a child and stops every
  child on Ctrl-C / SIGTERM; every child dies with it however it dies (`cosine.processes`).
Manifests are read by `cosine.manifest`; child processes are `cosine.processes`'.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cosine.manifest import Manifest
from cosine.processes import die_with_parent, free_port, start_reaper, stop_group, stop_reaper, wait_for_signal

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- drafter


def run_drafter(manifest: Manifest, pool: str, grpc_port: int, metrics_port: int, host: str,
                tls_dir: str | None = None) -> int:
    """Serve one pool's drafter over gRPC (TLS with `tls_dir`'s tls.crt/tls.key, else plaintext)."""
    from prometheus_client import start_http_server

    from cosine.transport.drafter_service import DrafterMetrics, DrafterServicer, serve

    spec = manifest.spec
    p = spec.pool(pool)
    engine, vocab, family = drafter_engine(p, spec.verifier)
    metrics = DrafterMetrics(pool)
    servicer = DrafterServicer(engine, pool, family, model=p.model or p.kind, metrics=metrics, vocab_size=vocab,
                               min_confidence=spec.speculation.min_confidence)
    server = serve(servicer, grpc_port, host=host, tls_dir=tls_dir)
    if metrics_port:
        start_http_server(metrics_port, addr=host, registry=metrics.registry)
    wait_for_signal()
    server.stop(grace=2).wait()
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
) -> int:
    """Replace this process with vLLM's OpenAI-compatible server running the target model, with
    CoSine's proposer under its engine (`vllm_hooks`) and the given remote drafter pools."""
    argv, env = verifier_command(manifest, http_port, host, drafters, api_key, metrics_port,
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
    certificate against `drafter_tls_server_name` (default: each address's host).

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
        entry = by_name.setdefault(name, {"name": name, "addresses": [], "expertise": list(pool.expertise)})
        entry["addresses"].append(address)
        if drafter_tls_dir:
            entry.update(tls_dir=drafter_tls_dir, tls_server_name=drafter_tls_server_name)
    pools = list(by_name.values())
    model_path = str(resolve(spec.verifier.model))
    args = vllm_engine_args(spec.verifier, model_path, spec.speculation, pools, metrics_port)
    argv = [sys.executable, "-m", VLLM_SERVER, *cli_flags(args), "--host", host, "--port", str(http_port),
            "--uvicorn-log-level", "warning"]
    env = {**os.environ, **vllm_cpu_env(spec.verifier, cores)}
    if api_key:
        env["VLLM_API_KEY"] = api_key  # not on the command line, where `ps` shows it
    return argv, env


VLLM_SERVER = "vllm.entrypoints.launchers.api_server.entry"  # `vllm serve` (the `vllm` CLI needs the `vllm` dist name)


def vllm_engine_args(verifier, model_path: str, speculation, pools: list[dict[str, Any]],
                     metrics_port: int = 0) -> dict[str, Any]:
    """The verifier spec (`spec.verifier`) as vLLM engine arguments (`EngineArgs` field names):
    model, dtype, maxBatchTokens -> max_num_batched_tokens, maxModelLen, maxNumSeqs,
    gpuMemoryUtilization (GPU pods; kvCacheSpaceGiB is the CPU pods' `vllm_cpu_env`).

    GPUs requested per verifier pod (`resources.limits["nvidia.com/gpu"]`) become the
    tensor-parallel size; without GPUs the engine runs eagerly on the CPU (`vllm-cpu`).
    `speculation` (`spec.speculation`, a `SpeculationSpec`) goes to the proposer as itself; its
    `max_draft_len` 0 serves the target alone (no speculative path at all).
    """
    from cosine import vllm_hooks

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
    if gpus > 1:
        args["tensor_parallel_size"] = gpus
    if gpus == 0:
        args["enforce_eager"] = True  # CPU: no CUDA graphs; torch.compile start-up does not pay here
    for key, value in (("max_model_len", verifier.max_model_len), ("max_num_seqs", verifier.max_num_seqs),
                       ("gpu_memory_utilization", verifier.gpu_memory_utilization if gpus else None)):
        if value is not None:
            args[key] = value
    if speculation.max_draft_len > 0:
        args.update(vllm_hooks.engine_kwargs(speculation, pools=pools, model=model_path, metrics_port=metrics_port))
    return args


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
    bare flag."""
    import json

    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        elif isinstance(value, list | tuple):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


# ---------------------------------------------------------------- serve (embedded cluster)


def placement(spec, mode: str):
    """Where `cosine serve` runs each role (`runtime.placement`): `split` puts the verifier's
    engine threads and each drafter replica on disjoint cores of this process's affinity (sharing
    only when there are too few); `overlap` binds the verifier to every core and lets the replicas
    share them; `lookup` starts no replica and binds the verifier to every core (prompt lookup
    only); `shared` pins nothing (vLLM binds its own threads, drafters float), which is what
    co-location costs. (`auto` is resolved before: `placement.choose`.)

    Raises:
        ValueError: an unknown mode.
    """
    from cosine.placement import Placement, place

    replicas = [pool for pool in spec.drafter_pools for _ in range(max(1, pool.replicas))]
    if mode == "shared":
        return Placement((), tuple(() for _ in replicas), True)
    if mode not in ("split", "overlap", "lookup"):
        raise ValueError(f"placement must be 'split', 'overlap', 'lookup' or 'shared', got {mode!r}")
    cpus = sorted(os.sched_getaffinity(0))
    gpus = spec.verifier.pod.gpu_count
    if mode == "lookup":
        return Placement(() if gpus else tuple(cpus), (), False)
    threads = 1 if gpus else (len(cpus) if mode == "overlap" else spec.verifier.threads)
    return place(cpus, threads, [p.threads for p in replicas])


def local_pool_cores(spec) -> int:
    """Cores the manifest's local drafter replicas would take (their threads, all replicas)."""
    return sum(p.threads * max(1, p.replicas) for p in spec.drafter_pools)


def run_serve(manifest: Manifest, port: int, host: str, api_key: str | None, metrics_port: int,
              placement_mode: str) -> int:
    """Drafter processes (none for `lookup`; `local_pools.LocalPools`, scaled by the operator's
    rule with `spec.autoscaling.enabled`), then the verifier (vLLM's server with CoSine's
    proposer) as a child, on the cores `placement(spec, placement_mode)` gives them; returns when
    the verifier exits or on SIGTERM / Ctrl-C, stopping every child."""
    import tempfile

    from cosine.local_pools import LocalPools

    spec = manifest.spec
    where = placement(spec, placement_mode)
    if where.shared and placement_mode == "split":
        log.warning("too few CPU cores for disjoint placement: drafters share the verifier's cores %s",
                    list(where.verifier))
    autoscaled = spec.autoscaling.enabled and placement_mode != "lookup"
    if autoscaled and not metrics_port:
        metrics_port = free_port()  # the autoscaler reads the proposer's series
    stop = threading.Event()
    verifier: subprocess.Popen | None = None
    reaper: subprocess.Popen | None = None
    pools = None
    with tempfile.TemporaryDirectory(prefix="cosine-pools-") as directory:
        try:
            if placement_mode != "lookup":
                pools = LocalPools(manifest, Path(directory), where.drafters, autoscaled=autoscaled)
                pools.wait_ready()
                threading.Thread(target=pools.supervise, args=(stop,), name="cosine-supervisor", daemon=True).start()
            argv, env = verifier_command(manifest, port, host, pools.drafter_flags() if pools else [], api_key,
                                         metrics_port, where.verifier)
            verifier = subprocess.Popen(argv, env=env, preexec_fn=die_with_parent, start_new_session=True)
            reaper = start_reaper([verifier.pid])  # its group dies with this process, however it dies
            log.info("verifier (pid %d): vLLM OpenAI server on http://%s:%d/v1, engine threads on cores %s",
                     verifier.pid, host, port, list(where.verifier) or "(vLLM's binding)")
            if pools is not None and autoscaled:
                log.info("autoscaling drafter pools every %d s (spec.autoscaling)", spec.autoscaling.interval_s)
                threading.Thread(target=pools.autoscale, args=(f"http://127.0.0.1:{metrics_port}/metrics", stop),
                                 name="cosine-autoscaler", daemon=True).start()
            signal.signal(signal.SIGTERM, lambda signum, frame: verifier.terminate() if verifier else None)
            try:
                return verifier.wait()
            except KeyboardInterrupt:
                return 0
        finally:
            stop.set()
            if verifier is not None:
                stop_group(verifier)
            if reaper is not None:
                stop_reaper(reaper)
            if pools is not None:
                pools.stop()
