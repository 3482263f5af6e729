"""Adaptive speculation length: a pure policy, tested with plain numbers."""

import pytest

from cosine.runtime.speculation_control import (
    CostModel,
    SpeculationSettings,
    best_draft_len,
    expected_tokens,
    initial_state,
    next_draft_len,
    observe,
)

# the default pair on our CPU, roughly: 0.5B drafts at ~0.14 s/token, 1.5B verifies at ~0.37 s/pass
CPU_PAIR = CostModel(draft_token_s=0.14, verify_base_s=0.37, verify_token_s=0.02)
FREE_DRAFTER = CostModel(draft_token_s=0.0005, verify_base_s=0.37, verify_token_s=0.02)


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_no_speculation_when_acceptance_is_low():
    assert best_draft_len(0.05, CPU_PAIR, 8) == 0


def test_longer_drafts_when_acceptance_is_high():
    assert best_draft_len(0.9, CPU_PAIR, 8) >= 4
    assert best_draft_len(0.9, CPU_PAIR, 8) > best_draft_len(0.7, CPU_PAIR, 8)


def test_cheap_drafter_drafts_more():
    assert best_draft_len(0.6, FREE_DRAFTER, 8) > best_draft_len(0.6, CPU_PAIR, 8)


def test_converges_to_zero_then_probes():
    s = SpeculationSettings(max_draft_tokens=8, probe_interval_steps=4)
    state = initial_state(s)
    ks = []
    for _ in range(20):
        state, k = next_draft_len(state, s, CPU_PAIR)
        ks.append(k)
        state = observe(state, s, k, 0)  # nothing is ever accepted
    assert ks[0] > 0
    assert ks[-8:].count(0) >= 6  # mostly off ...
    assert any(k > 0 for k in ks[-8:])  # ... with periodic probes


def test_grows_with_acceptance():
    s = SpeculationSettings(max_draft_tokens=8)
    state = initial_state(s)
    for _ in range(20):
        state, k = next_draft_len(state, s, CPU_PAIR)
        state = observe(state, s, k, k)  # everything accepted
    assert next_draft_len(state, s, CPU_PAIR)[1] == 8
    assert state.acceptance_rate > 0.95


def test_fixed_when_not_adaptive_or_unmeasured():
    s = SpeculationSettings(max_draft_tokens=5, adaptive=False)
    assert next_draft_len(initial_state(s), s, CPU_PAIR)[1] == 5
    s = SpeculationSettings(max_draft_tokens=5)
    assert next_draft_len(initial_state(s), s, None)[1] == 5


def test_settings_validation():
    with pytest.raises(ValueError, match="max_draft_tokens"):
        SpeculationSettings(max_draft_tokens=-1)
    with pytest.raises(ValueError, match="min_confidence"):
        SpeculationSettings(min_confidence=2)
