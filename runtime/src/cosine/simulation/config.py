"""A CoSineCluster manifest, plus a `simulation:` section, as a `SimSetup`.

The `spec` is read by the operator's own `parse_cluster_spec`, speculation included
(`spec.speculation`), so a manifest that deploys is a manifest that simulates; the `simulation:`
section says what Kubernetes would know from node labels: which hardware each role runs on, and
the network. Example (`cosine/simulation/default_cluster.yaml`):

    simulation:
      mode: cosine                      # target-only | vanilla (vLLM's draft_model) | cosine
      verifier: {hardware: a100-80gb, gpus: 4}
      pools:
        code: {hardware: rtx-4090, slots: 16, acceptance: llama-68m-specialist}
      network: {rttMs: 1.0, bandwidthGbps: 10}
      podStartSeconds: 60
      workload: {promptTokens: 256, outputTokens: 128, requestRate: 2, durationSeconds: 300}
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from cosine_spec.autoscaling import policy_from_spec
from cosine_spec.cluster_spec import parse_cluster_spec

from cosine.pool_policy import PoolPolicy
from cosine.routing import DOMAINS, RoutingSettings
from cosine.simulation.cluster import EngineDrafterModel, PoolModel, SimSetup, VerifierModel
from cosine.simulation.cost_models import Profiles, load_profiles


@dataclass(frozen=True)
class WorkloadSettings:
    """The manifest's default workload (the CLI's flags override it)."""

    prompt_tokens: int = 256
    output_tokens: int = 128
    request_rate: float = 2.0
    duration_s: float = 300.0


def load_cluster(path: Path | None) -> dict[str, Any]:
    """The manifest at `path`, or the shipped default scenario."""
    if path is None:
        text = resources.files("cosine.simulation").joinpath("default_cluster.yaml").read_text()
    else:
        text = Path(path).read_text()
    obj: dict[str, Any] = yaml.safe_load(text)
    return obj


def pool_model(profiles: Profiles, name: str, expertise: tuple[str, ...], replicas: int, lo: int, hi: int,
               sim: dict[str, Any], rtt_s: float, bandwidth_bytes_per_s: float,
               ref_kv_tokens: int) -> PoolModel:
    """A pool on its hardware: a model drafter by roofline at `slots` concurrent requests, or n-gram."""
    if sim.get("kind") == "ngram":  # prompt lookup: microseconds per token, on CPU nodes
        return PoolModel(name, expertise, replicas, lo, hi, 1e-5, 0.0, int(sim.get("slots", 64)), rtt_s,
                         bandwidth_bytes_per_s, profiles.hardware[sim.get("hardware", "cpu-node")].price_per_hour_usd)
    roof = profiles.roofline(sim["model"], sim["hardware"], int(sim.get("gpus", 1)))
    slots = int(sim.get("slots", 8))
    step_s = roof.pass_s(slots, slots * ref_kv_tokens)  # one draft token for each of `slots` requests
    catch_up_s = roof.pass_s(512, ref_kv_tokens) / 512
    return PoolModel(name, expertise, replicas, lo, hi, step_s, catch_up_s, slots, rtt_s, bandwidth_bytes_per_s,
                     roof.price_per_hour_usd)


def build_setup(obj: dict[str, Any], profiles: Profiles | None = None, mode: str | None = None,
                seed: int = 0) -> tuple[SimSetup, WorkloadSettings]:
    """The simulation of the manifest `obj` (mode overrides `simulation.mode`)."""
    profiles = profiles or load_profiles()
    spec = parse_cluster_spec(obj["spec"])
    sim = obj.get("simulation") or {}
    w = sim.get("workload") or {}
    d = WorkloadSettings()
    workload = WorkloadSettings(
        int(w.get("promptTokens", d.prompt_tokens)), int(w.get("outputTokens", d.output_tokens)),
        float(w.get("requestRate", d.request_rate)), float(w.get("durationSeconds", d.duration_s)),
    )
    ref_kv = workload.prompt_tokens + workload.output_tokens // 2
    vs = sim.get("verifier") or {}
    vroof = profiles.roofline(spec.verifier.model, vs.get("hardware", "a100-80gb"), int(vs.get("gpus", 1)))
    net = sim.get("network") or {}
    rtt_s = float(net.get("rttMs", 1.0)) / 1000
    bw = float(net.get("bandwidthGbps", 10.0)) * 1e9 / 8
    pools, acceptance_keys = [], {}
    for p in spec.drafter_pools:
        ps = (sim.get("pools") or {}).get(p.name) or {}
        ps = {"model": p.model, "kind": p.kind, **ps}
        pools.append(pool_model(profiles, p.name, p.expertise, p.replicas, p.min_replicas, p.max_replicas, ps,
                                rtt_s, bw, ref_kv))
        acceptance_keys[p.name] = (ps.get("acceptance", p.model or "ngram"), p.expertise)
    mode = mode or sim.get("mode", "cosine")
    colocated = tuple(pools)
    engine_drafter = None
    first = (sim.get("pools") or {}).get(spec.drafter_pools[0].name) or {}
    if mode == "vanilla" and spec.drafter_pools:  # vLLM's draft_model: the first pool's drafter on the verifier
        # priced only where the manifest names its model under `simulation.pools`
        col_roof = profiles.roofline(first["model"], vs.get("hardware", "a100-80gb"), 1) if first.get("model") else None

        def token_s(batch: int) -> float:
            return col_roof.pass_s(batch, batch * ref_kv) if col_roof else 0.0

        engine_drafter = EngineDrafterModel(spec.drafter_pools[0].name, spec.speculation.max_draft_len, token_s)
    verifier = VerifierModel(
        pass_s=vroof.pass_s,
        replicas=spec.verifier.replicas,
        max_batch_tokens=spec.verifier.max_batch_tokens,
        max_requests=spec.verifier.max_num_seqs or 256,
        price_per_hour_usd=vroof.price_per_hour_usd,
    )
    scaling = None
    if spec.autoscaling.enabled and mode == "cosine":
        scaling = policy_from_spec(spec)  # as the operator builds it from the same spec
        prices = {p.name: p.price_per_hour_usd for p in colocated}  # a pool priced 0 in the spec: its profile's price
        scaling = replace(scaling, pools=tuple(
            lim if lim.price_per_hour_usd else replace(lim, price_per_hour_usd=prices.get(lim.name, 0.0))
            for lim in scaling.pools))
    acceptance = profiles.acceptance(acceptance_keys, DOMAINS)
    setup = SimSetup(
        mode=mode,
        verifier=verifier,
        pools=colocated,
        acceptance=acceptance,
        speculation=spec.speculation,
        pool_policy=PoolPolicy(  # asks priced as the autoscaler prices replicas (a pool priced 0: its profile's)
            branches=spec.speculation.branches,
            token_value_usd=spec.autoscaling.accepted_token_value_per_million_usd / 1e6,
            pool_prices=tuple((q.name, p.replica_price_per_hour_usd or q.price_per_hour_usd)
                              for p, q in zip(spec.drafter_pools, colocated, strict=True))),
        routing_settings=RoutingSettings(max_drafters=int(sim.get("maxDrafters", 1))),
        scaling=scaling,
        interval_s=float(spec.autoscaling.interval_s),
        pod_start_s=float(sim.get("podStartSeconds", 60)),
        seed=seed,
        engine_drafter=engine_drafter,
    )
    return setup, workload
