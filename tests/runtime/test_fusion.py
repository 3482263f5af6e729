"""Fusion of several drafts into a token tree, ordered by confidence (the proposer sends vLLM its
chain of first children; `test_proposer` checks the fused drafts it proposes)."""

from __future__ import annotations

import itertools

import pytest

from cosine.fusion import DraftPath, fuse


def test_fuse_merges_common_prefixes_and_orders_by_confidence():
    a = DraftPath("a", (5, 6, 7), (0.9, 0.8, 0.7))
    b = DraftPath("b", (5, 9), (0.95, 0.99))
    tree = fuse([a, b], budget=10)
    assert tree.token_ids == [5, 6, 7, 9]
    assert tree.parents == [-1, 0, 1, 0]
    assert [p.drafter for p in tree.nodes[0].proposals] == ["b", "a"]  # both proposed 5; b more confident
    assert tree.children(0) == [3, 1]  # b's 9 is the fused (most confident) continuation
    assert tree.path_of("a") == [0, 1, 2]


def test_fuse_budget_keeps_the_best_nodes_and_their_ancestors():
    a = DraftPath("a", (1, 2, 3, 4), (0.9, 0.9, 0.9, 0.9))
    b = DraftPath("b", (7, 8), (0.5, 0.5))
    tree = fuse([a, b], budget=3)
    assert tree.token_ids == [1, 2, 3]
    tree = fuse([a, b], budget=3, weights={"a": 0.1, "b": 1.0})  # measured acceptance overrides confidence
    assert sorted(tree.token_ids) == [1, 7, 8]
    for node in tree.nodes:  # every kept node's parent is kept
        assert node.parent < 0 or tree.nodes[node.parent].depth == node.depth - 1
    assert fuse([a], budget=0).num_nodes == 0
    with pytest.raises(ValueError, match="confidences"):
        fuse([DraftPath("x", (1, 2), (0.5,))], budget=4)


def test_all_pairs_of_children_are_visited_in_priority_order():
    tree = fuse([DraftPath("a", (1,), (0.2,)), DraftPath("b", (2,), (0.9,)), DraftPath("c", (3,), (0.5,))], 3)
    assert [tree.nodes[i].token_id for i in tree.children(-1)] == [2, 3, 1]
    assert list(itertools.chain.from_iterable(tree.path_of(n) for n in "abc")) == [0, 1, 2]


def test_fused_chain_is_the_trees_chain_of_first_children():
    """`fused_chain` (what the proposer verifies) equals following the token tree's first children,
    on random drafts that share prefixes, tie and diverge."""
    import random

    from cosine.fusion import fused_chain

    rng = random.Random(7)
    for _ in range(300):
        k = rng.randint(1, 6)
        drafts = []
        for n in range(rng.randint(1, 4)):
            tokens = tuple(rng.choice((1, 2, 3)) for _ in range(rng.randint(0, k)))
            drafts.append(DraftPath(f"d{n}", tokens, tuple(rng.choice((0.3, 0.5, 0.9)) for _ in tokens)))
        weights = {d.drafter: rng.choice((0.5, 1.0)) for d in drafts}
        tree = fuse(drafts, budget=k * len(drafts), weights=weights)
        chain, winners, node = [], [], -1
        while len(chain) < k and tree.children(node):
            node = tree.children(node)[0]
            chain.append(tree.nodes[node].token_id)
            winners.append(tree.nodes[node].proposals[0].drafter)
        got_chain, got_winners = fused_chain(drafts, k, weights)
        assert list(got_chain) == chain and [w.drafter for w in got_winners] == winners, drafts
