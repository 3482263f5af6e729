"""The roofline against published measurements; acceptance draws."""

import random

import pytest

from cosine.simulation.cost_models import accepted_tokens, load_profiles

# NeMo Framework performance page, Llama-2 inference, 128 input / 20 output tokens, TP=1
# (docs.nvidia.com/nemo-framework/user-guide/latest/performance/llama.html): average latency, ms.
NEMO_LLAMA2_7B_MS = {("a100-80gb", 1): 234.0, ("h100-sxm", 1): 153.8, ("a100-80gb", 8): 329.5, ("h100-sxm", 8): 199.2}


@pytest.mark.parametrize(("hw", "batch"), list(NEMO_LLAMA2_7B_MS))
def test_roofline_matches_nemo_llama2_7b(hw, batch):
    roof = load_profiles().roofline("llama-2-7b", hw)
    prefill_s = roof.pass_s(128 * batch, 0)
    decode_s = sum(roof.pass_s(batch, batch * (128 + i)) for i in range(1, 20))
    predicted_ms = (prefill_s + decode_s) * 1000
    assert predicted_ms == pytest.approx(NEMO_LLAMA2_7B_MS[(hw, batch)], rel=0.15)


def test_roofline_memory_then_compute_bound():
    roof = load_profiles().roofline("deepseek-r1-distill-llama-70b", "a100-80gb", gpus=4)
    one, eight, big = roof.pass_s(1), roof.pass_s(8), roof.pass_s(4096)
    assert eight == pytest.approx(one, rel=0.01)  # decode is memory-bound: 8 tokens cost what 1 does
    assert big > 5 * one  # a long prefill is compute-bound
    assert roof.price_per_hour_usd == pytest.approx(4 * 5.12)


def test_acceptance_draws_follow_the_mean():
    prof = load_profiles()
    acc = prof.acceptance({"code": ("llama-68m-specialist", ("code",))}, ("code", "chat"))
    rng = random.Random(0)
    assert acc.mean("code", "code") == 0.72 and acc.mean("code", "chat") == 0.5
    draws = [acc.sample("code", "code", rng) for _ in range(4000)]
    assert sum(draws) / len(draws) == pytest.approx(0.72, abs=0.02)
    runs = [accepted_tokens(0.5, 8, rng) for _ in range(20000)]
    assert sum(runs) / len(runs) == pytest.approx(sum(0.5**i for i in range(1, 9)), abs=0.03)
    assert accepted_tokens(1.0, 8, rng) == 8 and accepted_tokens(0.0, 8, rng) == 0
