"""Compressed draft distributions: exact round trip, size, losslessness, and the link policy."""

import pytest
import torch

from cosine.runtime.compression import Compression, choose_compression, compress, decompress, round_trip
from cosine.runtime.speculative_sampling import verify_sampling
from tests.runtime.test_speculative_sampling import VOCAB, _assert_matches


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_round_trip_is_deterministic_and_normalised(bits):
    q = torch.softmax(torch.randn(1000) * 3, -1)
    q1, wire = round_trip(q, Compression(top_k=16, bits=bits))
    q2 = decompress(wire, 1000)  # what the verifier rebuilds from the same bytes
    assert torch.equal(q1, q2)
    assert abs(float(q1.sum()) - 1) < 1e-5
    assert int((q1 > 0).sum()) <= 16
    assert int(q1.argmax()) == int(q.argmax())


def test_bytes_per_token_vs_full_vocabulary():
    q = torch.softmax(torch.randn(151_936) * 4, -1)
    wire = compress(q, Compression(top_k=32, bits=8))
    full = 151_936 * 4
    assert wire.num_bytes <= 32 * 5
    assert full / wire.num_bytes > 3000


def test_compressed_path_is_lossless():
    """The drafter samples from q~ and the verifier uses the same q~: p is preserved."""
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(2, VOCAB, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(VOCAB, generator=g) * 1.5, -1)
    q_tilde, _ = round_trip(q, Compression(top_k=3, bits=8))  # coarse: only 3 of 6 tokens survive
    counts = torch.zeros(VOCAB)
    for _ in range(12000):
        x = int(torch.multinomial(q_tilde, 1, generator=g))
        r = verify_sampling([x], q_tilde[None], p, g)
        counts[r.output_token_ids[0]] += 1
    _assert_matches(counts, p[0])


def test_choose_compression():
    slow = choose_compression(bandwidth_bytes_per_s=10_000, draft_token_s=0.05)
    fast = choose_compression(bandwidth_bytes_per_s=1e9, draft_token_s=0.05)
    assert (slow.top_k, slow.bits) == (8, 8)
    assert fast.top_k == 256 and fast.bits == 32
    with pytest.raises(ValueError, match="bits"):
        Compression(bits=4)
