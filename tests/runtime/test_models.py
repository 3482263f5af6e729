"""Model runner: KV cache extend / roll back gives the same logits as recomputing from scratch."""

import pytest
import torch

from cosine.runtime.models import tiny_qwen2


def test_extend_matches_full_forward():
    m = tiny_qwen2()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    full = m.forward(m.new_sequence(), ids)
    seq = m.new_sequence()
    part = torch.cat([m.forward(seq, ids[:5]), m.forward(seq, ids[5:7]), m.forward(seq, ids[7:])])
    assert seq.num_tokens == len(ids)
    assert torch.allclose(full, part, atol=1e-5)


def test_rollback_then_extend_matches_fresh():
    m = tiny_qwen2()
    seq = m.new_sequence()
    m.forward(seq, [3, 1, 4, 1, 5])
    m.forward(seq, [7, 7, 7])  # a rejected draft
    m.rollback(seq, 5)
    assert seq.token_ids == [3, 1, 4, 1, 5]
    got = m.forward(seq, [9, 2])
    want = m.forward(m.new_sequence(), [3, 1, 4, 1, 5, 9, 2])[-2:]
    assert torch.allclose(got, want, atol=1e-5)


def test_sync_returns_missing_suffix():
    m = tiny_qwen2()
    seq = m.new_sequence()
    m.forward(seq, [1, 2, 3, 4])
    assert m.sync(seq, [1, 2, 9, 9, 9]) == [9, 9, 9]
    assert seq.token_ids == [1, 2]


def test_logits_to_keep_and_errors():
    m = tiny_qwen2()
    assert m.forward(m.new_sequence(), [1, 2, 3], logits_to_keep=1).shape == (1, m.vocab_size)
    with pytest.raises(ValueError, match="at least one"):
        m.forward(m.new_sequence(), [])
    with pytest.raises(ValueError, match="exceeds the context"):
        m.forward(m.new_sequence(), [1] * (m.max_context_tokens + 1))
    seq = m.new_sequence()
    m.forward(seq, [1, 2])
    with pytest.raises(ValueError, match="roll back"):
        m.rollback(seq, 3)
