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


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_forward_batch_layouts_match_one_request_at_a_time(layout):
    """Both layouts of a batched pass (a prefill, a chain, a tree, a one-token decode) give each
    request the logits and KV cache it gets alone: the next pass continues exactly."""
    m = tiny_qwen2()
    prompts = [[], [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [5, 5]]
    new = [[4, 4, 8, 1, 9], [5, 3, 5], [8, 2, 8, 1], [6]]
    parents = [None, None, [-1, 0, 0, 1], None]
    keep = [1, 0, 0, 0]
    alone, batch = [], []
    for p in prompts:
        for group in (alone, batch):
            s = m.new_sequence()
            if p:
                m.forward(s, p)
            group.append(s)
    want = [m.forward(alone[0], new[0], logits_to_keep=1), m.forward(alone[1], new[1]),
            m.forward_tree(alone[2], new[2], parents[2]), m.forward(alone[3], new[3])]
    got = m.forward_batch(batch, new, parents, keep, layout=layout)
    assert m.last_layout == layout
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.allclose(g, w, atol=1e-5)
    m.keep_path(alone[2], 4, [0, 1, 3]), m.keep_path(batch[2], 4, [0, 1, 3])
    for a, b in zip(alone, batch, strict=True):  # the caches carry on identically
        assert a.token_ids == b.token_ids
        assert torch.allclose(m.forward(a, [7, 3]), m.forward(b, [7, 3]), atol=1e-5)
    with pytest.raises(ValueError, match="layout"):
        m.forward_batch(batch[:1], new[:1], layout="ragged")


def test_packing_is_chosen_when_padding_would_dominate():
    from cosine.runtime.models import ModelRunner

    m = ModelRunner.__new__(ModelRunner)
    m._flops = (3e9, 1.7e5)  # a 1.5B model: a row costs ~18,000 (query, key) pairs
    assert m.packs_better([300] * 4, [1, 1, 1, 9])  # 12 rows instead of 36
    assert not m.packs_better([300] * 4, [4] * 4)  # no padding to save, more attention
    assert not m.packs_better([4000] * 8, [1] * 7 + [2])  # long contexts: cross-request attention dominates
