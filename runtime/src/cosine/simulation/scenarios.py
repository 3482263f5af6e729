"""The studies `cosine simulate` runs: validation against a recorded `cosine bench` run, the paper's testbed, where
disaggregated drafting pays (RTT x speed ratio), and the autoscaler at scale.

Each returns a JSON-able dict; `plots` draws them.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import multiprocessing
import os
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cosine_spec.autoscaling import PoolLimits, ScalingPolicy

from cosine.routing import DOMAINS
from cosine.simulation import calibration, config
from cosine.simulation.cluster import (
    EAGLE3,
    EngineDrafterModel,
    LookupModel,
    Preemption,
    RequestSpec,
    SimResult,
    SimSetup,
    Workload,
    poisson_requests,
    simulate,
)
from cosine.simulation.cost_models import (
    DEVICE_LOOKUP_STEP_S,
    SYNC_STEP_S,
    AcceptanceModel,
    Profiles,
    eagle3_head_fraction,
    load_profiles,
    lookup_step_s,
    proposer_step_s,
)
from cosine.sources.lookup import LOOKUP

# The paper's headline figures (Gao et al., arXiv:2503.10325, abstract and §6).
PAPER = {"latency_reduction": 0.232, "throughput_gain": 0.325}


# ------------------------------------------------------------------ validation on this machine
VALIDATED = ("vllm", "cosine-lookup", "cosine")


def bench_workload(bench: dict[str, Any], system: str, concurrency: int) -> tuple[RequestSpec, ...]:
    """The requests of one bench row, in the order it sent them: prompt tokens (counted with the
    target's tokenizer, `<bench>.meta.json`), the output tokens each produced, its domain."""
    return tuple(RequestSpec(0.0, int(bench["prompt_tokens"][x["prompt_id"]]), int(x["completion_tokens"]), x["domain"])
                 for x in calibration.records(bench, system, concurrency))


def validation(bench_json: Path, systems: tuple[str, ...] = VALIDATED, seeds: int = 5) -> dict[str, Any]:
    """Replay a recorded `cosine bench` run: each system calibrated on its concurrency-1 row
    (`calibration.calibrate`), then simulated at every concurrency of the run with the row's own
    requests (closed loop), output tokens/s averaged over `seeds` seeds. Concurrency 1 is
    in-sample (the calibration's own run), higher levels out of sample. `measured_tok_s` is the
    system's first run at the level; `measured_runs_tok_s` every run (the reference runs twice)."""
    bench = calibration.load_bench(bench_json)
    domains = tuple(sorted({x["domain"] for x in bench["records"]}))
    rows = []
    for system in systems:
        cal = calibration.calibrate(bench, system, 1)
        for c in bench["concurrency"]:
            reqs = bench_workload(bench, system, c)
            runs = [simulate(calibration.sim_setup(cal, domains, seed=i), Workload(reqs, c)).summary()
                    for i in range(seeds)]
            sim = statistics.mean(float(r["throughput_tok_s"]) for r in runs)
            measured = calibration.row(bench, system, c)
            rows.append({
                "system": system, "concurrency": c, "in_sample": c == 1,
                "measured_tok_s": measured["output_tokens_per_s"],
                "measured_runs_tok_s": [r["output_tokens_per_s"] for r in bench["rows"]
                                        if r["system"] == system and r["concurrency"] == c],
                "simulated_tok_s": sim, "error": sim / measured["output_tokens_per_s"] - 1,
                "measured_ttft_p50_s": measured["ttft_s_p50"],
                "simulated_ttft_p50_s": statistics.mean(float(r["ttft_p50_s"]) for r in runs),
                "measured_latency_p50_s": measured["latency_s_p50"],
                "simulated_latency_p50_s": statistics.mean(float(r["latency_p50_s"]) for r in runs),
            })
    return {"bench": str(bench_json), "command": bench["command"], "rows": rows,
            "calibration": {s: dataclasses.asdict(calibration.calibrate(bench, s, 1)) for s in systems}}


# ------------------------------------------------------------------ the paper's testbed
PAIRS = {
    "llama-70b": {"verifier": ("deepseek-r1-distill-llama-70b", "a100-80gb", 4),
                  "drafter": ("llama-68m", "rtx-4090"), "acceptance": "llama-68m", "shape": "llama-70b"},
    "qwen-32b": {"verifier": ("deepseek-r1-distill-qwen-32b", "a100-80gb", 2),
                 "drafter": ("qwen2.5-0.5b", "l4"), "acceptance": "qwen2.5-0.5b", "shape": "qwen-32b"},
}
# The paper's prompts are chat and question answering: ShareGPT-like chat and GSM8K-like QA.
PAPER_DOMAINS = ("chat", "math")
SPECIALISTS = (("code", ("code", "edit")), ("math", ("math",)), ("chat", ("chat",)))
# Prompt lookup per domain on reference replies (tools/lookup_on_references.py).
LOOKUP_ON_REFERENCES = Path(__file__).parent / "data" / "lookup_on_references.json"
LOOKUP_CONCENTRATION = 4.0  # the spread of a request's lookup acceptance around its domain's (as `ngram`'s)


def _pair_manifest(pair: str, mode: str, specialists: bool = True, domains: tuple[str, ...] = DOMAINS,
                   hardware: tuple[str, str] | None = None, pool_replicas: int = 1,
                   token_value_usd: float = 0.0, autoscaled: bool = False) -> dict[str, Any]:
    """The paper's testbed for one pair as a manifest, with one specialist pool per domain group
    that `domains` asks for, of `pool_replicas` replicas (`autoscaled`: from there, by the
    autoscaler at its defaults, down to zero: `minReplicas` 0). `specialists`: CoSine's pools get the
    specialist acceptance profile on their domains (assumed, `profiles.yaml`); False gives them
    the generic drafter's, so only the architecture differs from a co-located drafter.
    `hardware`: (verifier GPU, drafter GPU) instead of the paper's. `token_value_usd`: an accepted
    token's value (`spec.autoscaling.acceptedTokenValuePerMillionUsd`; 0: not set)."""
    p = PAIRS[pair]
    vm, vhw, gpus = p["verifier"]
    dm, dhw = p["drafter"]
    vhw, dhw = hardware or (vhw, dhw)
    spec_key = f"{p['acceptance']}-specialist" if specialists else p["acceptance"]
    pools = [{"name": n, "model": dm, "expertise": list(e), "replicas": pool_replicas,
              "minReplicas": 0 if autoscaled else 1, "maxReplicas": 8}
             for n, e in SPECIALISTS if set(e) & set(domains)]
    sim_pools = {q["name"]: {"hardware": dhw, "slots": 16, "model": dm,
                             "acceptance": spec_key if mode == "cosine" else p["acceptance"]} for q in pools}
    return {
        "spec": {"verifier": {"model": vm, "maxBatchTokens": 2048, "maxNumSeqs": 256}, "drafterPools": pools,
                 "speculation": {"maxDraftLen": 8}, "autoscaling": {
                     "enabled": autoscaled, "acceptedTokenValuePerMillionUsd": token_value_usd * 1e6}},
        "simulation": {"mode": mode, "verifier": {"hardware": vhw, "gpus": gpus}, "pools": sim_pools,
                       "network": {"rttMs": 1.0, "bandwidthGbps": 10}, "maxDrafters": 2},
    }


def _cost_per_hour(setup: SimSetup) -> float:
    v = setup.verifier.price_per_hour_usd * setup.verifier.replicas
    return v + (sum(p.price_per_hour_usd * p.replicas for p in setup.pools) if setup.mode == "cosine" else 0.0)


def lookup_on_references(path: Path | None = None) -> tuple[LookupModel, dict[tuple[str, str], float]]:
    """Prompt lookup as served, per domain, MEASURED on reference replies that are not our bench's
    outputs (ShareGPT's ChatGPT replies, GSM8K's worked solutions, HumanEval's solutions,
    Chit-Chat's human replies; `tools/lookup_on_references.py`, kept in
    `data/lookup_on_references.json`): the `LookupModel` (hit rate, draft tokens by domain) and
    the per-token acceptance means keyed `(lookup, domain)`."""
    raw = json.loads(Path(path or LOOKUP_ON_REFERENCES).read_text())["domains"]
    model = LookupModel(0.0, 0, {d: (float(r["hit_rate"]), float(r["mean_draft_tokens"])) for d, r in raw.items()})
    return model, {(LOOKUP, d): float(r["alpha"]) for d, r in raw.items()}


def with_lookup(setup: SimSetup, path: Path | None = None) -> SimSetup:
    """`setup` with prompt lookup on its verifier as CoSine serves it (`lookup_on_references`):
    the proposer drafts from lookup and the setup's pools, and fuses them."""
    model, means = lookup_on_references(path)
    acc = setup.acceptance
    acceptance = AcceptanceModel({**acc.means, **means}, {**acc.concentration, LOOKUP: LOOKUP_CONCENTRATION},
                                 acc.default_mean)
    return dataclasses.replace(setup, mode="cosine", lookup=model, acceptance=acceptance)


def eagle3_head(target_only: SimSetup, shape: str, k: int, ref_kv_tokens: int = 320) -> EngineDrafterModel:
    """An EAGLE-3 head inside the verifier drafting `k` tokens a step (vLLM's `eagle3`), each draft
    token one forward of the head at the batch's size, priced as a MEASURED fraction of the
    target's decode pass (`cost_models.eagle3_head_fraction(shape)`) on the setup's own roofline."""
    fraction = eagle3_head_fraction(shape)
    v = target_only.verifier

    def token_s(batch: int) -> float:
        return fraction(batch) * v.pass_s(batch, batch * ref_kv_tokens)

    return EngineDrafterModel(EAGLE3, k, token_s)


def _with_acceptance(setup: SimSetup, extra: AcceptanceModel) -> SimSetup:
    acc = setup.acceptance
    return dataclasses.replace(setup, acceptance=AcceptanceModel(
        {**acc.means, **extra.means}, {**acc.concentration, **extra.concentration}, acc.default_mean))


def eagle3_setup(target_only: SimSetup, shape: str, acceptance_key: str, k: int,
                 profiles: Profiles) -> SimSetup:
    """vLLM's own `eagle3`: the head (`eagle3_head`) drafts a chain of `k` tokens for every request
    before each step, with async scheduling on (vLLM's default for it on GPU). Acceptance from
    `profiles.yaml` (`acceptance_key`: PUBLISHED figures for Llama-3.3-70B heads)."""
    return dataclasses.replace(
        target_only, mode="vanilla", pools=(), engine_drafter=eagle3_head(target_only, shape, k),
        acceptance=profiles.acceptance({EAGLE3: (acceptance_key, ())}, DOMAINS),
        speculation=dataclasses.replace(target_only.speculation, max_draft_len=k))


# Where CoSine meets vLLM on a GPU: inside the model runner (MRV2, async scheduling on), or at the
# scheduler (V1 with async scheduling off: what CoSine served through before)
SEAMS = ("model-runner", "scheduler")


def served(setup: SimSetup, head: EngineDrafterModel | None, profiles: Profiles, head_key: str = "eagle3-public",
           lookup: bool = True, seam: str = "model-runner", lookup_anchored: bool = False) -> SimSetup:
    """`setup` as CoSine serves it on GPU: its proposer with the engine's drafter `head` as a source
    (None: no head), prompt lookup (`with_lookup`) if `lookup`, and the setup's pools, through
    `seam` (`SEAMS`); the proposer's own time per step is `cost_models.proposer_step_s` (measured
    on CPU). The model runner seam: async scheduling on; the proposer beside the GPU's step, paying
    only what it takes past it; lookup on the device over the current tokens, at
    `cost_models.DEVICE_LOOKUP_STEP_S` a step (assumed), or with `lookup_anchored` in the
    verifier's process, a step stale and free of device time (`SimSetup.lookup_anchored`). The
    scheduler seam: async scheduling off (`cost_models.SYNC_STEP_S`, assumed) and the proposer's
    time on every step. Raises ValueError for another seam."""
    if seam not in SEAMS:
        raise ValueError(f"seam must be one of {SEAMS}, got {seam!r}")
    out = with_lookup(setup) if lookup else dataclasses.replace(setup, mode="cosine")
    if head is not None:
        out = _with_acceptance(dataclasses.replace(out, engine_drafter=head),
                               profiles.acceptance({EAGLE3: (head_key, ())}, DOMAINS))
    if seam == "scheduler":
        return dataclasses.replace(out, async_scheduling=False, verifier=dataclasses.replace(
            out.verifier, sync_step_s=SYNC_STEP_S, proposer_step_s=proposer_step_s()))
    device_s = DEVICE_LOOKUP_STEP_S if lookup and not lookup_anchored else 0.0
    return dataclasses.replace(out, async_scheduling=True, proposer_overlapped=True, lookup_anchored=lookup_anchored,
                               verifier=dataclasses.replace(out.verifier, proposer_step_s=proposer_step_s(),
                                                            device_lookup_step_s=device_s))


# The study's systems: what a user would run, and CoSine as served with its ablations.
PAPER_SYSTEMS = ("target-only", "lookup", "eagle3", "eagle3-best", "cosine", "cosine-head", "cosine-no-head",
                 "cosine-no-lookup", "cosine-head-lookup-stale", "cosine-head-scheduler-seam")
BASELINES = ("lookup", "eagle3", "eagle3-best")
COSINE_SYSTEMS = ("cosine", "cosine-head", "cosine-no-head", "cosine-no-lookup", "cosine-head-lookup-stale",
                  "cosine-head-scheduler-seam")
# Each part of `cosine` and the ablation without it (`cosine-head` is `cosine` without pools)
ABLATIONS = {"head": "cosine-no-head", "lookup": "cosine-no-lookup", "pools": "cosine-head"}
EAGLE3_K = (2, 3, 5, 7)  # vLLM's num_speculative_tokens tried; the best per dollar is kept
# `cosine-autoscaled` runs this long (closed loop, beside `cosine-head` on the same requests): the
# autoscaler decides every 30 s (`spec.autoscaling.intervalSeconds`' default), so a pool that does
# not pay runs its first interval at one replica; the paper cells' runs end before one.
AUTOSCALED_S = 180.0
# The workloads: the paper's chat and question answering, and code (HumanEval-like)
WORKLOADS = {"chat": ("chat",), "qa": ("math",), "code": ("code",)}


def _best_k(setups: dict[int, SimSetup], workload: Workload) -> int:
    """The draft length whose throughput per dollar is highest on `workload` (the baseline at its best)."""
    return max(setups, key=lambda k: float(simulate(setups[k], workload).summary()["throughput_tok_s"]))


def paper_setups(pair: str, profiles: Profiles, closed: Workload, seed: int = 0,
                 hardware: tuple[str, str] | None = None, pool_replicas: int = 1,
                 domains: tuple[str, ...] = PAPER_DOMAINS) -> dict[str, SimSetup]:
    """Every system of the paper study for one pair (see `paper_testbed`), on the paper's hardware
    or `hardware` (verifier GPU, drafter GPU), each pool of `pool_replicas` replicas, with the
    specialist pools `domains` asks for. vLLM's `eagle3` heads run at their best k of `EAGLE3_K`
    on `closed`; CoSine's head (the public one, as `eagle3`'s) at the k best for `cosine-head`.
    An accepted token is valued at what the verifier alone spends on one at `closed`'s
    concurrency (`VerifierModel.usd_per_token`), so the proposer asks a pool only where what it
    adds is worth the pool's replica time (`PoolPolicy.ask_pays`); `cosine-autoscaled` is `cosine`
    with the autoscaler on (`minReplicas` 0), which also weighs each replica's price against what
    the pool adds (`cosine_spec.autoscaling`)."""
    def build(mode: str, value_usd: float = 0.0, autoscaled: bool = False) -> SimSetup:
        m = _pair_manifest(pair, mode, True, domains, hardware, pool_replicas, value_usd, autoscaled)
        return config.build_setup(m, profiles, seed=seed)[0]

    target_only = build("target-only")
    value = target_only.verifier.usd_per_token(closed.concurrency or 1, 320)
    pooled = build("cosine", value)
    shape = PAIRS[pair]["shape"]
    out = {"target-only": target_only}
    lookup = dataclasses.replace(target_only, pools=())
    out["lookup"] = dataclasses.replace(  # vLLM's `suffix`: no async scheduling; lookup's own time per step
        with_lookup(lookup), async_scheduling=False,
        verifier=dataclasses.replace(lookup.verifier, sync_step_s=SYNC_STEP_S, proposer_step_s=lookup_step_s()))
    for name, key in (("eagle3", "eagle3-public"), ("eagle3-best", "eagle3-best")):
        by_k = {k: eagle3_setup(target_only, shape, key, k, profiles) for k in EAGLE3_K}
        out[name] = by_k[_best_k(by_k, closed)]
    heads = {k: served(lookup, eagle3_head(target_only, shape, k), profiles) for k in EAGLE3_K}
    k = _best_k(heads, closed)
    out["cosine-head"] = heads[k]
    head = heads[k].engine_drafter  # the same head, at the same k, in every CoSine system
    out["cosine"] = served(pooled, head, profiles)
    out["cosine-autoscaled"] = served(build("cosine", value, autoscaled=True), head, profiles)
    out["cosine-no-head"] = served(pooled, None, profiles)
    out["cosine-no-lookup"] = served(pooled, head, profiles, lookup=False)
    # `cosine-head` with all of lookup in the verifier's process, a step stale (its lower bound:
    # none of lookup's hits on the device), and through the scheduler seam CoSine served before
    out["cosine-head-lookup-stale"] = served(lookup, head, profiles, lookup_anchored=True)
    out["cosine-head-scheduler-seam"] = served(lookup, head, profiles, seam="scheduler")
    return out


def _row(setup: SimSetup, summ: dict[str, Any]) -> dict[str, Any]:
    usd_h = _cost_per_hour(setup)
    return {"throughput_tok_s": summ["throughput_tok_s"], "tpot_p50_s": summ["tpot_p50_s"],
            "tpot_p99_s": summ["tpot_p99_s"], "usd_per_hour": usd_h,
            "tok_s_per_usd_h": float(summ["throughput_tok_s"]) / usd_h,
            "mean_accepted_per_step": summ["mean_accepted_per_step"],
            "proposer_cpu_ms_per_step": summ["proposer_cpu_ms_per_step"],
            "draft_len": (setup.engine_drafter.k if setup.engine_drafter else setup.speculation.max_draft_len)
            if setup.mode != "target-only" else 0}


def _map_cells(fn: Callable[..., Any], cells: list[tuple[Any, ...]]) -> list[Any]:
    """`fn(*cell)` for every cell, in order: on a process per core where there is more than one
    core and cell (each cell's simulation is independent and deterministic; spawned, so no engine
    thread of the caller's is forked), else here."""
    workers = min(len(cells), len(os.sched_getaffinity(0)))
    if workers < 2:
        return [fn(*cell) for cell in cells]
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(fn, *zip(*cells, strict=True)))


def _paper_cell(pair: str, workload: str, c: int, closed: tuple[RequestSpec, ...], profiles: Profiles | None,
                seed: int) -> dict[str, Any]:
    """One cell of `paper_testbed`: every system's row, the ratios and each part's gain; and
    `autoscaled`: `cosine-autoscaled` against `cosine-head` over `AUTOSCALED_S` closed loop."""
    profiles = profiles or load_profiles()
    setups = paper_setups(pair, profiles, Workload(closed[: 4 * c], c), seed, domains=WORKLOADS[workload])
    rows = {system: _row(setups[system], simulate(setups[system], Workload(closed, c)).summary())
            for system in PAPER_SYSTEMS}
    rng = random.Random(f"{seed}/{workload}/autoscaled")  # more requests than the run can finish
    long = Workload(tuple(RequestSpec(0.0, 256, 128, rng.choice(WORKLOADS[workload]))
                          for _ in range(int(AUTOSCALED_S * c))), c)
    runs = {s: simulate(setups[s], long, duration_s=AUTOSCALED_S) for s in ("cosine-head", "cosine-autoscaled")}
    auto = {s: {"throughput_tok_s": r.tokens / AUTOSCALED_S, "usd_per_hour": r.gpu_cost_usd * 3600 / AUTOSCALED_S,
                "tok_per_usd": r.tokens / r.gpu_cost_usd} for s, r in runs.items()}  # pools as their timeline ran
    rows["autoscaled"] = {
        "duration_s": AUTOSCALED_S, **auto,
        "vs_cosine_head": auto["cosine-autoscaled"]["tok_per_usd"] / auto["cosine-head"]["tok_per_usd"],
        "pool_replicas": runs["cosine-autoscaled"].replicas_timeline}

    def per_usd(a: str, b: str) -> float:
        return float(rows[a]["tok_s_per_usd_h"]) / float(rows[b]["tok_s_per_usd_h"])

    rows["ratios"] = {system: {"vs_eagle3": per_usd(system, "eagle3"),
                               "vs_eagle3_best": per_usd(system, "eagle3-best"),
                               "vs_target_only": per_usd(system, "target-only"),
                               "vs_lookup": per_usd(system, "lookup"),
                               "vs_cosine_head": per_usd(system, "cosine-head")}
                      for system in COSINE_SYSTEMS}
    rows["gains"] = {part: per_usd("cosine", without) - 1 for part, without in ABLATIONS.items()}
    return rows


def paper_testbed(profiles: Profiles | None = None, concurrency: tuple[int, ...] = (16, 64),
                  requests_per_client: int = 6, workloads: tuple[str, ...] = tuple(WORKLOADS),
                  seed: int = 0, pairs: tuple[str, ...] = tuple(PAIRS)) -> dict[str, Any]:
    """Goodput per dollar closed-loop at each `concurrency` (`requests_per_client` requests per
    client), 256 in / 128 out, on each workload of `WORKLOADS` (the paper's chat and QA prompts,
    and code), for each of `PAPER_SYSTEMS`, each what a user would run:
    - `target-only`;
    - `lookup` (vLLM's `suffix` on the verifier, measured per domain: `lookup_on_references`);
    - `eagle3` / `eagle3-best` (a draft head in the verifier, vLLM's `eagle3`: the public
      Llama-3.3-70B head's published acceptance and the best published head's, the head's cost
      measured; its k the best of `EAGLE3_K`);
    - `cosine` as served: the public head (as `eagle3`'s), lookup and specialist pools (with the
      assumed specialist edge), every candidate fused by the proposer;
    - its ablations (`ABLATIONS`): `cosine-head` (head and lookup, no pools: what a team with a head
      and no pool budget runs), `cosine-no-head` (lookup and pools), `cosine-no-lookup` (head and pools);
    - `cosine-head-lookup-stale`: `cosine-head` with all of lookup's candidates from the
      verifier's process, a step stale (the model runner seam's lower bound for lookup);
    - `cosine-head-scheduler-seam`: `cosine-head` through the scheduler seam CoSine served
      through before (async scheduling off, the proposer's time on every step).
    Per cell, ratios per dollar to `eagle3`, to target-only and to `cosine-head`, and each part's
    gain: `cosine` per dollar over the ablation without it. `pairs`: which of `PAIRS` (all)."""
    cells = []
    for pair in pairs:
        for workload in workloads:
            rng = random.Random(f"{seed}/{workload}")
            for c in concurrency:
                closed = tuple(RequestSpec(0.0, 256, 128, rng.choice(WORKLOADS[workload]))
                               for _ in range(requests_per_client * c))
                cells.append((pair, workload, c, closed, profiles, seed))
    table: dict[str, Any] = {}
    for (pair, workload, c, *_), rows in zip(cells, _map_cells(_paper_cell, cells), strict=True):
        table.setdefault(pair, {}).setdefault(workload, {})[str(c)] = rows
    return {"workloads": {w: list(d) for w, d in WORKLOADS.items() if w in workloads},
            "concurrency": list(concurrency), "pairs": table,
            "assumed": {"sync_step_s": SYNC_STEP_S, "device_lookup_step_s": DEVICE_LOOKUP_STEP_S}}


# ------------------------------------------------------------------ drafter pools on spot capacity
# ASSUMED: spot capacity at 35% of the on-demand price (the 30-40%; GKE Spot and EC2 Spot list
# 60-91% discounts that move by region and hour).
SPOT_PRICE_RATIO = 0.35
# Where the study runs: the paper's two pairs, and a Llama-70B-class target as a team would run it
# today (4x H100 SXM; the pools on L4s, the GPU GKE offers as Spot in most regions).
SPOT_TARGETS: dict[str, tuple[str, tuple[str, str] | None]] = {
    "llama-70b on 4x A100 (paper)": ("llama-70b", None),
    "qwen-32b on 2x A100 (paper)": ("qwen-32b", None),
    "llama-70b on 4x H100, pools on L4": ("llama-70b", ("h100-sxm", "l4")),
}
SPOT_SYSTEMS = ("target-only", "lookup", "eagle3", "eagle3-best", "cosine-head", "cosine", "cosine-spot")


def spot_study(profiles: Profiles | None = None, concurrency: tuple[int, ...] = (16, 64), duration_s: float = 300.0,
               preemptions_per_replica_hour: float = 6.0, notice_s: float = 30.0, replacement_s: float = 120.0,
               pool_replicas: int = 2, targets: tuple[str, ...] | None = None, seed: int = 0) -> dict[str, Any]:
    """Drafter pools on spot capacity against the systems a user would pick instead, per target of
    `SPOT_TARGETS`, closed loop at each `concurrency` for `duration_s` (chat and QA, 256 in / 128
    out, as `paper_testbed`): target-only, `lookup` (vLLM's `suffix`), `eagle3` and `eagle3-best`
    (a draft head in the verifier, `eagle3_setup`), `cosine-head` (the same head inside CoSine, with
    lookup, no pools), `cosine` as served (head, lookup and on-demand pools of `pool_replicas`
    replicas), and `cosine-spot`: the same pools at `SPOT_PRICE_RATIO` of the price,
    each replica preempted at `preemptions_per_replica_hour` with `notice_s` of notice and
    replaced after `replacement_s` (`cluster.Preemption`). Reports goodput per dollar (output
    tokens per second per USD per hour), TPOT p50/p99, the preemptions and the requests whose
    pool replica was taken from under them (re-homed), and per target which system wins. The
    cells (target, concurrency) run on a process per core (`_map_cells`)."""
    cells = [(target, c, duration_s, Preemption(preemptions_per_replica_hour, notice_s, replacement_s),
              pool_replicas, profiles, seed) for target in targets or tuple(SPOT_TARGETS) for c in concurrency]
    out: dict[str, Any] = {"assumed": {"spot_price_ratio": SPOT_PRICE_RATIO,
                                       "preemptions_per_replica_hour": preemptions_per_replica_hour,
                                       "notice_s": notice_s, "replacement_s": replacement_s},
                           "duration_s": duration_s, "targets": {}}
    for (target, c, *_), level in zip(cells, _map_cells(_spot_cell, cells), strict=True):
        out["targets"].setdefault(target, {})[str(c)] = level
    return out


def _spot_cell(target: str, c: int, duration_s: float, preemption: Preemption, pool_replicas: int,
               profiles: Profiles | None, seed: int) -> dict[str, Any]:
    """One target and concurrency of `spot_study` (its own requests, drawn from `seed`, the target
    and `c`): every system's row, the winner and `cosine-spot`'s ratios."""
    profiles = profiles or load_profiles()
    pair, hardware = SPOT_TARGETS[target]
    rng = random.Random(f"{seed}/{target}/{c}")
    n = int(c * duration_s / 0.3) + c  # more than the clients can finish in the run (128 tokens in < 0.3 s)
    reqs = tuple(RequestSpec(0.0, 256, 128, rng.choice(PAPER_DOMAINS)) for _ in range(n))
    setups = paper_setups(pair, profiles, Workload(reqs[: 4 * c], c), seed, hardware, pool_replicas)
    cos = setups["cosine"]
    spot = tuple(dataclasses.replace(p, price_per_hour_usd=p.price_per_hour_usd * SPOT_PRICE_RATIO) for p in cos.pools)
    setups["cosine-spot"] = dataclasses.replace(  # its asks priced at the spot price too
        cos, pools=spot, preemption=preemption, pool_policy=dataclasses.replace(
            cos.pool_policy, pool_prices=tuple((p.name, p.price_per_hour_usd) for p in spot)))
    level: dict[str, Any] = {}
    for system in SPOT_SYSTEMS:
        res = simulate(setups[system], Workload(reqs, c), duration_s)
        summ = res.summary()
        usd_h = res.gpu_cost_usd / (duration_s / 3600)
        level[system] = {"tok_s": summ["throughput_tok_s"], "usd_per_hour": usd_h,
                         "tok_s_per_usd_h": float(summ["throughput_tok_s"]) / usd_h,
                         "tpot_p50_s": summ["tpot_p50_s"], "tpot_p99_s": summ["tpot_p99_s"],
                         "requests": summ["requests"], "preemptions": summ["preemptions"],
                         "rehomed_requests": summ["rehomed_requests"], "drafts_late": summ["drafts_late"],
                         "draft_len": _row(setups[system], summ)["draft_len"]}
    level["winner"] = max(SPOT_SYSTEMS, key=lambda m: float(level[m]["tok_s_per_usd_h"]))
    spot = level["cosine-spot"]["tok_s_per_usd_h"]
    level["cosine_spot_vs_eagle3"] = spot / level["eagle3"]["tok_s_per_usd_h"] - 1
    level["cosine_spot_vs_eagle3_best"] = spot / level["eagle3-best"]["tok_s_per_usd_h"] - 1
    level["spot_vs_on_demand"] = spot / level["cosine"]["tok_s_per_usd_h"] - 1
    level["cosine_spot_vs_cosine_head"] = spot / level["cosine-head"]["tok_s_per_usd_h"] - 1
    return level


# ------------------------------------------------------------------ past one verifier: routing
# Multi-turn conversations, as ShareGPT's are: a short system prompt, then turns of a user message
# and a reply, each turn sent with the whole history.
CONVERSATION = {"system_tokens": 64, "user_tokens": 96, "output_tokens": 256, "turns": 4}
# vLLM's prefix cache per replica of Llama-70B on 4x A100-80GB: ~148 GB of KV blocks after the
# bfloat16 weights at 0.9 memory utilisation, 320 KB per token (80 layers x 8 KV heads x 128 x 2 x
# 2 bytes), less what running requests hold: ~400k tokens of finished conversations.
PREFIX_CACHE_TOKENS = 400_000
# MEASURED (tools/affinity_on_cpu.py, two CPU verifiers, 6 ShareGPT conversations of 3 turns, 2
# repeats): lookup's hit rate on later turns, pinned to the conversation's verifier 0.548
# [0.532-0.565], alternating 0.555 [0.553-0.556]. The history is in every turn's prompt, which
# prompt lookup indexes on any replica: the global tree adds nothing measurable.
SEEN_HIT_FACTOR = 0.99
# the routers compared; `affinity+suffix`: the endpoint picker with the suffix-affinity scorer at
# weight 1 (off in `spec.router`'s defaults), what CoSine's own signal adds
AFFINITY_ROUTERS = ("random", "session", "affinity", "affinity+suffix")
AFFINITY_SYSTEMS = ("lookup", "cosine")


def conversations(sessions: int, turns: int, system_tokens: int, user_tokens: int, output_tokens: int,
                  domains: tuple[str, ...], seed: int = 0) -> tuple[RequestSpec, ...]:
    """`sessions` conversations of `turns` turns, in order (closed loop: `Workload(sessions=True)`):
    turn t's prompt is the system prompt, the t-1 earlier turns (user message and reply: its
    `history_tokens`) and its own user message; a conversation keeps one domain."""
    rng, out = random.Random(seed), []
    for s in range(sessions):
        domain = rng.choice(domains)
        history = system_tokens
        for _ in range(turns):
            out.append(RequestSpec(0.0, history + user_tokens, output_tokens, domain, s, history))
            history += user_tokens + output_tokens
    return tuple(out)


# Uneven conversations: a quarter long (8 turns, 512-token replies), the rest short (3 turns, 128)
SKEWED = {"long_share": 0.25, "long": (8, 512), "short": (3, 128)}


def skewed_conversations(sessions: int, system_tokens: int, user_tokens: int, domains: tuple[str, ...],
                         seed: int = 0) -> tuple[RequestSpec, ...]:
    """`sessions` conversations of uneven size (`SKEWED`), in order, as `conversations` builds them."""
    rng, out = random.Random(seed), []
    for s in range(sessions):
        turns, output = SKEWED["long"] if rng.random() < SKEWED["long_share"] else SKEWED["short"]
        domain, history = rng.choice(domains), system_tokens
        for _ in range(turns):
            out.append(RequestSpec(0.0, history + user_tokens, output, domain, s, history))
            history += user_tokens + output
    return tuple(out)


def affinity_study(profiles: Profiles | None = None, replicas: int = 4, sessions: int = 96, concurrency: int = 32,
                   seen_hit_factor: float = 1.0, pair: str = "llama-70b", seed: int = 0) -> dict[str, Any]:
    """Several verifier replicas (`replicas` of the paper's pair) behind each router of
    `AFFINITY_ROUTERS` (`cluster.ROUTERS`: random as a Service spreads reconnecting clients,
    session affinity, the endpoint picker's weighted scorers with `spec.router`'s default weights,
    and the same with the suffix-affinity scorer at weight 1),
    on multi-turn chat and QA (`CONVERSATION`, `sessions` conversations, `concurrency` at a time),
    for `lookup` (CoSine's prompt and cross-request lookup alone) and `cosine` as served (lookup
    and pools). Each replica's prefix cache keeps `PREFIX_CACHE_TOKENS` of finished conversations
    (vLLM's automatic prefix caching). `seen_hit_factor`: lookup's hit rate on a later turn at a
    replica that served the conversation before, against one that did not (MEASURED on this
    machine's CPU verifiers: tools/affinity_on_cpu.py). Reports acceptance length, TTFT, TPOT,
    the prompt share found in the prefix cache and goodput per dollar."""
    profiles = profiles or load_profiles()
    reqs = conversations(sessions, domains=PAPER_DOMAINS, seed=seed, **CONVERSATION)
    workload = Workload(reqs, concurrency, sessions=True)
    base = paper_setups(pair, profiles, Workload(reqs[: 4 * concurrency], concurrency), seed)
    rows: dict[str, Any] = {}
    for system in AFFINITY_SYSTEMS:
        setup = base[system]
        assert setup.lookup is not None
        setup = dataclasses.replace(
            setup, verifier=dataclasses.replace(setup.verifier, replicas=replicas,
                                                prefix_cache_tokens=PREFIX_CACHE_TOKENS),
            lookup=dataclasses.replace(setup.lookup, seen_hit_factor=seen_hit_factor))
        for router in AFFINITY_ROUTERS:
            routed = dataclasses.replace(setup, router=router.removesuffix("+suffix"))
            if router.endswith("+suffix"):
                routed = dataclasses.replace(routed, router_weights=dataclasses.replace(
                    routed.router_weights, suffix_affinity=1.0))
            res = simulate(routed, workload)
            summ = res.summary()
            usd_h = _cost_per_hour(setup)
            rows[f"{system} / {router}"] = {
                "acceptance_length": 1 + float(summ["mean_accepted_per_step"]),
                "ttft_p50_s": summ["ttft_p50_s"], "tpot_p50_s": summ["tpot_p50_s"],
                "tpot_p99_s": summ["tpot_p99_s"], "throughput_tok_s": summ["throughput_tok_s"],
                "prefix_cache_hit_fraction": summ["prefix_cache_hit_fraction"],
                "tok_s_per_usd_h": float(summ["throughput_tok_s"]) / usd_h, "usd_per_hour": usd_h}
    # uneven conversations: where session affinity piles long ones up and the picker's load scorers
    # spread them (`cosine` only)
    skewed = Workload(skewed_conversations(sessions, CONVERSATION["system_tokens"], CONVERSATION["user_tokens"],
                                           PAPER_DOMAINS, seed), concurrency, sessions=True)
    uneven: dict[str, Any] = {}
    cos = base["cosine"]
    assert cos.lookup is not None
    cos = dataclasses.replace(cos, verifier=dataclasses.replace(cos.verifier, replicas=replicas,
                                                                prefix_cache_tokens=PREFIX_CACHE_TOKENS),
                              lookup=dataclasses.replace(cos.lookup, seen_hit_factor=seen_hit_factor))
    for router in AFFINITY_ROUTERS[:3]:
        summ = simulate(dataclasses.replace(cos, router=router), skewed).summary()
        uneven[router] = {"ttft_p50_s": summ["ttft_p50_s"], "tpot_p50_s": summ["tpot_p50_s"],
                          "latency_p99_s": summ["latency_p99_s"],
                          "prefix_cache_hit_fraction": summ["prefix_cache_hit_fraction"],
                          "tok_s_per_usd_h": float(summ["throughput_tok_s"]) / _cost_per_hour(cos)}
    for router in AFFINITY_ROUTERS[1:3]:
        row = uneven[router]
        row["per_usd_vs_random"] = row["tok_s_per_usd_h"] / uneven["random"]["tok_s_per_usd_h"] - 1
    for system in AFFINITY_SYSTEMS:
        ref = rows[f"{system} / random"]
        for router in AFFINITY_ROUTERS[1:]:
            row = rows[f"{system} / {router}"]
            row["per_usd_vs_random"] = row["tok_s_per_usd_h"] / ref["tok_s_per_usd_h"] - 1
            row["ttft_vs_random"] = row["ttft_p50_s"] / ref["ttft_p50_s"] - 1
    return {"pair": pair, "replicas": replicas, "sessions": sessions, "concurrency": concurrency,
            "conversation": CONVERSATION, "prefix_cache_tokens": PREFIX_CACHE_TOKENS,
            "seen_hit_factor": seen_hit_factor, "rows": rows, "skewed": SKEWED, "skewed_rows": uneven}


# ------------------------------------------------------------------ where disaggregation pays
def rtt_sweep(profiles: Profiles | None = None, rtts_ms: tuple[float, ...] = (0.1, 1, 5, 20, 50),
              speed_ratios: tuple[float, ...] = (0.02, 0.05, 0.1, 0.3), rates: tuple[float, ...] = (0.5, 4.0),
              duration_s: float = 60.0, seed: int = 0) -> dict[str, Any]:
    """p50 latency of remote drafting (cosine) vs co-located (vanilla) vs target-only, over RTT,
    drafter/verifier per-token time ratio t_d/t_v and load; with the closed-form server capacity
    gain 1 + gamma * t_d / t_v (gamma = draft length) that offloading drafting frees."""
    profiles = profiles or load_profiles()
    base, _ = config.build_setup(_pair_manifest("llama-70b", "cosine"), profiles, seed=seed)
    t_v = base.verifier.pass_s(1, 384)
    gamma = base.speculation.max_draft_len
    cells = []
    for rate in rates:
        reqs = poisson_requests(rate, duration_s, 256, 128, DOMAINS, seed)
        ref = {m: simulate(dataclasses.replace(base, mode="target-only"), Workload(reqs)).summary()
               for m in ("target-only",)}
        for ratio in speed_ratios:
            t_d = ratio * t_v
            pools = tuple(dataclasses.replace(p, draft_token_s=t_d) for p in base.pools)
            vanilla = dataclasses.replace(base, mode="vanilla", pools=pools, engine_drafter=EngineDrafterModel(
                pools[0].name, gamma, lambda b, t=t_d: t))
            van = simulate(vanilla, Workload(reqs)).summary()
            for rtt in rtts_ms:
                remote = dataclasses.replace(base, pools=tuple(dataclasses.replace(p, rtt_s=rtt / 1000) for p in pools))
                co = simulate(remote, Workload(reqs)).summary()
                lat = {"target-only": ref["target-only"]["latency_p50_s"], "vanilla": van["latency_p50_s"],
                       "cosine": co["latency_p50_s"]}
                cells.append({"rate": rate, "speed_ratio": ratio, "rtt_ms": rtt, "latency_p50_s": lat,
                              "best": min(lat, key=lambda k: float(lat[k])),
                              "closed_form_capacity": 1 + gamma * ratio})
    return {"t_v_s": t_v, "gamma": gamma, "cells": cells}


# ------------------------------------------------------------------ the autoscaler at scale
def _rate_trace(rate_at: Any, duration_s: float, prompt: int, output: int, seed: int) -> tuple[RequestSpec, ...]:
    """Non-homogeneous Poisson arrivals by thinning (Lewis & Shedler 1979)."""
    rng, t, out = random.Random(seed), 0.0, []
    peak = max(rate_at(x) for x in range(0, int(duration_s) + 1, 10))
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return tuple(out)
        if rng.random() < rate_at(t) / peak:
            out.append(RequestSpec(t, prompt, output, rng.choice(DOMAINS)))


def _step_manifest(gpu: tuple[int, int, int], cpu: tuple[int, int, int], autoscaled: bool,
                   token_value_per_million_usd: float) -> dict[str, Any]:
    """A GPU verifier (DeepSeek-R1-Distill-Qwen-32B on 2x A100, 2 replicas) with two pools of
    Qwen2.5-0.5B drafters: `gpu` on L4s (4 requests at once per replica) and `cpu` on CPU nodes
    (one at a time); each pool `(replicas, minReplicas, maxReplicas)`."""
    m = _pair_manifest("qwen-32b", "cosine")
    pools = []
    for name, (n, lo, hi), hardware, slots in (("gpu", gpu, "l4", 4), ("cpu", cpu, "cpu-node", 1)):
        pools.append({"name": name, "model": "qwen2.5-0.5b", "expertise": ["code", "math", "chat", "edit"],
                      "replicas": n, "minReplicas": lo, "maxReplicas": hi})
        m["simulation"]["pools"][name] = {"hardware": hardware, "slots": slots, "model": "qwen2.5-0.5b",
                                          "acceptance": "qwen2.5-0.5b"}
    for gone in ("code", "math", "chat"):
        m["simulation"]["pools"].pop(gone, None)
    m["spec"]["drafterPools"] = pools
    m["spec"]["verifier"]["replicas"] = 2
    m["spec"]["autoscaling"] = {"enabled": autoscaled, "intervalSeconds": 30, "stabilizationSeconds": 120,
                                "maxScaleDownStep": 2, "acceptedTokenValuePerMillionUsd": token_value_per_million_usd}
    return m


def autoscale_step(profiles: Profiles | None = None, phase_s: float = 240.0, rates: tuple[float, ...] = (2, 12, 4),
                   fixed_gpu: tuple[int, ...] = (0, 1, 2, 3, 4, 6), token_value_per_million_usd: float = 5.0,
                   seed: int = 0) -> dict[str, Any]:
    """The autoscaler under a load step, against the best fixed size.

    A GPU verifier with a GPU pool that starts at zero (`minReplicas` 0) and a CPU pool (see
    `_step_manifest`); Poisson load stepping through `rates` (req/s, `phase_s` each). The rule
    (`cosine_spec.autoscaling.desired_replicas`, prices from `profiles.yaml`, accepted tokens
    valued at `token_value_per_million_usd`) against every fixed size of the GPU pool in
    `fixed_gpu` (zero included; the CPU pool at 1), all on the same requests. Reports goodput per dollar (output
    tokens per USD of GPU and node time), the rule's ratio to the best fixed size, decisions to
    settle after each step, flaps, the conditions the rule raised and the replica timelines."""
    profiles = profiles or load_profiles()
    total_s = phase_s * len(rates)
    reqs = _rate_trace(lambda t: rates[min(len(rates) - 1, int(t // phase_s))], total_s, 256, 64, seed)

    def run(m: dict[str, Any]) -> tuple[SimResult, Any]:
        setup, _ = config.build_setup(m, profiles, seed=seed)
        return simulate(setup, Workload(reqs), duration_s=total_s), setup

    fixed = {}
    for n in fixed_gpu:
        res, _ = run(_step_manifest((n, n, max(1, n)), (1, 1, 1), False, token_value_per_million_usd))
        fixed[n] = res.summary() | {"tokens_per_usd": res.tokens / res.gpu_cost_usd}
    best = max(fixed, key=lambda n: fixed[n]["tokens_per_usd"])
    res, setup = run(_step_manifest((0, 0, 8), (1, 1, 8), True, token_value_per_million_usd))
    assert setup.scaling is not None
    rule = res.summary() | {"tokens_per_usd": res.tokens / res.gpu_cost_usd}
    figures = _scaling_figures(res, setup.scaling, setup.interval_s, phase_s, len(rates))
    conditions: dict[str, dict[str, Any]] = {}
    for t, pool, cond, reason in res.conditions:
        conditions.setdefault(f"{pool}:{cond}", {"first_s": t, "count": 0, "reason": reason})["count"] += 1
    gpu_tl = res.replicas_timeline["gpu"]
    return {"rates": list(rates), "phase_s": phase_s, "fixed": fixed, "best_fixed_gpu_replicas": best,
            "rule": rule, "tokens_per_usd_vs_best_fixed": rule["tokens_per_usd"] / fixed[best]["tokens_per_usd"],
            "conditions": conditions, "zero_pool_returned_s": next((t for t, n in gpu_tl if n > 0), None),
            "timeline": res.replicas_timeline, **figures}


def _scaling_figures(res: SimResult, policy: ScalingPolicy, interval_s: float, phase_s: float,
                     phases: int) -> dict[str, Any]:
    limits = {p.name: p for p in policy.pools}
    flaps, violations, convergence = 0, 0, []
    for name, tl in res.replicas_timeline.items():
        lim: PoolLimits = limits[name]
        dirs = [1 if b[1] > a[1] else -1 for a, b in zip(tl, tl[1:], strict=False) if b[1] != a[1]]
        flaps += sum(1 for a, b in zip(dirs, dirs[1:], strict=False) if a != b)
        violations += sum(1 for _, n in tl if not lim.min_replicas <= n <= lim.max_replicas)
        violations += sum(1 for a, b in zip(tl, tl[1:], strict=False) if a[1] - b[1] > policy.max_scale_down_step)
        for ph in range(phases):
            start, end = ph * phase_s, (ph + 1) * phase_s
            inside = [(t, n) for t, n in tl if start <= t < end]
            before = [n for t, n in tl if t < start]
            final = inside[-1][1] if inside else (before[-1] if before else tl[0][1])
            settle = start
            for t, n in inside:
                if abs(n - final) > 1:
                    settle = t
            convergence.append((settle - start) / interval_s)
    return {"flaps": flaps, "bound_violations": violations, "convergence_intervals_max": max(convergence),
            "convergence_intervals_mean": sum(convergence) / len(convergence),
            "peak_replicas": {n: max(x for _, x in tl) for n, tl in res.replicas_timeline.items()}}
