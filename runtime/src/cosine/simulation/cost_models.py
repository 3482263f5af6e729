"""Cost models of the simulated cluster: how long a verification pass and a draft token take, and
how often a drafter's tokens are accepted.

Three sources, each with its provenance next to the numbers (`profiles.yaml`, package data):
(a) measured here: pass time, prompt lookup, pools' speed and acceptance, from a `cosine bench`
    JSON (`calibration.calibrate`);
(b) a roofline for GPUs: a pass reads the weights and the KV cache once and computes 2 FLOPs per
    parameter per token, so
        pass_s = max(bytes / (bandwidth * eff_bw * gpus), flops / (peak * eff_flops * gpus))
                 + overhead + tensor-parallel all-reduce latency
    (kipply, "Transformer inference arithmetic", 2022; the same shape as Vidur's roofline fallback,
    arXiv:2405.05465), on datasheet peaks; checked against NeMo's published Llama-2-7B latencies;
(c) acceptance per (drafter, domain) as a distribution: each request draws its per-token rate from
    Beta(mean * c, (1 - mean) * c), and each draft token is accepted with that rate until the first
    rejection (the model of Leviathan et al. 2023, arXiv:2211.17192, §3.1).
Attention FLOPs (4 * layers * hidden * context per token) are left out: at 256-384 tokens of
context they are < 2% of 2 * params for the models here.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from cosine.speculation_control import PassCurve


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or CPU node): datasheet peaks and a list price per device-hour."""

    name: str
    mem_bandwidth_gb_s: float
    peak_tflops: float
    memory_gib: float
    price_per_hour_usd: float


@dataclass(frozen=True)
class ModelShape:
    """Parameter count and the layer shape that sets the KV cache size (from config.json)."""

    name: str
    params_b: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes  # K and V


@dataclass(frozen=True)
class Roofline:
    """A model on `gpus` devices of one kind (tensor parallel), with the engine's efficiencies."""

    model: ModelShape
    hardware: Hardware
    gpus: int = 1
    bandwidth_efficiency: float = 0.7
    flops_efficiency: float = 0.6
    pass_overhead_s: float = 0.004
    tp_allreduce_s_per_layer: float = 0.00002

    def pass_s(self, num_tokens: int, kv_tokens: int = 0) -> float:
        """Seconds for one forward pass over `num_tokens` new tokens with `kv_tokens` cached."""
        hw, m = self.hardware, self.model
        memory_s = (m.weight_bytes + kv_tokens * m.kv_bytes_per_token) / (
            hw.mem_bandwidth_gb_s * 1e9 * self.bandwidth_efficiency * self.gpus
        )
        compute_s = 2.0 * m.params_b * 1e9 * max(1, num_tokens) / (
            hw.peak_tflops * 1e12 * self.flops_efficiency * self.gpus
        )
        tp_s = self.tp_allreduce_s_per_layer * 2 * m.layers if self.gpus > 1 else 0.0
        return max(memory_s, compute_s) + self.pass_overhead_s + tp_s

    def curve(self, kv_tokens: int, max_tokens: int = 4096) -> PassCurve:
        """The pass curve (tokens -> seconds) at a fixed KV length, at doubling token counts."""
        pts, n = [], 1
        while n <= max_tokens:
            pts.append((n, self.pass_s(n, kv_tokens)))
            n *= 2
        return PassCurve(tuple(pts))

    @property
    def price_per_hour_usd(self) -> float:
        return self.hardware.price_per_hour_usd * self.gpus


@dataclass(frozen=True)
class AcceptanceModel:
    """Per-token acceptance rate per (drafter, domain): Beta with the given mean and concentration
    (cost source (c)). `means[(drafter, domain)]`; unknown pairs use `default_mean`."""

    means: dict[tuple[str, str], float]
    concentration: dict[str, float]
    default_mean: float = 0.5

    def mean(self, drafter: str, domain: str) -> float:
        return self.means.get((drafter, domain), self.default_mean)

    def sample(self, drafter: str, domain: str, rng: random.Random) -> float:
        """One request's per-token acceptance rate."""
        m = min(max(self.mean(drafter, domain), 1e-3), 1 - 1e-3)
        c = self.concentration.get(drafter, 8.0)
        return rng.betavariate(m * c, (1 - m) * c)


def accepted_tokens(alpha: float, k: int, rng: random.Random) -> int:
    """Draft tokens accepted of `k`: a run of Bernoulli(alpha) successes, stopped by the first failure."""
    n = 0
    while n < k and rng.random() < alpha:
        n += 1
    return n


@dataclass(frozen=True)
class Profiles:
    """The shipped hardware, model and acceptance profiles (`profiles.yaml`)."""

    hardware: dict[str, Hardware]
    models: dict[str, ModelShape]
    defaults: dict[str, float]
    acceptance_raw: dict[str, dict[str, float]]

    def roofline(self, model: str, hardware: str, gpus: int = 1) -> Roofline:
        d = self.defaults
        return Roofline(
            self.models[model], self.hardware[hardware], gpus,
            d["bandwidth_efficiency"], d["flops_efficiency"], d["pass_overhead_s"], d["tp_allreduce_s_per_layer"],
        )

    def acceptance(self, drafters: dict[str, tuple[str, tuple[str, ...]]], domains: tuple[str, ...]) -> AcceptanceModel:
        """The acceptance model for pools named in `drafters`: pool -> (profile key, expertise).
        A profile with `expert`/`other` means gives the expert mean on the pool's expertise."""
        means: dict[tuple[str, str], float] = {}
        conc: dict[str, float] = {}
        for pool, (key, expertise) in drafters.items():
            raw = self.acceptance_raw[key]
            conc[pool] = float(raw.get("concentration", 8.0))
            for dom in domains:
                if "expert" in raw:
                    means[(pool, dom)] = float(raw["expert"] if dom in expertise else raw["other"])
                else:
                    means[(pool, dom)] = float(raw.get(dom, 0.5))
        return AcceptanceModel(means, conc)


def eagle3_head_fraction(shape: str) -> Callable[[int], float]:
    """An EAGLE-3 head's forward per draft token as a fraction of the target's decode pass, by
    batch size (linear between the measured batches, flat outside): MEASURED on one H100 with
    torch for the paper's target shapes (`shape`: ``llama-70b`` or ``qwen-32b``;
    `data/h100_pass_times.json`, run ``projections_only``, `tools/gpu_pass_times.py`), 1.8-3.0%.
    Applied to another GPU's decode pass it assumes head and target scale alike.
    Raises KeyError for a shape not measured."""
    raw = json.loads(resources.files("cosine.simulation").joinpath("data/h100_pass_times.json").read_text())
    run = raw["runs"]["projections_only"][shape]
    decode = {row["batch"]: row["pass_s"] for row in run["rows"] if row["tokens"] == 1}
    points = sorted((int(b), s / decode[int(b)]) for b, s in run["eagle3_head_s"].items())

    def fraction(batch: int) -> float:
        if batch <= points[0][0]:
            return points[0][1]
        for (b0, f0), (b1, f1) in zip(points, points[1:], strict=False):
            if batch <= b1:
                return f0 + (f1 - f0) * (batch - b0) / (b1 - b0)
        return points[-1][1]

    return fraction


def _piecewise(points: list[tuple[float, float]]) -> Callable[[int], float]:
    """Linear between `points` (x ascending), flat below the first, along the last segment above."""

    def f(x: int) -> float:
        if x <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = points[-2], points[-1]
        return y1 + (y1 - y0) * (x - x1) / (x1 - x0)

    return f


def proposer_step_s() -> Callable[[int], float]:
    """CoSine's proposer per engine step (`observe_step` + `propose`, wall seconds) by running
    requests, linear between the measured batches: MEASURED on this project's development machine's
    CPU, not a GPU host's (`data/proposer_step_cost.json`, `tools/proposer_step_cost.py`: the
    engine's drafter and the served suffix lookup as sources, no pools)."""
    return _step_cost("step_s")


def lookup_step_s() -> Callable[[int], float]:
    """Prompt lookup alone per engine step, as `proposer_step_s` measures it (the proposer with the
    lookup source only): what vLLM's `suffix` proposer stands for. MEASURED on CPU, as above."""
    return _step_cost("lookup_only_step_s")


def _step_cost(series: str) -> Callable[[int], float]:
    raw = json.loads(resources.files("cosine.simulation").joinpath("data/proposer_step_cost.json").read_text())
    return _piecewise(sorted((int(b), float(s)) for b, s in raw[series].items()))


# ASSUMED, from a published measurement: what a step costs more with vLLM's async scheduling off.
# vLLM PR #25872 (EAGLE-3 on Llama-3.1-8B, one L20, MT-bench, concurrency 1): inter-token latency
# 28.14 ms with the scheduler's CPU work between steps, 27.17 ms with it overlapped (async
# scheduling), ~1.0 ms a step. vLLM's own `eagle3`, `mtp` and `draft_model` run with async
# scheduling on by default on GPU (vLLM 0.32 `VllmConfig`, and PR #31998), as target-only does;
# `suffix`, `ngram` and `custom_class` cannot, and CoSine turns it off to receive the head's drafts
# (`EngineCore.post_step` hands them to the scheduler only then).
SYNC_STEP_S = 0.001

# ASSUMED, from vLLM's `ngram_gpu` (prompt lookup on the device), as no per-step time of it is
# published: PR #29184 (ngram_gpu for V1 with async scheduling) reports only end-to-end throughput,
# +20-39% over the synchronous CPU `ngram` at 2-16 requests (Qwen3-1.7B, one H20, k = 3), and PR
# #40704 (its Model Runner V2 speculator) none. What it runs is read from vLLM 0.32's source
# (`v1/worker/gpu/spec_decode/ngram/speculator.py`): two Triton kernels a step, a scan over each
# running request's token history (one program per request and block of `max_model_len`) and a
# finalize that picks the longest match and gathers the k tokens after it, both enqueued behind
# the pass with no host sync (not in a CUDA graph). At 64
# requests of 4,096 tokens the scan reads 1 MiB of int32 ids, under a microsecond of HBM time, so a
# step pays about two kernel launches (~5 us each on the device): 0.05 ms taken, about 5x that,
# for the kernels' own time; 0.1-0.3% of the paper's passes (15-50 ms).
DEVICE_LOOKUP_STEP_S = 0.00005


def load_profiles(path: Path | None = None) -> Profiles:
    """The profiles YAML (default: the one shipped with the package)."""
    if path is None:
        text = resources.files("cosine.simulation").joinpath("profiles.yaml").read_text()
    else:
        text = Path(path).read_text()
    raw: dict[str, Any] = yaml.safe_load(text)
    hw = {k: Hardware(k, **v) for k, v in raw["hardware"].items()}
    models = {k: ModelShape(k, **v) for k, v in raw["models"].items()}
    return Profiles(hw, models, {k: float(v) for k, v in raw["defaults"].items()}, raw["acceptance"])
