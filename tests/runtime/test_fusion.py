"""Token trees: fusion of several drafts, tree attention, and lossless tree verification (greedy
and multi-step speculative sampling), down to generation with fused drafters on tiny models."""

from __future__ import annotations

import itertools

import pytest
import torch

from cosine.runtime.collaborative import CollaborativeDrafters
from cosine.runtime.drafter import Draft, ModelDrafter
from cosine.runtime.fusion import DraftPath, fuse
from cosine.runtime.models import tiny_qwen2
from cosine.runtime.ngram_drafter import NgramDrafter
from cosine.runtime.speculation_control import SpeculationSettings
from cosine.runtime.speculative_decoding import generate, generate_stream
from cosine.runtime.speculative_sampling import SamplingParams, verify_tree_greedy, verify_tree_sampling


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


def test_tree_forward_matches_chains_and_keeps_only_the_accepted_path():
    runner = tiny_qwen2(seed=3)
    ctx = [5, 6, 7, 8, 9]
    chains = ([9, 11, 12, 13], [9, 20, 21])
    refs = []
    for chain in chains:
        s = runner.new_sequence()
        runner.forward(s, ctx[:-1])
        refs.append(runner.forward(s, chain))
    seq = runner.new_sequence()
    runner.forward(seq, ctx[:-1])
    logits = runner.forward_tree(seq, [9, 11, 20, 12, 21, 13], [-1, 0, 0, 1, 2, 3])
    torch.testing.assert_close(logits[[0, 1, 3, 5]], refs[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[[0, 2, 4]], refs[1], atol=1e-5, rtol=0)
    runner.keep_path(seq, 4, [0, 2, 4])
    assert seq.token_ids == [5, 6, 7, 8, 9, 20, 21]
    s = runner.new_sequence()
    runner.forward(s, ctx + [20, 21])
    torch.testing.assert_close(runner.forward(seq, [3]), runner.forward(s, [3]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="parent"):
        runner.forward_tree(seq, [1, 2], [-1, 5])


def _onehot_logits(argmaxes: list[int], vocab: int = 16) -> torch.Tensor:
    out = torch.zeros(len(argmaxes), vocab)
    for i, t in enumerate(argmaxes):
        out[i, t] = 5.0
    return out


def test_verify_tree_greedy_follows_the_branch_the_target_agrees_with():
    tree = fuse([DraftPath("a", (5, 6, 7), (0.9,) * 3), DraftPath("b", (5, 9, 3), (0.8,) * 3)], budget=8)
    # rows: root, then one per node
    assert tree.token_ids == [5, 6, 7, 9, 3]
    r = verify_tree_greedy(tree, _onehot_logits([5, 9, 0, 0, 3, 11]))
    assert r.output_token_ids == (5, 9, 3, 11) and r.bonus and r.num_accepted == 3
    r = verify_tree_greedy(tree, _onehot_logits([5, 4, 0, 0, 0, 0]))
    assert r.output_token_ids == (5, 4) and not r.bonus
    r = verify_tree_greedy(tree, _onehot_logits([2, 0, 0, 0, 0, 0]))
    assert r.output_token_ids == (2,) and r.path == ()


def test_verify_tree_sampling_is_lossless():
    """Two drafters sample 2-token drafts independently from their own q (one of them as point
    masses); fused into a tree and verified, the first two output tokens are distributed as the
    target's p(x1) p(x2 | x1). Total variation over 10,000 trials stays within sampling noise."""
    vocab = 4
    g = torch.Generator().manual_seed(0)

    def dist(seed: int) -> torch.Tensor:
        return torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 1.5, -1)

    p_first = dist(1)
    p_second = {x: dist(10 + x) for x in range(vocab)}
    q_a = (dist(2), {x: dist(20 + x) for x in range(vocab)})  # a sampled drafter
    q_b = (dist(3), {x: dist(30 + x) for x in range(vocab)})  # a greedy-ish drafter sending no q

    counts = torch.zeros(vocab, vocab)
    trials = 10_000
    for _ in range(trials):
        drafts = []
        for name, (q1, q2), sends_q in (("a", q_a, True), ("b", q_b, False)):
            x1 = int(torch.multinomial(q1, 1, generator=g))
            x2 = int(torch.multinomial(q2[x1], 1, generator=g))
            rows = [q1, q2[x1]] if sends_q else None
            drafts.append(DraftPath(name, (x1, x2), (float(q1.max()), float(q2[x1].max())), rows))
        tree = fuse(drafts, budget=4)
        rows = [p_first] + [p_second[n.token_id] if n.depth == 1 else torch.full((vocab,), 1 / vocab)
                            for n in tree.nodes]
        # depth-2 rows are not needed for x1, x2: the bonus at depth 2 is the third token
        r = verify_tree_sampling(tree, torch.stack(rows), g)
        out = list(r.output_token_ids)
        if len(out) < 2:
            out.append(int(torch.multinomial(p_second[out[0]], 1, generator=g)))
        counts[out[0], out[1]] += 1
    want = torch.stack([p_first[x] * p_second[x] for x in range(vocab)])
    tv = 0.5 * float((counts / trials - want).abs().sum())
    assert tv < 0.03, tv


def _drafter_runners():
    return tiny_qwen2(seed=0), tiny_qwen2(seed=1, num_layers=1), tiny_qwen2(seed=2, num_layers=1)


@pytest.mark.parametrize("prompt", [[1, 2, 3, 4, 5], [7, 7, 8, 9, 7, 7, 8, 9, 7, 7]])
def test_fused_generation_is_identical_to_target_only(prompt):
    target, d1, d2 = _drafter_runners()
    want = generate(target, prompt, 40).token_ids
    pools = CollaborativeDrafters([ModelDrafter(d1, "one"), ModelDrafter(d2, "two")], fusion_width=2,
                                  tree_budget=8, parallel=False)
    got = generate(target, prompt, 40, drafter=pools, lookup=NgramDrafter("lookup"),
                   settings=SpeculationSettings(max_draft_tokens=4, adaptive=False))
    assert got.token_ids == want
    assert got.stats.tree_steps > 0 and got.stats.num_drafts > 0


def test_fused_self_draft_accepts_everything():
    """A drafter identical to the target is always right: fused with a random one, every step
    accepts the whole best branch (the tree does not lose the good drafter's tokens)."""
    target, _, other = _drafter_runners()
    same = tiny_qwen2(seed=0)
    pools = CollaborativeDrafters([ModelDrafter(other, "bad"), ModelDrafter(same, "good")], fusion_width=2,
                                  tree_budget=8, parallel=False)
    steps = list(generate_stream(target, [3, 1, 4, 1, 5], 33, drafter=pools,
                                 settings=SpeculationSettings(max_draft_tokens=4, adaptive=False)))
    assert [t for s in steps for t in s.token_ids] == list(generate(target, [3, 1, 4, 1, 5], 33).token_ids)
    good = [o for s in steps for o in s.outcomes if o.drafter == "good"]
    assert len(good) >= len(steps) - 2  # every step drafted (but the last, with one token left)
    assert all(o.num_accepted == o.num_draft_tokens > 0 for o in good)
    assert any(s.tree_nodes > 0 for s in steps)


def test_fused_sampling_runs_and_is_reproducible():
    target, d1, d2 = _drafter_runners()
    params = SamplingParams(temperature=0.8, seed=7)

    def run():
        pools = CollaborativeDrafters([ModelDrafter(d1, "one"), ModelDrafter(d2, "two")], fusion_width=2,
                                      parallel=False)
        return generate(target, [1, 2, 3], 24, params, drafter=pools,
                        settings=SpeculationSettings(max_draft_tokens=3, adaptive=False))

    a, b = run(), run()
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    assert a.stats.tree_steps > 0


def test_a_failing_pool_costs_speed_not_the_request():
    target, d1, _ = _drafter_runners()

    class Broken:
        name = "broken"

        def propose(self, *a, **kw) -> Draft:
            raise RuntimeError("drafter crashed")

        def release(self, request_id: str) -> None:
            pass

    pools = CollaborativeDrafters([Broken(), ModelDrafter(d1, "one")], fusion_width=2, parallel=False)
    got = generate(target, [1, 2, 3], 20, drafter=pools, settings=SpeculationSettings(max_draft_tokens=3,
                                                                                       adaptive=False))
    assert got.token_ids == generate(target, [1, 2, 3], 20).token_ids
    assert pools.down_until.get("broken")


def test_all_pairs_of_children_are_visited_in_priority_order():
    tree = fuse([DraftPath("a", (1,), (0.2,)), DraftPath("b", (2,), (0.9,)), DraftPath("c", (3,), (0.5,))], 3)
    assert [tree.nodes[i].token_id for i in tree.children(-1)] == [2, 3, 1]
    assert list(itertools.chain.from_iterable(tree.path_of(n) for n in "abc")) == [0, 1, 2]
