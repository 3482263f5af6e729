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
reference and throughput per domain; for the CoSine systems, from the verifier's `cosine:` series,
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
import statistics
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
from cosine_spec.settings import SpeculationSpec

from cosine import processes, roles
from cosine.manifest import Manifest, load_manifest
from cosine.model_store import last_bench_path
from cosine.placement import DEFAULT, EVIDENCE_KEY, MODES, Choice, Evidence, evidence_document
from cosine.tooling.workloads import Prompt

log = logging.getLogger(__name__)

ABLATIONS = {"cosine-nofusion": {"fusion": False}, "cosine-nobranch": {"branches": 0},
             "cosine-acceptance": {"draftLength": "acceptanceRate"}}  # spec.speculation overrides
SYSTEMS = ("vllm", "vllm-ngram", "vllm-suffix", "vllm-draft", "cosine-lookup", "cosine", *ABLATIONS)
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in ABLATIONS)
CLUSTERS = ("cosine", *ABLATIONS)  # the systems that run the embedded cluster (`cosine serve`)
REFERENCE = "vllm"
PEERS = ("vllm-ngram", "vllm-suffix", "vllm-draft")  # vLLM's own speculation methods
PLACEMENTS = MODES  # cosine.placement.Mode
WARMUP = Prompt("warmup", "warmup", "Say hello in one word.")  # never a measured prompt
WARMUP_TOKENS = 8
ARRIVAL_SEED = 0  # the open loop's arrival times (`--request-rate`): the same for every system and run

Scrape = dict[tuple[str, str], float]  # (sample name, pool label or "") -> value, summed over other labels
_POOL_GAUGES = {"rtt_s": m.POOL_RTT_SECONDS, "token_s": m.POOL_TOKEN_SECONDS, "yield_tokens": m.POOL_YIELD_TOKENS,
                "on_time_ratio": m.POOL_ON_TIME_RATIO}
_GAUGES = frozenset({*_POOL_GAUGES.values(), m.REQUESTS_RUNNING, m.REQUESTS_WAITING, m.DRAFTER_CONTEXTS})
_POOL_COUNTERS = {
    "drafts": m.total(m.DRAFTS),
    "draft_tokens": m.total(m.DRAFT_TOKENS),
    "accepted_tokens": m.total(m.ACCEPTED_TOKENS),
    "drafts_late": m.total(m.DRAFTS_LATE),
    "calls": m.total(m.POOL_CALLS),
    "errors": m.total(m.POOL_ERRORS),
    "asks_skipped": m.total(m.POOL_ASKS_SKIPPED),
}
_OMP_ENV = ("OMP_NUM_THREADS", "KMP_AFFINITY", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


@dataclass(frozen=True)
class Record:
    """One request: prompt id and domain, output text and tokens, wall times in seconds (`start_s`:
    when it was sent, from the start of its run's load)."""

    system: str
    run: int
    concurrency: int
    prompt_id: str
    domain: str
    text: str
    completion_tokens: int
    ttft_s: float
    latency_s: float
    start_s: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first; None for fewer than two tokens."""
        n = self.completion_tokens
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else None


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
                     threads: tuple[int, int] | None = None) -> dict[str, Any]:
    """A copy of a CoSineCluster manifest with `speculation`'s keys set in `spec.speculation` and,
    given `threads` (verifier, each pool: `placement_threads`), the verifier's and each pool's `threads`."""
    out = copy.deepcopy(obj)
    spec = out.setdefault("spec", {})
    if speculation:
        spec["speculation"] = {**(spec.get("speculation") or {}), **speculation}
    if threads is not None:
        spec["verifier"]["threads"], drafter_threads = threads
        for pool in spec.get("drafterPools") or []:
            pool["threads"] = drafter_threads
    return out


# (spec.speculation overrides, (verifier threads, threads per pool) or None: the manifest's own)
Variant = tuple[tuple[tuple[str, Any], ...], tuple[int, int] | None]


def _manifest_variant(system: str, placement: str, cpus: Sequence[int]) -> Variant:
    """(spec.speculation overrides, threads) of the manifest copy a system runs from;
    ((), None) = the input manifest."""
    if not system.startswith("cosine"):
        return (), None
    return tuple(sorted(ABLATIONS.get(system, {}).items())), placement_threads(placement, len(cpus))


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
               "--placement", placement]
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


def _scrape(url: str, prefixes: tuple[str, ...] = (m.VLLM_SPEC_DECODE_PREFIX, "cosine:")) -> Scrape:
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


def _pct(values: Sequence[float], q: float) -> float | None:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))] if v else None


def _pool_figures(delta: Scrape, after: Scrape) -> dict[str, dict[str, float | None]]:
    """Per draft source ("lookup" or a pool), from the verifier's `cosine:` series over the window."""
    names = set(_POOL_COUNTERS.values())
    pools = sorted({p for (n, p) in delta if n in names and p})
    out: dict[str, dict[str, float | None]] = {}
    for pool in pools:
        fig: dict[str, float | None] = {k: delta.get((n, pool), 0.0) for k, n in _POOL_COUNTERS.items()}
        drafted, accepted = fig["draft_tokens"] or 0.0, fig["accepted_tokens"] or 0.0
        fig["acceptance_rate"] = accepted / drafted if drafted else None
        fig.update({k: after.get((n, pool)) for k, n in _POOL_GAUGES.items()})
        out[pool] = fig
    return out


def _drafter_figures(drafters: Sequence[tuple[str, Scrape, Scrape]], wall_s: float
                     ) -> dict[str, dict[str, float | None]]:
    """Per pool, from its drafter processes' own /metrics ((pool, before, after) per process): the
    busy fraction (drafting seconds per second of the window, per replica), drafting seconds per
    draft token and draft tokens."""
    acc: dict[str, list[float]] = {}
    for pool, before, after in drafters:
        busy_key, tokens_key = (m.total(m.DRAFTER_BUSY_SECONDS), pool), (m.total(m.DRAFTER_DRAFT_TOKENS), pool)
        if busy_key not in after:
            continue  # endpoint not reachable
        busy = after[busy_key] - before.get(busy_key, 0.0)
        tokens = after.get(tokens_key, 0.0) - before.get(tokens_key, 0.0)
        a = acc.setdefault(pool, [0.0, 0.0, 0.0])
        a[0], a[1], a[2] = a[0] + busy, a[1] + tokens, a[2] + 1
    return {pool: {"busy_fraction": busy / (wall_s * n) if wall_s > 0 else None,
                   "draft_s_per_token": busy / tokens if tokens else None, "draft_tokens": tokens, "replicas": n}
            for pool, (busy, tokens, n) in sorted(acc.items())}


def _decode_rate(records: Sequence[Record]) -> float | None:
    """A request's decoding speed after its first token, in tokens per second:
    sum(completion_tokens - 1) / sum(latency_s - ttft_s). It leaves the prefill out (TTFT), which
    speculation does not touch and which a split placement computes on fewer cores."""
    tokens = sum(r.completion_tokens - 1 for r in records if r.completion_tokens > 1)
    seconds = sum(r.latency_s - r.ttft_s for r in records if r.completion_tokens > 1)
    return tokens / seconds if seconds > 0 else None


def summarize(records: Sequence[Record], wall_s: float, before: Scrape, after: Scrape,
              drafters: Sequence[tuple[str, Scrape, Scrape]] = ()) -> dict[str, Any]:
    """One (system, run, level) row: throughput, latency percentiles and speculation figures over
    the window between the `before` and `after` scrapes."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if k[0] not in _GAUGES}

    def total(name: str) -> float:
        return sum(v for (n, _), v in delta.items() if n == name)

    tokens = sum(r.completion_tokens for r in records)
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    drafts = total(m.total(m.VLLM_DRAFTS))
    drafted = total(m.total(m.VLLM_DRAFT_TOKENS))
    accepted = total(m.total(m.VLLM_ACCEPTED_TOKENS))
    steps = total(m.total(m.VERIFIER_STEPS))
    domains = sorted({r.domain for r in records})
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "tpot_ms_p50": (_pct(tpots, 0.5) or 0) * 1e3 if tpots else None,
        "ttft_s_p50": _pct([r.ttft_s for r in records], 0.5),
        "decode_tokens_per_s": _decode_rate(records),
        "latency_s_p50": _pct([r.latency_s for r in records], 0.5),
        "latency_s_p99": _pct([r.latency_s for r in records], 0.99),
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_tokens": drafted,
        "drafts_late": total(m.total(m.DRAFTS_LATE)),
        "steps_with_draft_fraction": total(m.total(m.VERIFIER_STEPS_WITH_DRAFT)) / steps if steps else None,
        "verifier_step_s": total(m.total(m.VERIFIER_BUSY_SECONDS)) / steps if steps else None,
        "pools": _pool_figures(delta, after),
        "drafters": _drafter_figures(drafters, wall_s),
        "per_domain_tokens_per_s": {
            d: sum(r.completion_tokens for r in records if r.domain == d)
            / max(1e-9, sum(r.latency_s for r in records if r.domain == d)) for d in domains},
        "per_domain_decode_tokens_per_s": {d: _decode_rate([r for r in records if r.domain == d]) for d in domains},
    }


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
    suffix_k = peer_k if suffix_k is None else suffix_k
    model = manifest.spec.verifier.model
    cpus = sorted(os.sched_getaffinity(0))
    rows: list[dict[str, Any]] = []
    records: list[Record] = []

    def report(costs: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
        _add_ratios(rows, records)
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
        manifests: dict[Variant, Manifest] = {((), None): manifest}
        for run in runs:
            system, run_placement = system_placement(run.system, placement, auto_mode)
            variant = _manifest_variant(system, run_placement, cpus)
            if variant not in manifests:
                path = Path(tmp) / f"cluster-{len(manifests)}.yaml"
                path.write_text(yaml.safe_dump(derived_manifest(manifest.obj, speculation=dict(variant[0]),
                                                                threads=variant[1])))
                manifests[variant] = load_manifest(path)
            extra_env = placement_env(system, run_placement, cpus)
            port = processes.free_port()
            metrics_port = processes.free_port() if run.system.startswith("cosine") else 0
            argv, env = _server_command(system, manifests[variant], port, metrics_port, drafter_model, peer_k,
                                        suffix_k, run_placement, extra_env)
            log.info("bench: starting %s for c=%d", run.system, run.concurrency)
            progress.reset(current, description=f"{run.system} c={run.concurrency}: starting", total=len(prompts))
            with _Server(argv, env, port, metrics_port, quiet) as server:
                asyncio.run(_load(server.base, model, [WARMUP], 1, WARMUP_TOKENS, run.system, -1))
                binding = {"env": extra_env, "manifest": _manifest_note(variant), "processes": server.bindings()}
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
            rows.append(row)
            records.extend(recs)
            log.info("bench: %s c=%d: %.2f tok/s", run.system, run.concurrency, row["output_tokens_per_s"] or 0)
            if checkpoint is not None:
                checkpoint(report([], complete=False))
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
    return report(costs, complete=True)


def _manifest_note(variant: Variant) -> str:
    overrides, threads = variant
    notes = [*(f"spec.speculation.{k}: {json.dumps(v)}" for k, v in overrides),
             *([f"verifier threads {threads[0]}, each pool's {threads[1]}"] if threads else [])]
    return "; ".join(notes) or "as given"


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _prompt_speeds(records: Sequence[Record], system: str, c: int) -> dict[str, tuple[str, float]]:
    """Per prompt id: its domain and its mean per-request speed (output tokens over latency) over
    `system`'s runs at level `c`."""
    speeds: dict[str, list[float]] = {}
    domain: dict[str, str] = {}
    for r in records:
        if r.system == system and r.concurrency == c and r.latency_s > 0:
            speeds.setdefault(r.prompt_id, []).append(r.completion_tokens / r.latency_s)
            domain[r.prompt_id] = r.domain
    return {p: (domain[p], statistics.mean(v)) for p, v in speeds.items()}


def summarize_repeats(rows: Sequence[Mapping[str, Any]], records: Sequence[Record] = ()) -> list[dict[str, Any]]:
    """Per (system, level): its runs, medians of output tokens/s, TPOT, acceptance length and the
    share of steps with a draft, and its ratio to `vllm` and to the best of vLLM's speculation
    methods as the median of the per-repeat ratios, with their spread [min, max] (the i-th run of
    a system against the i-th of the other; a single run has no spread to give). Per domain
    (`ratio_vs_vllm_per_domain`): the median [min, max] of the same per-repeat ratios of the
    domain's tokens over its requests' latency. Given the `records`, per domain the slowest prompt
    against `vllm` (`slowest_prompt_vs_vllm`: the prompt id and its mean per-request speed over
    the system's runs over that under `vllm`'s): "never slower on any prompt" read prompt by
    prompt, the same prompt under both."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        level = [r for r in rows if r["concurrency"] == c]
        by_system: dict[str, list[Mapping[str, Any]]] = {}
        for r in sorted(level, key=lambda r: r["run"]):
            by_system.setdefault(r["system"], []).append(r)
        peers = {s: rs for s, rs in by_system.items() if s.partition("@")[0] in PEERS}
        ref = _prompt_speeds(records, REFERENCE, c)
        for system, mine in by_system.items():
            tps = [r["output_tokens_per_s"] for r in mine]
            entry: dict[str, Any] = {
                "system": system, "concurrency": c, "runs": len(mine), "output_tokens_per_s": _median(tps),
                "tpot_ms_p50": _median([r.get("tpot_ms_p50") for r in mine]),
                "mean_acceptance_length": _median([r.get("mean_acceptance_length") for r in mine]),
                "steps_with_draft_fraction": _median([r.get("steps_with_draft_fraction") for r in mine]),
            }
            against = {"vs_vllm": by_system.get(REFERENCE, [])}
            if peers:
                best = max(peers, key=lambda s: _median([r["output_tokens_per_s"] for r in peers[s]]) or 0.0)
                entry["best_vllm_speculation"] = best
                against["vs_best_vllm_speculation"] = peers[best]
            for key, other in against.items():
                ratios = [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(mine, other, strict=False)
                          if b["output_tokens_per_s"]]
                entry[f"ratio_{key}"] = _median(ratios)
                entry[f"ratio_{key}_spread"] = [min(ratios), max(ratios)] if len(ratios) > 1 else None
            per_domain: dict[str, list[float]] = {}
            for a, b in zip(mine, against["vs_vllm"], strict=False):
                for d, v in a.get("per_domain_tokens_per_s", {}).items():
                    if b.get("per_domain_tokens_per_s", {}).get(d):
                        per_domain.setdefault(d, []).append(v / b["per_domain_tokens_per_s"][d])
            entry["ratio_vs_vllm_per_domain"] = {d: [statistics.median(v), min(v), max(v)]
                                                 for d, v in sorted(per_domain.items())}
            slowest: dict[str, tuple[str, float]] = {}
            for prompt, (d, v) in _prompt_speeds(records, system, c).items():
                ratio = v / ref[prompt][1] if prompt in ref else None
                if ratio is not None and (d not in slowest or ratio < slowest[d][1]):
                    slowest[d] = (prompt, ratio)
            if slowest:
                entry["slowest_prompt_vs_vllm"] = {d: list(v) for d, v in sorted(slowest.items())}
            out.append(entry)
    return out


def _add_ratios(rows: list[dict[str, Any]], records: Sequence[Record]) -> None:
    """Ratios to the median of the reference's runs at the same level; outputs identical to its first run."""
    ref_text = {(r.concurrency, r.prompt_id): r.text for r in records if r.system == REFERENCE and r.run == 0}
    for row in rows:
        c = row["concurrency"]
        refs = [r for r in rows if r["system"] == REFERENCE and r["concurrency"] == c]
        ref_tps = statistics.median(r["output_tokens_per_s"] for r in refs)
        row["speedup_vs_vllm"] = row["output_tokens_per_s"] / ref_tps if ref_tps else None
        ref_decode = [r["decode_tokens_per_s"] for r in refs if r.get("decode_tokens_per_s")]
        row["decode_speedup_vs_vllm"] = (row["decode_tokens_per_s"] / statistics.median(ref_decode)
                                         if ref_decode and row.get("decode_tokens_per_s") else None)
        per_domain = {}
        for d, v in row["per_domain_tokens_per_s"].items():
            ref_d = statistics.median(r["per_domain_tokens_per_s"].get(d, 0.0) for r in refs)
            per_domain[d] = v / ref_d if ref_d else None
        row["per_domain_speedup_vs_vllm"] = per_domain
        decode = row.get("per_domain_decode_tokens_per_s", {})  # after the first token: TTFT left out
        ref_decode_d = {d: _median([r.get("per_domain_decode_tokens_per_s", {}).get(d) for r in refs]) for d in decode}
        row["per_domain_decode_speedup_vs_vllm"] = {
            d: v / ref_decode_d[d] if v and ref_decode_d[d] else None for d, v in decode.items()}
        mine = [r for r in records if r.system == row["system"] and r.run == row["run"] and r.concurrency == c]
        row["identical_to_vllm"] = sum(ref_text.get((c, r.prompt_id)) == r.text for r in mine)
    for c in {r["concurrency"] for r in rows}:
        peer_rows = [r for r in rows if r["concurrency"] == c and r["system"].partition("@")[0] in PEERS]
        peers = [r["output_tokens_per_s"] for r in peer_rows]
        peer_decode = [r["decode_tokens_per_s"] for r in peer_rows if r.get("decode_tokens_per_s")]
        for row in rows:
            if row["concurrency"] == c and peers:
                row["speedup_vs_best_vllm_speculation"] = row["output_tokens_per_s"] / max(peers)
            if row["concurrency"] == c and peer_decode and row.get("decode_tokens_per_s"):
                row["decode_speedup_vs_best_vllm_speculation"] = row["decode_tokens_per_s"] / max(peer_decode)


def format_table(report: dict[str, Any]) -> str:
    """The report's rows as a fixed-width text table, one line per (system, run, concurrency)."""
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = [f"{'system':>15} {'run':>3} {'c':>2} {'tok/s':>6} {'x vllm':>6} {'x best spec':>11} "
             f"{'decode x vllm':>13} {'decode x spec':>13} {'TPOT ms':>7} "
             f"{'TTFT s':>6} {'p50 s':>6} {'p99 s':>6} {'acc.len':>7} {'late':>5} {'w/draft':>7} "
             f"{'step ms':>7} {'busy':>5} identical"]
    for r in report["rows"]:
        busy = [d["busy_fraction"] for d in r.get("drafters", {}).values() if d["busy_fraction"] is not None]
        step = r.get("verifier_step_s")
        lines.append(
            f"{r['system']:>15} {r['run']:>3} {r['concurrency']:>2} {f(r['output_tokens_per_s']):>6} "
            f"{f(r['speedup_vs_vllm']):>6} {f(r.get('speedup_vs_best_vllm_speculation')):>11} "
            f"{f(r.get('decode_speedup_vs_vllm')):>13} {f(r.get('decode_speedup_vs_best_vllm_speculation')):>13} "
            f"{f(r['tpot_ms_p50']):>7} {f(r['ttft_s_p50']):>6} {f(r['latency_s_p50']):>6} "
            f"{f(r['latency_s_p99']):>6} {f(r['mean_acceptance_length']):>7} {f(r['drafts_late']):>5} "
            f"{f(r['steps_with_draft_fraction']):>7} {f(step * 1e3 if step else None):>7} "
            f"{f(statistics.mean(busy) if busy else None):>5} {r['identical_to_vllm']}/{r['requests']}")
    if report.get("summary") and report.get("repeat", 1) > 1:
        def spread(v: Any) -> str:
            return f"[{v[0]:.3g}-{v[1]:.3g}]" if v else ""

        lines += ["", f"medians over {report['repeat']} runs each (spread: min-max of the per-repeat ratios)"
                      + (f"; open loop at {report['request_rate']:g} requests/s: tok/s follows the arrival rate, "
                         "so read TPOT and the per-domain ratios (latency)" if report.get("request_rate") else ""),
                  f"{'system':>15} {'c':>2} {'runs':>4} {'tok/s':>6} {'x vllm':>16} {'x best spec':>16} "
                  f"{'TPOT ms':>7} {'acc.len':>7} {'w/draft':>7}"]
        for e in report["summary"]:
            vs_v = f"{f(e['ratio_vs_vllm'])} {spread(e['ratio_vs_vllm_spread'])}"
            best = "ratio_vs_best_vllm_speculation"
            vs_s = f"{f(e.get(best))} {spread(e.get(best + '_spread'))}"
            lines.append(f"{e['system']:>15} {e['concurrency']:>2} {e['runs']:>4} {f(e['output_tokens_per_s']):>6} "
                         f"{vs_v:>16} {vs_s:>16} {f(e['tpot_ms_p50']):>7} {f(e['mean_acceptance_length']):>7} "
                         f"{f(e['steps_with_draft_fraction']):>7}")
        lines += ["", "per domain x vllm: median [min-max] of the per-repeat ratios; the slowest prompt "
                      "(its mean speed over the runs x vllm's on it)"]
        for e in report["summary"]:
            if e["system"] == REFERENCE or not e.get("ratio_vs_vllm_per_domain"):
                continue
            slowest = e.get("slowest_prompt_vs_vllm", {})
            cells = [f"{d} {f(m)} [{f(lo)}-{f(hi)}]" + (f" (slowest {f(slowest[d][1])})" if d in slowest else "")
                     for d, (m, lo, hi) in e["ratio_vs_vllm_per_domain"].items()]
            lines.append(f"{e['system']:>15} {e['concurrency']:>2}  " + ", ".join(cells))
    if report.get("draft_cost"):
        lines += ["", f"{'draft engine':>12} {'model':>28} {'threads':>7} {'batch':>5} {'prefill tok/s':>13} "
                      f"{'step ms':>7} {'ms/draft token':>14}"]
        for c in report["draft_cost"]:
            figures = (f"failed: {c['error'].splitlines()[0]}" if "error" in c else
                       f"{c['threads']:>7} {c['batch']:>5} {f(c['prefill_tokens_per_s']):>13} "
                       f"{f(c['draft_step_s'] * 1e3):>7} {f(c['draft_s_per_token'] * 1e3):>14}")
            lines.append(f"{c['engine']:>12} {c['model']:>28} {figures}")
    return "\n".join(lines)


def placement_evidence_of(report: dict[str, Any]) -> dict[str, Any]:
    """What `report` measured for `cosine serve --placement auto`, as `placement.evidence_document`:
    the figures of this bench's own systems (`calibration.placement_evidence`), empty where unmeasured."""
    from cosine.simulation.calibration import placement_evidence

    base = Evidence(cores=1, pool_cores=0, source=str(report.get("workload", "")) or "cosine bench")
    try:
        measured = placement_evidence(report, base, pooled=CLUSTERS)
    except (KeyError, ValueError, ZeroDivisionError, StopIteration):  # a report without the rows it needs
        measured = base
    return evidence_document(measured)


def write_report(report: dict[str, Any], out: Path, *, evidence: bool = True) -> None:
    """Write the report as indented JSON to `out` and, with `evidence`, to `last_bench_path()`
    (what `auto` placement reads: a finished run's, not a checkpoint's), creating their directories.
    A finished report carries its placement evidence (`placement.EVIDENCE_KEY`)."""
    if evidence:
        report = {**report, EVIDENCE_KEY: placement_evidence_of(report)}
    text = json.dumps(report, indent=1)
    for path in (out, last_bench_path()) if evidence else (out,):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def plot(report: dict[str, Any], out: Path) -> None:
    """Throughput vs concurrency per system (reference runs averaged) and ratio to vLLM."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for system in dict.fromkeys(r["system"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["system"] == system]
        levels = sorted({r["concurrency"] for r in rows})
        tps = [statistics.mean(r["output_tokens_per_s"] for r in rows if r["concurrency"] == c) for c in levels]
        ratio = [statistics.mean(r["speedup_vs_vllm"] for r in rows if r["concurrency"] == c) for c in levels]
        a.plot(levels, tps, marker="o", label=system)
        b.plot(levels, ratio, marker="o", label=system)
    a.set_xlabel("concurrency" if not report.get("request_rate") else "most requests in flight")
    a.set_ylabel("output tokens/s")
    b.set_xlabel("concurrency")
    b.set_ylabel("x vLLM target-only")
    b.axhline(1.0, color="grey", lw=0.8)
    a.legend()
    load = f", open loop at {report['request_rate']:g} req/s" if report.get("request_rate") else ""
    fig.suptitle(f"{report['model']} on {report['workload']}, max_tokens {report['max_tokens']}, "
                 f"placement {report.get('placement', 'shared')}{load}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
