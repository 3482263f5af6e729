"""Which CPU cores each role of an embedded cluster runs on (`cosine serve` on one machine), and
whether local drafter pools get cores at all.

On a Kubernetes node the kubelet gives each pod its cores; on one machine `cosine serve` does it:
the verifier's engine threads (vLLM's OpenMP threads, bound through `VLLM_CPU_OMP_THREADS_BIND`)
and every drafter replica's engine threads (llama.cpp's, with the process pinned by
`sched_setaffinity`) get disjoint cores while there are enough. vLLM binds its OpenMP threads to
cores, so a drafter that shares one of them preempts the verifier's step (the whole step waits
for its slowest thread): disjoint cores are what decoupled drafting means on one machine.

Modes (`cosine serve --placement`): `split` (the verifier and each pool replica on disjoint cores),
`overlap` (the verifier on every core, pools sharing them), `lookup` (pools off: the verifier on
every core with prompt lookup only), `shared` (nothing pinned) and `auto` (the default): `choose`
gives pools their own cores only where their measured gain beats what the verifier loses.

Pure: the spec, cores and measurements in, a choice and an assignment out (`plan`); the caller
reads the evidence file (`roles.placement_choice`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from cosine.speculation_control import expected_tokens

if TYPE_CHECKING:
    from cosine_spec.cluster_spec import ClusterSpec


class Mode(StrEnum):
    """Where `cosine serve` (and `cosine bench`'s clusters) put the verifier and the pools:
    `auto` chooses from measured evidence (`choose`); `split` disjoint cores; `overlap` the
    verifier on every core, replicas sharing them; `lookup` no replicas (prompt lookup only);
    `shared` nothing pinned (what co-location costs)."""

    AUTO = "auto"
    SPLIT = "split"
    OVERLAP = "overlap"
    LOOKUP = "lookup"
    SHARED = "shared"


MODES = tuple(m.value for m in Mode)
DEFAULT = Mode.AUTO  # the CLI's, the bench's and the demo's default


@dataclass(frozen=True)
class Placement:
    """verifier: the verifier's cores. drafters: each drafter replica's cores, in the order asked.
    shared: some drafter shares cores with the verifier (too few cores for disjoint placement)."""

    verifier: tuple[int, ...]
    drafters: tuple[tuple[int, ...], ...]
    shared: bool


def place(cpus: Sequence[int], verifier_threads: int, drafter_threads: Sequence[int]) -> Placement:
    """Assign cores: the verifier takes the first `verifier_threads` of `cpus` (all of them if it
    asks for more), each drafter replica the next `threads` cores not yet taken; when the free
    cores run out, drafters take cores round-robin from the rest, then from the verifier's.

    Args:
        cpus: the cores this process may use (`os.sched_getaffinity(0)`), ascending.
        verifier_threads: cores for the verifier's engine threads (>= 1).
        drafter_threads: cores per drafter replica (each >= 1).
    Raises:
        ValueError: no cores, or a thread count below 1.
    """
    cores = sorted(set(cpus))
    if not cores:
        raise ValueError("no CPU cores to place roles on")
    if verifier_threads < 1 or any(t < 1 for t in drafter_threads):
        raise ValueError(
            f"thread counts must be >= 1, got verifier {verifier_threads}, drafters {list(drafter_threads)}"
        )
    verifier = tuple(cores[: min(verifier_threads, len(cores))])
    free = [c for c in cores if c not in verifier]
    drafters: list[tuple[int, ...]] = []
    shared = False
    cursor = 0
    for threads in drafter_threads:
        if len(free) >= threads:
            mine, free = free[:threads], free[threads:]
        else:  # not enough free cores: share, preferring cores the verifier does not use
            pool = [c for c in cores if c not in verifier] or list(cores)
            n = min(threads, len(pool))
            mine = [pool[(cursor + i) % len(pool)] for i in range(n)]
            cursor += n
            shared = shared or any(c in verifier for c in mine)
        drafters.append(tuple(mine))
    return Placement(verifier, tuple(drafters), shared)


def cpu_list(cores: Sequence[int]) -> str:
    """Cores as a Linux CPU list (`0,2-3`), as `VLLM_CPU_OMP_THREADS_BIND` and `taskset` take them."""
    out: list[str] = []
    for c in sorted(set(cores)):
        if out and "-" not in out[-1] and int(out[-1]) == c - 1:
            out[-1] = f"{out[-1]}-{c}"
        elif out and "-" in out[-1] and int(out[-1].split("-")[1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The cores of a Linux CPU list (`0,2-3` -> (0, 2, 3)), `cpu_list`'s inverse.

    Raises:
        ValueError: not a CPU list.
    """
    cores: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        last = last if dash else first
        if not (first.isdigit() and last.isdigit()) or int(last) < int(first):
            raise ValueError(f"not a CPU list like 0,2-3: {text!r}")
        cores.update(range(int(first), int(last) + 1))
    return tuple(sorted(cores))


@dataclass(frozen=True)
class Evidence:
    """What `choose` weighs, measured on this machine (None: not measured).

    cores: cores this process may use. pool_cores: cores the local pool replicas would take
    (their threads). verifier_on_gpu: the verifier computes on a GPU (pools' cores cost it nothing).
    pass_s: the verifier's decode step on every core (s). kept_pass_s: on the cores it keeps beside
    the pools (s; default: pass_s scaled by cores / (cores - pool_cores), a compute-bound pass).
    draft_token_s: a pool's seconds per draft token on its cores. pool_alpha: per-token acceptance
    of its drafts; pool_use: share of its drafts that arrived in time and still continued the
    context. lookup_hit: share of decode steps prompt lookup finds a draft; lookup_alpha its
    per-token acceptance; lookup_tokens its mean draft length. max_draft_len: k's upper bound.
    source: where the figures come from (for the report)."""

    cores: int
    pool_cores: int
    verifier_on_gpu: bool = False
    pass_s: float | None = None
    kept_pass_s: float | None = None
    draft_token_s: float | None = None
    pool_alpha: float | None = None
    pool_use: float = 1.0
    lookup_hit: float = 0.0
    lookup_alpha: float = 0.0
    lookup_tokens: int = 0
    max_draft_len: int = 8
    source: str = ""


# The placement evidence a `cosine bench` run records (its report's `placement_evidence` key) and
# `cosine serve --placement auto` reads: this format is the whole contract between the two, so
# neither imports the other.
EVIDENCE_KEY = "placement_evidence"
EVIDENCE_FORMAT = "cosine.dev/placement-evidence/v1"
MEASURED = ("pass_s", "kept_pass_s", "draft_token_s", "pool_alpha", "pool_use", "lookup_hit", "lookup_alpha",
            "lookup_tokens")  # the fields of `Evidence` a bench measures; the rest are this machine's


def evidence_document(e: Evidence) -> dict[str, Any]:
    """The measured part of `e` as a JSON-able document (`EVIDENCE_FORMAT`), for a bench report."""
    return {"format": EVIDENCE_FORMAT, "source": e.source, "measured": {f: getattr(e, f) for f in MEASURED}}


def read_evidence(doc: Any, base: Evidence) -> Evidence:
    """`base` (this machine's cores and pools) completed with a document of `evidence_document`'s.

    Raises:
        ValueError: not such a document, or a measured field of the wrong type (the message names it).
    """
    if not isinstance(doc, Mapping) or doc.get("format") != EVIDENCE_FORMAT:
        got = doc.get("format") if isinstance(doc, Mapping) else type(doc).__name__
        raise ValueError(f"{EVIDENCE_KEY}: not a {EVIDENCE_FORMAT} document (format {got!r})")
    measured = doc.get("measured")
    if not isinstance(measured, Mapping):
        raise ValueError(f"{EVIDENCE_KEY}.measured: expected an object")
    types = {f.name: f.type for f in fields(Evidence)}
    values: dict[str, Any] = {}
    for name in MEASURED:
        value = measured.get(name)
        optional = "None" in str(types[name])
        if value is None and optional:
            values[name] = None
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{EVIDENCE_KEY}.measured.{name}: expected a number, got {value!r}")
        else:
            values[name] = int(value) if "int" in str(types[name]) else float(value)
    return replace(base, **values, source=str(doc.get("source") or base.source))


@dataclass(frozen=True)
class Choice:
    """mode: `split` or `lookup`. reason: one line for the report. Goodputs in tokens per second
    of one request's decoding (None: not estimated)."""

    mode: str
    reason: str
    split_tok_s: float | None = None
    lookup_tok_s: float | None = None


def choose(e: Evidence, margin: float = 0.05) -> Choice:
    """`auto`: give local drafter pools their own cores (`split`) only where their measured gain
    beats what the verifier loses; else pools off (`lookup`, the verifier on every core).

    Per decode step of one request, prompt lookup adds lookup_hit × (E[tokens | alpha_L, k_L] - 1)
    tokens; a pool adds pool_use × (E[tokens | alpha_P, k_P] - 1), where k_P is what it drafts
    within one verifier step (kept_pass_s / draft_token_s, at most max_draft_len) and E is the
    expected tokens of one verification (Leviathan et al. 2023, arXiv:2211.17192, §3.1). With
    pools, the better of the two per step on the kept cores; without, lookup on every core:
        split: (1 + max(lookup, pool)) / kept_pass_s     lookup: (1 + lookup) / pass_s
    `split` wins only by more than `margin` (a choice that costs speed is worse than none).
    Unmeasured pools (no acceptance or draft cost) stay off: on a CPU verifier their cores are
    the verifier's. On a GPU verifier pools cost it nothing: `split`.

    Raises:
        ValueError: cores < 1 or pool_cores < 0.
    """
    if e.cores < 1 or e.pool_cores < 0:
        raise ValueError(f"need cores >= 1 and pool_cores >= 0, got {e.cores}, {e.pool_cores}")
    if e.pool_cores == 0:
        return Choice("lookup", "no drafter pools: the verifier on every core with prompt lookup")
    if e.verifier_on_gpu:
        return Choice("split", f"pools on {e.pool_cores} CPU core(s): the verifier computes on its GPU")
    every = f"the verifier on all {e.cores} cores with prompt lookup"
    if e.pool_alpha is None or e.draft_token_s is None or e.pass_s is None:
        return Choice("lookup", f"pools off: not measured on this machine yet ({e.source or 'no bench run'}); {every}")
    if e.pool_cores >= e.cores:
        return Choice("lookup", f"pools off: they would take all {e.cores} cores; {every}")
    kept = e.kept_pass_s if e.kept_pass_s is not None else e.pass_s * e.cores / (e.cores - e.pool_cores)
    lookup = e.lookup_hit * (expected_tokens(e.lookup_alpha, max(0, e.lookup_tokens)) - 1.0)
    k_pool = min(e.max_draft_len, math.floor(kept / e.draft_token_s)) if e.draft_token_s > 0 else e.max_draft_len
    pool = e.pool_use * (expected_tokens(e.pool_alpha, max(0, k_pool)) - 1.0)
    split_tok_s = (1.0 + max(lookup, pool)) / kept
    lookup_tok_s = (1.0 + lookup) / e.pass_s
    figures = (f"est. {split_tok_s:.2f} tok/s with pools on {e.pool_cores} of {e.cores} cores (step {kept:.3f} s, "
               f"pool +{pool:.2f} tokens/step at {e.draft_token_s * 1e3:.0f} ms/draft token) vs {lookup_tok_s:.2f} "
               f"without (step {e.pass_s:.3f} s, lookup +{lookup:.2f}); from {e.source}")
    if split_tok_s > lookup_tok_s * (1.0 + margin):
        return Choice("split", f"pools on their own cores: {figures}", split_tok_s, lookup_tok_s)
    return Choice("lookup", f"pools off, {every}: {figures}", split_tok_s, lookup_tok_s)


def local_pool_cores(spec: ClusterSpec) -> int:
    """Cores the spec's local drafter replicas would take (their threads, all replicas)."""
    return sum(p.threads * max(1, p.replicas) for p in spec.drafter_pools)


def decide(mode: str, spec: ClusterSpec, cpus: Sequence[int], report: Any = None, source: str = "") -> Choice:
    """`mode` as asked, or for `auto` what `choose` makes of `cpus`, the spec's local pools and the
    measurements of a `cosine bench` report (its `EVIDENCE_KEY` document; None: no bench run).
    A report without usable measurements is decided without them, and the reason says why."""
    if mode != Mode.AUTO:
        return Choice(mode, "asked for")
    base = Evidence(len(cpus), local_pool_cores(spec), verifier_on_gpu=bool(spec.verifier.pod.gpu_count),
                    max_draft_len=spec.speculation.max_draft_len)
    if report is None:
        return choose(base)
    try:
        measured = read_evidence(report.get(EVIDENCE_KEY) if isinstance(report, Mapping) else None,
                                 replace(base, source=source))
    except ValueError as e:
        unmeasured = choose(base)
        return replace(unmeasured, reason=f"{unmeasured.reason}; {source} has no usable measurements ({e})")
    return choose(measured)


def assign(spec: ClusterSpec, mode: str, cpus: Sequence[int]) -> Placement:
    """The cores of each role of `spec` on `cpus` under `mode` (resolved: not `auto`): `split`
    puts the verifier's engine threads and each drafter replica on disjoint cores (sharing only
    when there are too few); `overlap` binds the verifier to every core and lets the replicas share
    them; `lookup` starts no replica and binds the verifier to every core (prompt lookup only);
    `shared` pins nothing (vLLM binds its own threads, drafters float), which is what co-location
    costs. A verifier on GPUs keeps one core.

    Raises:
        ValueError: `auto` or an unknown mode.
    """
    replicas = [pool for pool in spec.drafter_pools for _ in range(max(1, pool.replicas))]
    if mode == Mode.SHARED:
        return Placement((), tuple(() for _ in replicas), True)
    if mode not in (Mode.SPLIT, Mode.OVERLAP, Mode.LOOKUP):
        raise ValueError(f"placement must be 'split', 'overlap', 'lookup' or 'shared', got {mode!r}")
    cpus = sorted(cpus)
    gpus = spec.verifier.pod.gpu_count
    if mode == Mode.LOOKUP:
        return Placement(() if gpus else tuple(cpus), (), False)
    threads = 1 if gpus else (len(cpus) if mode == Mode.OVERLAP else spec.verifier.threads)
    return place(cpus, threads, [p.threads for p in replicas])


def plan(mode: str, spec: ClusterSpec, cpus: Sequence[int], report: Any = None,
         source: str = "") -> tuple[Choice, Placement]:
    """`decide`, then `assign` the chosen mode: what `cosine serve` runs where.

    Raises:
        ValueError: an unknown mode.
    """
    choice = decide(mode, spec, cpus, report, source)
    return choice, assign(spec, choice.mode, cpus)
