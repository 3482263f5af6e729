"""`cosine bench`: CoSine on vLLM against vLLM's own speculation, same machine, same prompts.

Systems, each a real OpenAI server on this machine, driven through the official `openai` client
(streaming chat, greedy, the same prompts and `max_tokens`), closed loop at each concurrency level
(every client sends its next prompt when its last one finished), or with `--request-rate R` open loop
(Poisson arrivals at R requests per second, the same times for every system, the level capping the
requests in flight, as vLLM's `vllm bench serve --request-rate R --max-concurrency C`): a closed loop
lets a faster system send more, so a request shares the server with more prefills of others; at an
open loop's equal offered load, per-request (per-domain) latency is what a user of each system sees:
- `vllm`: vLLM serving the target alone (the reference: ratios are to it);
- `vllm-ngram`: vLLM's prompt lookup (`method: ngram`, k = `--peer-k`);
- `vllm-suffix`: vLLM's SuffixDecoding (Oliaro et al., arXiv:2411.04975; `method: suffix`, Arctic
  Inference's suffix trees over the prompt and over earlier responses), k = `--suffix-k` (default
  `--peer-k`; 0 = vLLM's default, its tree depth), vLLM's defaults for the other `suffix_decoding_*`
  keys;
- `vllm-draft`: vLLM's draft model (`method: draft_model`, the drafter model in-process, k = `--peer-k`);
- `cosine`: the embedded CoSine cluster (`cosine serve`): vLLM with CoSine's proposer, prompt lookup
  and the drafter pools of the manifest as separate gRPC processes;
- `cosine-lookup` (ablation): CoSine's proposer without pools (prompt lookup, suffix cache and the
  closed-loop k), i.e. what the drafting plane adds before any drafter pod;
- `cosine-nofusion` (ablation, not run by default): `cosine` from a copy of the manifest with
  `spec.speculation.fusion: false` (one pool per request, no fused drafts);
- `cosine-nobranch` (ablation, not run by default): `cosine` with `spec.speculation.branches: 0`
  (pools draft past the draft being verified, never from its rejection points);
- `cosine-acceptance` (ablation, not run by default): `cosine` with
  `spec.speculation.draftLength: acceptanceRate` (k from the request's acceptance rate, not from
  the draft at hand's path probabilities).
The engine arguments (dtype, batch tokens, eager mode, KV cache size) are the same for all: they
come from the manifest's verifier spec.

Runs. Every (system, concurrency level) gets a fresh server, so cross-request caches (vLLM's suffix
trees, CoSine's suffix cache, prefix caches) start empty at every level instead of replaying the
previous level's answers to the same prompts. Each server first answers one warm-up request
(first-request overheads are not the system's speed) whose prompt is not in the measured set, so it
cannot seed a cache with a measured answer. Servers run one at a time (their weights do not fit
together in RAM), level by level; because this machine's speed drifts, the reference runs first and
again last at each level (ratios use the median of its runs); with `--repeat N` every system runs N
times in interleaved order (A B C ... C B A ...), and the report's `summary` gives per system the
median ratio of its i-th run to the reference's (and the best vLLM speculation method's) with the
spread of those ratios. Reuse across
requests (prompts that repeat) is measured on its own workload, `--workload repeat`, reported
separately.

Placement (`--placement`), the cores each system computes on, out of the N this process may use:
- `auto` (default): CoSine's embedded clusters as `cosine serve` places them by default
  (`placement.choose`, from the last bench's measurements: `split` or `lookup`, pools off and the
  verifier on every core); every other system on every core, as in `overlap`.
- `lookup`: CoSine's clusters without their pools, the verifier on every core.
- `shared`: nothing pinned by us (`cosine serve --placement shared`; drafters float), so
  vLLM binds its own threads: its default on x86 (`VLLM_CPU_OMP_THREADS_BIND=auto`) reserves one
  core per worker for its engine-core process and binds the worker's OpenMP threads to the rest
  (vllm/utils/ompmultiprocessing.py), so on 2 cores every vLLM server, peer or verifier, computes on
  one OpenMP thread.
- `split` (equal resources): the peers (`vllm`, `vllm-*`) compute on all N cores
  (`VLLM_CPU_OMP_THREADS_BIND` set to them: vLLM takes an explicit list as is and reserves no core);
  the CoSine systems run from a copy of the manifest whose verifier has N - N//2 threads and whose
  drafter pools have N//2 each, and `cosine serve --placement split` puts them on disjoint cores
  (the verifier's first): on 2 cores, the verifier on one and the pool(s) on the other.
  `cosine-lookup` gets the verifier's share only, so what the pools add on the other core shows
  against it.
- `overlap`: every system's verifier, CoSine's included, computes on all N cores; CoSine's drafter
  pools (N//2 threads each) share its cores (`cosine serve --placement split` from a
  manifest whose verifier has N threads). A pool then costs the verifier's steps only while it
  computes, and a request no pool is asked for gets every core, as it would from vLLM alone.
Each row records the binding it ran with: the environment the bench set and, for every process of
the server, the cores its threads may run on, the threads pinned to one core and its OpenMP
settings (read from /proc once the server answered its warm-up request).

Per system and level: output tokens/s, TPOT / TTFT / latency p50 and p99, acceptance length and
draft tokens per step (from vLLM's `vllm:spec_decode_*` counters), outputs identical to the
reference and throughput per domain; for the CoSine systems, from the verifier's `cosine_` series,
per draft source ("lookup" or a pool) draft and accepted tokens, drafts late, calls, errors and
round trip, the share of steps with a draft and the verifier's seconds per engine step; and, from
each drafter process's own /metrics, the pool's busy fraction and drafting seconds per draft token.

Profiles (`--profile DIR`): while each run's timed load runs, py-spy (from PyPI) samples every
process of its server (`py-spy record --subprocesses`) into `DIR/<system>-c<level>-r<run>.txt`
(collapsed stacks); the row keeps the share of samples in CoSine's code (`cosine/`) and the frames
that take the most (`profile_top`).

Draft cost (`--draft-cost`, on by default): after the servers, each drafter engine (llama.cpp on the
GGUF file, vLLM on the weights) drafts for each drafter model on a pool's share of the cores, in a
child process pinned there (`cosine.tooling.draft_cost`): prefill tokens per second and seconds per draft
token, alone and batched, measured in the same run as the verifier's step time it is weighed against.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from cosine_spec import metric_names as m
from cosine_spec.cluster_spec import SpeculationSpec

from cosine import processes, roles
from cosine.manifest import Manifest, load_manifest
from cosine.placement import DEFAULT, MODES, Choice
from cosine.tooling.bench_results import (
    ABLATIONS,
    CLUSTERS,
    REFERENCE,
    SPECULATOR_SYSTEMS,
    SYSTEMS,
    Record,
    Scrape,
    add_ratios,
    summarize,
    summarize_repeats,
)
from cosine.tooling.workloads import Prompt

log = logging.getLogger(__name__)

PLACEMENTS = MODES  # cosine.placement.Mode
WARMUP = Prompt("warmup", "warmup", "Say hello in one word.")  # never a measured prompt
WARMUP_TOKENS = 8
ARRIVAL_SEED = 0  # the open loop's arrival times (`--request-rate`): the same for every system and run

_OMP_ENV = ("OMP_NUM_THREADS", "KMP_AFFINITY", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


@dataclass(frozen=True)
class Run:
    """One server's life: `system` at one concurrency level. `run` is its place in its level's
    order: 0 is the reference's first run, the last one its second."""

    run: int
    system: str
    concurrency: int


def system_placement(system: str, default: str, auto_mode: str = "lookup") -> tuple[str, str]:
    """(system, placement) of a bench system name: `cosine@shared` runs `cosine` with the `shared`
    placement whatever `--placement` says (to compare placements in one run); a plain name takes
    `default`. `auto` is `auto_mode` (`split` or `lookup`, `placement.choose`'s) for the embedded
    clusters and `overlap` (every core) for the others.

    Raises:
        ValueError: an unknown system or placement.
    """
    base, _, placement = system.partition("@")
    if base not in SYSTEMS:
        raise ValueError(f"unknown system {base!r}; choose among {list(SYSTEMS)}")
    placement = placement or default
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r} in {system!r}; choose among {list(PLACEMENTS)}")
    if placement == "auto":  # what `cosine serve` chose (`placement.choose`); every other system on every core
        placement = auto_mode if base in CLUSTERS else "overlap"
    return base, placement


def plan_runs(systems: Sequence[str], concurrencies: Sequence[int], repeat: int = 1) -> list[Run]:
    """A fresh server per (system, level, repeat), level by level. With `repeat` 1 the reference
    runs first and last of each level; with `repeat` N >= 2 every system runs N times in
    interleaved order, forward then backward (A B C ... C B A A B C ...), so a drift of the
    machine's speed within a level falls on every system alike. A system may carry its own
    placement (`system_placement`).

    Raises:
        ValueError: an unknown system, or `repeat` < 1.
    """
    unknown = [s for s in systems if s.partition("@")[0] not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; choose among {list(SYSTEMS)}")
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    forward = [REFERENCE, *[s for s in dict.fromkeys(systems) if s != REFERENCE]]
    if repeat == 1:
        order = [*forward, REFERENCE]
    else:
        order = [s for i in range(repeat) for s in (forward if i % 2 == 0 else forward[::-1])]
    return [Run(i, s, c) for c in concurrencies for i, s in enumerate(order)]


def peer_speculative_config(system: str, drafter_path: str, peer_k: int, suffix_k: int) -> dict[str, Any] | None:
    """vLLM's `speculative_config` for a vLLM-only system (None: the target alone).

    `vllm-suffix` keeps vLLM 0.32's defaults (vllm/config/speculative.py: suffix_decoding_max_tree_depth
    24, suffix_decoding_max_cached_requests 10,000, suffix_decoding_max_spec_factor 1.0,
    suffix_decoding_min_token_prob 0.1); its `num_speculative_tokens` only caps the length the
    suffix trees choose per draft, and `suffix_k` = 0 leaves it at vLLM's default (the tree depth).

    Raises:
        ValueError: not a vLLM-only system.
    """
    if system == REFERENCE:
        return None
    if system == "vllm-ngram":
        return {"method": "ngram", "num_speculative_tokens": peer_k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if system == "vllm-suffix":
        return {"method": "suffix", **({"num_speculative_tokens": suffix_k} if suffix_k > 0 else {})}
    if system == "vllm-draft":
        return {"method": "draft_model", "model": drafter_path, "num_speculative_tokens": peer_k}
    raise ValueError(f"unknown vLLM system {system!r}")


def split_threads(cores: int) -> tuple[int, int]:
    """(verifier threads, threads per drafter pool) of CoSine's share of `cores` in `split`."""
    drafter = max(1, cores // 2)
    return max(1, cores - drafter), drafter


def placement_threads(placement: str, cores: int) -> tuple[int, int] | None:
    """(verifier threads, threads per drafter pool) a CoSine system's manifest copy gets for
    `placement` on `cores` cores; None: the manifest's own (`shared`)."""
    if placement == "split":
        return split_threads(cores)
    if placement in ("overlap", "lookup"):
        return cores, split_threads(cores)[1]
    return None


def placement_env(system: str, placement: str, cpus: Sequence[int]) -> dict[str, str]:
    """Environment the bench adds to a system's server for `placement` (see the module docstring).
    In `split`: a peer's OpenMP threads on every core in `cpus`, `cosine-lookup`'s on the verifier's
    share (the first cores, where `cosine serve` puts its verifier); `cosine serve` places the other
    CoSine systems itself, from the manifest copy (`derived_manifest`).

    Raises:
        ValueError: an unknown placement.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose among {list(PLACEMENTS)}")
    if placement == "shared" or system in CLUSTERS:
        return {}
    if system == "cosine-lookup" and placement == "split":
        cpus = list(cpus)[: split_threads(len(cpus))[0]]
    # an explicit list: vLLM 0.32 binds one OpenMP thread per listed core and reserves none (its
    # VLLM_CPU_NUM_OF_RESERVED_CPU only applies to the "auto" binding)
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}


def derived_manifest(obj: dict[str, Any], *, speculation: Mapping[str, Any] | None = None,
                     threads: tuple[int, int] | None = None,
                     speculator: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A copy of a CoSineCluster manifest with `speculation`'s keys set in `spec.speculation`,
    `speculator` as `spec.verifier.speculator` and, given `threads` (verifier, each pool:
    `placement_threads`), the verifier's and each pool's `threads`."""
    out = copy.deepcopy(obj)
    spec = out.setdefault("spec", {})
    if speculation:
        spec["speculation"] = {**(spec.get("speculation") or {}), **speculation}
    if speculator:
        spec["verifier"]["speculator"] = dict(speculator)
    if threads is not None:
        spec["verifier"]["threads"], drafter_threads = threads
        for pool in spec.get("drafterPools") or []:
            pool["threads"] = drafter_threads
    return out


# (spec.speculation overrides, (verifier threads, threads per pool) or None: the manifest's own,
# spec.verifier.speculator's (method, model) or ())
Variant = tuple[tuple[tuple[str, Any], ...], tuple[int, int] | None, tuple[str, ...]]


def _manifest_variant(system: str, placement: str, cpus: Sequence[int], drafter_model: str = "",
                      peer_k: int = 4) -> Variant:
    """(spec.speculation overrides, threads, speculator) of the manifest copy a system runs from;
    ((), None, ()) = the input manifest. A system with the engine's own drafter
    (`SPECULATOR_SYSTEMS`) drafts with `drafter_model`, k bounded by `peer_k` as `vllm-draft`'s
    unless its ablation sets `maxDraftLen`."""
    if not system.startswith("cosine"):
        return (), None, ()
    overrides = dict(ABLATIONS.get(system, {}))
    speculator: tuple[str, ...] = ()
    if system in SPECULATOR_SYSTEMS:
        overrides.setdefault("maxDraftLen", peer_k)
        speculator = (SPECULATOR_SYSTEMS[system], drafter_model)
    return tuple(sorted(overrides.items())), placement_threads(placement, len(cpus)), speculator


def peer_command(system: str, manifest: Manifest, port: int, drafter_model: str, peer_k: int, suffix_k: int,
                 extra_env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of a vLLM-only system's server, with the manifest's verifier engine arguments."""
    from cosine.model_store import resolve

    spec = manifest.spec
    target_alone = SpeculationSpec(max_draft_len=0)  # no CoSine proposer: vLLM's own method, or none
    args = roles.vllm_engine_args(spec.verifier, str(resolve(spec.verifier.model)), target_alone, [])
    drafter_path = str(resolve(drafter_model)) if system == "vllm-draft" else ""
    config = peer_speculative_config(system, drafter_path, peer_k, suffix_k)
    if config is not None:
        args["speculative_config"] = config
    argv = [sys.executable, "-m", roles.VLLM_SERVER, *roles.cli_flags(args), "--host", "127.0.0.1",
            "--port", str(port), "--uvicorn-log-level", "warning"]
    return argv, {**os.environ, **roles.vllm_cpu_env(spec.verifier), **extra_env}


def _server_command(system: str, manifest: Manifest, port: int, metrics_port: int, drafter_model: str,
                    peer_k: int, suffix_k: int, placement: str, extra_env: dict[str, str]
                    ) -> tuple[list[str], dict[str, str]]:
    if system in CLUSTERS:
        # the bench's placements are cosine serve's own (for `overlap`, the manifest copy's verifier
        # takes every core)
        cmd = [sys.executable, "-m", "cosine", "serve", "--port", str(port), "--metrics-port", str(metrics_port),
               "--pools-metrics-port", "0", "--placement", placement]
        return cmd + (["--cluster", str(manifest.path)] if manifest.path else []), {**os.environ, **extra_env}
    if system == "cosine-lookup":
        cmd, env = roles.verifier_command(manifest, port, "127.0.0.1", [], None, metrics_port)
        return cmd, {**env, **extra_env}
    return peer_command(system, manifest, port, drafter_model, peer_k, suffix_k, extra_env)


# ---------------------------------------------------------------- the server's processes (/proc)


def _process_tree(root: int) -> list[int]:
    """`root` and its descendants, from /proc/*/stat (`cosine serve` starts its verifier in a
    session of its own, so a session or process group would miss it)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return sorted(out)


def _parse_cpu_list(text: str) -> set[int]:
    """ "0-2,5" -> {0, 1, 2, 5} (the kernel's Cpus_allowed_list)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _argv(pid: int) -> list[str]:
    return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


def _role(argv: list[str], comm: str) -> str:
    """ "cosine drafter coder", "cosine serve", "vllm server", or the process's name (vLLM names
    its engine-core and worker processes VLLM::EngineCore, VLLM::Worker)."""
    if roles.VLLM_SERVER in argv:
        return "vllm server"
    if "cosine" in argv[:4]:
        i = argv.index("cosine")
        role = argv[i + 1] if i + 1 < len(argv) else ""
        pool = argv[argv.index("--pool") + 1] if "--pool" in argv[:-1] else ""
        return " ".join(x for x in ("cosine", role, pool) if x)
    return comm


def process_binding(pid: int) -> dict[str, Any] | None:
    """Where a process computes: its role, the cores its threads may run on (union of their
    affinity masks), its threads, how many are pinned to each single core, and its OpenMP settings.
    None if it is gone."""
    proc = Path(f"/proc/{pid}")
    try:
        argv, comm = _argv(pid), (proc / "comm").read_text().strip()
        allowed: set[int] = set()
        pinned: dict[str, int] = {}
        threads = 0
        for task in (proc / "task").iterdir():
            with contextlib.suppress(OSError, StopIteration):  # a thread may exit while read
                status = (task / "status").read_text()
                line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
                cpus = _parse_cpu_list(line.split(":", 1)[1])
                threads += 1
                allowed |= cpus
                if len(cpus) == 1:
                    key = str(next(iter(cpus)))
                    pinned[key] = pinned.get(key, 0) + 1
        environ = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    env = {k: environ[k.encode()].decode() for k in _OMP_ENV if k.encode() in environ}
    return {"pid": pid, "role": _role(argv, comm), "cpus": sorted(allowed), "threads": threads,
            "pinned_threads": dict(sorted(pinned.items())), "env": env}


def _drafter_metrics(pids: Sequence[int]) -> list[tuple[str, str]]:
    """(pool, /metrics URL) of every `cosine drafter` process among `pids` (its --metrics-port, as
    `cosine serve` chose it)."""
    out = []
    for pid in pids:
        try:
            argv = _argv(pid)
        except OSError:
            continue
        if "drafter" in argv and "--pool" in argv[:-1] and "--metrics-port" in argv[:-1]:
            port = argv[argv.index("--metrics-port") + 1]
            if port != "0":
                out.append((argv[argv.index("--pool") + 1], f"http://127.0.0.1:{port}/metrics"))
    return out


def _scrape(url: str, prefixes: tuple[str, ...] = (m.VLLM_SPEC_DECODE_PREFIX, m.PREFIX)) -> Scrape:
    """Counters and gauges named `prefixes*` at a Prometheus endpoint, per `pool` label ({} if unreachable)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return {}
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefixes) and not s.name.endswith("_created") and "le" not in s.labels:
                key = (s.name, s.labels.get("pool", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


class _Server:
    """A system's server for the duration of a `with` block (its process group is stopped after)."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, metrics_port: int, quiet: bool) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.metrics_port = metrics_port
        out = subprocess.DEVNULL if quiet else None
        self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out, start_new_session=True)

    def __enter__(self) -> _Server:
        try:
            processes.wait_ready(self.base, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        processes.stop_group(self.proc)

    def bindings(self) -> list[dict[str, Any]]:
        return [b for pid in _process_tree(self.proc.pid) if (b := process_binding(pid)) is not None]

    def drafters(self) -> list[tuple[str, str]]:
        return _drafter_metrics(_process_tree(self.proc.pid))

    def scrape(self) -> Scrape:
        out = _scrape(f"{self.base}/metrics")
        if self.metrics_port:
            out.update(_scrape(f"http://127.0.0.1:{self.metrics_port}/metrics"))
        return out


@contextlib.contextmanager
def _profiled(pid: int, out: Path):
    """py-spy samples the process tree of `pid` into `out` (collapsed stacks) for the `with` block."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        raise RuntimeError("--profile needs py-spy (pip install py-spy; `make install` puts it in the venv)")
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--subprocesses", "--rate", "100", "--format", "raw",
                             "--nonblocking", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled on SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def profile_top(collapsed: str, match: str = "cosine/", top: int = 12) -> dict[str, Any]:
    """A py-spy collapsed-stack profile summed up. collapsed: its text, a line per distinct stack,
    `frame;frame;... count` (root first; a frame `function (file:line)`; the `process PID:"…"`
    root frames of `--subprocesses` are left out).

    Returns {"samples", "match_share": share of samples with a frame whose file contains `match`,
    "top_self": the `top` frames by own samples, "top_match": the `top` frames matching `match` by
    inclusive samples}, each frame as (function (file), share of all samples)."""
    import re
    from collections import Counter

    total, hit = 0, 0
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        # with --subprocesses the root frame is `process PID:"<command line>"`: not code
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";") if not f.startswith("process ")]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        mine = {f for f in frames if f.endswith(")") and match in f.rpartition(" (")[2]}
        hit += count if mine else 0
        for f in mine:
            inclusive[f] += count
    share = (lambda c: round(c / total, 5)) if total else (lambda c: 0.0)
    return {"samples": total, "match_share": share(hit),
            "top_self": [(f, share(c)) for f, c in own.most_common(top)],
            "top_match": [(f, share(c)) for f, c in inclusive.most_common(top)]}


# ---------------------------------------------------------------- load and figures


async def _load(base: str, model: str, prompts: Sequence[Prompt], concurrency: int, max_tokens: int,
                system: str, run: int, done: Callable[[], None] = lambda: None,
                request_rate: float = math.inf) -> list[Record]:
    """Send `prompts` in order (streamed, greedy: `demo.ask`, one thread per request in flight; the
    OpenAI client is thread-safe), at most `concurrency` in flight. `request_rate` inf (the default)
    is the closed loop: `concurrency` clients, each sending the next prompt when its previous answer
    ended. A finite `request_rate` (requests per second) is the open loop of vLLM's own
    `vllm bench serve --request-rate R --max-concurrency C`: prompts arrive at Poisson times from
    vLLM's `get_request` (vllm/benchmarks/serve.py, its interval normalisation included), the
    same times for every system and run (numpy seeded with `ARRIVAL_SEED` first), and one that
    arrives with `concurrency` in flight waits for a slot. A record's `start_s` is when it was sent,
    from the start of the load; its latency counts from there (as vLLM's benchmark does). `done` is
    called after each answer (progress).

    Raises:
        ValueError: `request_rate` not positive.
    """
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from cosine.tooling.demo import ask

    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 requests per second, got {request_rate}")
    if not math.isinf(request_rate):  # imported before the load's clock starts (vLLM's import takes seconds)
        import numpy as np
        from vllm.benchmarks.serve import get_request
    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=1800)
    records: list[Record] = []
    loop = asyncio.get_running_loop()
    threads = ThreadPoolExecutor(max_workers=concurrency)  # asyncio's default pool would cap the load
    slots = asyncio.Semaphore(concurrency)  # wakes its waiters first come, first served
    started = time.monotonic()

    async def send(p: Prompt) -> None:
        async with slots:
            sent = time.monotonic() - started
            a = await loop.run_in_executor(threads, ask, client, model, p, max_tokens)
            records.append(Record(system, run, concurrency, p.id, p.domain, a.text, a.completion_tokens,
                                  a.ttft_s, a.wall_s, sent))
            done()

    if math.isinf(request_rate):
        await asyncio.gather(*(send(p) for p in prompts))
    else:
        np.random.seed(ARRIVAL_SEED)  # get_request draws its intervals from numpy's global generator
        sending = [asyncio.create_task(send(p)) async for p, _ in get_request(list(prompts), request_rate)]
        await asyncio.gather(*sending)
    threads.shutdown()
    client.close()
    return records


def _progress() -> Any:
    """The bench's progress display (on stderr): per run and over all runs, prompts done, elapsed
    time and an ETA (rich's, from the rate so far; server start-ups count as elapsed time)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TextColumn("prompts"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True))


def run_bench(prompts: Sequence[Prompt], systems: Sequence[str], concurrencies: Sequence[int], max_tokens: int,
              manifest: Manifest, drafter_model: str, peer_k: int = 4, quiet: bool = True,
              workload: str = "", placement: str = DEFAULT, suffix_k: int | None = None,
              draft_cost_models: Sequence[str] | None = None, draft_k: int = 8,
              choice: Choice | None = None, repeat: int = 1, profile_dir: Path | None = None,
              checkpoint: Callable[[dict[str, Any]], None] | None = None,
              request_rate: float = math.inf) -> dict[str, Any]:
    """Every system at every level on a fresh server (see the module docstring); then, given
    `draft_cost_models` (empty: the manifest's pool models and `drafter_model`), the draft cost of
    each drafter engine on each of them (`draft_cost`), `draft_k` tokens a draft, on a pool's share
    of the cores (the last N//2), alone and batched to the highest concurrency level (at most one
    request per prompt). `profile_dir`: py-spy profiles of each run's timed load there (see the module
    docstring). `choice`: what `auto` resolved to for the embedded clusters
    (`placement.choose`; default: `lookup`), recorded in the report. `checkpoint`: called with the
    report so far (`complete` False) after every run, so a long run stopped or crashed midway keeps
    the levels it measured. `request_rate`: requests per second of an open-loop load at every level,
    the level then capping the requests in flight (`_load`; inf: the closed loop).

    A drafter engine that fails or times out leaves an `error` row in `draft_cost`.

    Raises:
        ValueError: an unknown system or placement, or `request_rate` not positive.
        RuntimeError: `vllm-suffix` without Arctic Inference installed; a server that does not start.
    """
    runs = _check(systems, concurrencies, repeat, placement, request_rate, choice)
    auto_mode = choice.mode if choice else "lookup"
    suffix_k = peer_k if suffix_k is None else suffix_k
    model = manifest.spec.verifier.model
    cpus = sorted(os.sched_getaffinity(0))
    rows: list[dict[str, Any]] = []
    records: list[Record] = []

    def report(costs: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
        add_ratios(rows, records)
        return {"workload": workload, "max_tokens": max_tokens, "systems": list(systems),
                "concurrency": list(concurrencies), "model": model, "placement": placement, "cpus": cpus,
                "placement_choice": asdict(choice) if choice else {"mode": auto_mode, "reason": "default"},
                "peer_k": peer_k, "suffix_k": suffix_k, "warmup_prompt": WARMUP.prompt, "repeat": repeat,
                "request_rate": None if math.isinf(request_rate) else request_rate,
                "complete": complete, "rows": rows, "summary": summarize_repeats(rows, records),
                "draft_cost": costs, "records": [asdict(r) for r in records]}

    with tempfile.TemporaryDirectory(prefix="cosine-bench-") as tmp, _progress() as progress:
        overall = progress.add_task("all runs", total=len(runs) * len(prompts))
        current = progress.add_task("", total=len(prompts))
        manifests: dict[Variant, Manifest] = {((), None, ()): manifest}
        for run in runs:
            system, run_placement = system_placement(run.system, placement, auto_mode)
            variant = _manifest_variant(system, run_placement, cpus, drafter_model, peer_k)
            if variant not in manifests:
                path = Path(tmp) / f"cluster-{len(manifests)}.yaml"
                speculator = dict(zip(("method", "model"), variant[2], strict=True)) if variant[2] else None
                path.write_text(yaml.safe_dump(derived_manifest(manifest.obj, speculation=dict(variant[0]),
                                                                threads=variant[1], speculator=speculator)))
                manifests[variant] = load_manifest(path)
            extra_env = placement_env(system, run_placement, cpus)
            port = processes.free_port()
            metrics_port = processes.free_port() if run.system.startswith("cosine") else 0
            argv, env = _server_command(system, manifests[variant], port, metrics_port, drafter_model, peer_k,
                                        suffix_k, run_placement, extra_env)
            progress.reset(current, description=f"{run.system} c={run.concurrency}: starting", total=len(prompts))
            server = _Server(argv, env, port, metrics_port, quiet)
            binding = {"env": extra_env, "manifest": _manifest_note(variant)}
            row, recs = _measure(run, server, binding, model, prompts, max_tokens, request_rate, profile_dir,
                                 progress, (current, overall))
            rows.append(row)
            records.extend(recs)
            if checkpoint is not None:
                checkpoint(report([], complete=False))
    costs = _draft_costs(manifest, prompts, concurrencies, drafter_model, draft_cost_models, draft_k, cpus)
    return report(costs, complete=True)


def _check(systems: Sequence[str], concurrencies: Sequence[int], repeat: int, placement: str,
           request_rate: float, choice: Choice | None) -> list[Run]:
    """`run_bench`'s runs, once its arguments are known to be sound (see its Raises)."""
    runs = plan_runs(systems, concurrencies, repeat) if repeat > 1 else plan_runs(systems, concurrencies)
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose among {list(PLACEMENTS)}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 requests per second, got {request_rate}")
    auto_mode = choice.mode if choice else "lookup"
    for system in systems:
        system_placement(system, placement, auto_mode)
    if any(s.startswith("vllm-suffix") for s in systems) and importlib.util.find_spec("arctic_inference") is None:
        raise RuntimeError("vllm-suffix needs the arctic-inference package (vLLM's suffix decoding): "
                           "`make install` builds it")
    return runs


def _measure(run: Run, server: _Server, binding: dict[str, Any], model: str, prompts: Sequence[Prompt],
             max_tokens: int, request_rate: float, profile_dir: Path | None, progress: Any,
             tasks: tuple[Any, Any]) -> tuple[dict[str, Any], list[Record]]:
    """One run on a fresh `server`: a warm-up prompt, then the timed load between two scrapes of
    the server's and its drafters' metrics (and a py-spy profile in `profile_dir`). Returns the
    run's row and its records."""
    current, overall = tasks
    log.info("bench: starting %s for c=%d", run.system, run.concurrency)
    with server:
        asyncio.run(_load(server.base, model, [WARMUP], 1, WARMUP_TOKENS, run.system, -1))
        binding = {**binding, "processes": server.bindings()}
        drafters = server.drafters()
        before, drafters_before = server.scrape(), [_scrape(url) for _, url in drafters]
        progress.update(current, description=f"{run.system} c={run.concurrency}")

        def done() -> None:
            progress.advance(current)
            progress.advance(overall)

        profile = (profile_dir / f"{run.system}-c{run.concurrency}-r{run.run}.txt") if profile_dir else None
        t0 = time.perf_counter()
        with _profiled(server.proc.pid, profile) if profile else contextlib.nullcontext():
            recs = asyncio.run(_load(server.base, model, prompts, run.concurrency, max_tokens,
                                     run.system, run.run, done, request_rate))
        wall = time.perf_counter() - t0
        after = server.scrape()
        windows = [(pool, b, _scrape(url)) for (pool, url), b in zip(drafters, drafters_before, strict=True)]
    row = {"system": run.system, "run": run.run, "concurrency": run.concurrency,
           **summarize(recs, wall, before, after, windows), "binding": binding}
    if profile is not None and profile.exists():
        row["profile"] = {"file": str(profile), **profile_top(profile.read_text())}
    log.info("bench: %s c=%d: %.2f tok/s", run.system, run.concurrency, row["output_tokens_per_s"] or 0)
    return row, recs


def _draft_costs(manifest: Manifest, prompts: Sequence[Prompt], concurrencies: Sequence[int], drafter_model: str,
                 draft_cost_models: Sequence[str] | None, draft_k: int, cpus: Sequence[int]) -> list[dict[str, Any]]:
    """The draft cost rows (`run_bench`'s docstring); none when `draft_cost_models` is None."""
    costs: list[dict[str, Any]] = []
    if draft_cost_models is not None:
        from cosine.tooling.draft_cost import ENGINES, measure_in_child

        spec = manifest.spec
        models = list(draft_cost_models) or list(dict.fromkeys(
            [*(p.model for p in spec.drafter_pools if p.model), drafter_model]))
        batches = sorted({1, min(max(concurrencies), len(prompts))})
        pool_cores = cpus[-split_threads(len(cpus))[1]:]
        messages = [p.messages() for p in prompts]
        for m in models:
            for engine in ENGINES:
                log.info("bench: draft cost of %s on %s (cores %s)", engine, m, pool_cores)
                try:
                    costs += [asdict(c) for c in measure_in_child(engine, m, messages, draft_k, batches, pool_cores)]
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # the servers' rows are kept
                    log.warning("bench: draft cost of %s on %s failed: %s", engine, m, e)
                    costs.append({"engine": engine, "model": m, "error": str(e)})
    return costs


def _manifest_note(variant: Variant) -> str:
    overrides, threads, speculator = variant
    notes = [*(f"spec.speculation.{k}: {json.dumps(v)}" for k, v in overrides),
             *([f"verifier threads {threads[0]}, each pool's {threads[1]}"] if threads else []),
             *([f"spec.verifier.speculator: {speculator[0]} {speculator[1]}"] if speculator else [])]
    return "; ".join(notes) or "as given"


