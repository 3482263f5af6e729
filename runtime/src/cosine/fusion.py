"""Confidence-based token fusion: several drafters' drafts merged into one token tree.

CoSine fuses the drafts of cooperating drafters by confidence (Gao et al. 2025, arXiv:2503.10325,
"confidence-based token fusion"): per position the most confident candidate continues the shared
draft. Here the drafters draft independently (they are separate processes; drafting in lock step
would cost a network round trip per token), and fusion happens over their drafts:
- the drafts are merged into a token tree (a trie rooted at the request's last accepted token,
  as in SpecInfer, Miao et al. 2024, arXiv:2305.09781, §3-4);
- at every node the children are ordered by confidence: the first child at each node is the fused
  draft (the most confident candidate per position), the others are its alternatives. The
  proposer sends vLLM the chain of first children (vLLM 0.32 verifies chains, not trees);
- a node's priority is the product, along its path, of each token's score, where a token's score
  is the geometric mean of its drafter's own confidence and the drafter's measured acceptance
  (`weights`, e.g. from the router): the paper combines confidence with agreement. The tree keeps
  the `budget` highest-priority nodes; priorities shrink along a path, so every kept node's
  parent is kept.

Pure: no torch, no clock. Draft tokens are point-mass proposals: no distribution travels with them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftPath:
    """One drafter's draft: `token_ids[i]` drafted with top probability `confidences[i]`."""

    drafter: str
    token_ids: tuple[int, ...]
    confidences: tuple[float, ...]


@dataclass(frozen=True)
class Proposal:
    """A drafter's claim on a tree node: its score there."""

    drafter: str
    priority: float


@dataclass(frozen=True)
class TreeNode:
    """token_id at depth `depth` (1 = right after the last accepted token) under node `parent` (-1:
    the root, i.e. the last accepted token). proposals: best first."""

    token_id: int
    parent: int
    depth: int
    proposals: tuple[Proposal, ...]

    @property
    def priority(self) -> float:
        """The best proposal's priority, in [0, 1]."""
        return self.proposals[0].priority


@dataclass(frozen=True)
class TokenTree:
    """Nodes in topological order (parents first), children of each node in priority order."""

    nodes: tuple[TreeNode, ...]

    @property
    def num_nodes(self) -> int:
        """Number of nodes (draft tokens), excluding the root."""
        return len(self.nodes)

    @property
    def parents(self) -> list[int]:
        """Parent index of each node, -1 for the root."""
        return [n.parent for n in self.nodes]

    @property
    def token_ids(self) -> list[int]:
        """Token id of each node."""
        return [n.token_id for n in self.nodes]

    @property
    def depth(self) -> int:
        """Deepest node's depth in tokens (0 for an empty tree)."""
        return max((n.depth for n in self.nodes), default=0)

    def children(self, index: int) -> list[int]:
        """Indices of the children of node `index` (-1: the root), best first."""
        kids = [i for i, n in enumerate(self.nodes) if n.parent == index]
        return sorted(kids, key=lambda i: -self.nodes[i].priority)

    def path_of(self, drafter: str) -> list[int]:
        """The node indices of `drafter`'s draft, root to leaf."""
        return [i for i, n in enumerate(self.nodes) if any(p.drafter == drafter for p in n.proposals)]


def token_score(confidence: float, weight: float) -> float:
    """A draft token's fusion score in [0, 1]: sqrt(confidence x measured acceptance)."""
    return math.sqrt(min(1.0, max(0.0, confidence)) * min(1.0, max(0.0, weight)))


def fused_chain(drafts: Sequence[DraftPath], max_len: int,
                weights: Mapping[str, float] | None = None) -> tuple[tuple[int, ...], tuple[DraftPath, ...]]:
    """The chain of `fuse(drafts, budget, weights)`'s first children (the most confident candidate
    per position, each continuing the chain before it), at most `max_len` long, with the draft that
    wins each position (the node's best proposal): what the proposer verifies through vLLM, which
    takes chains. Computed position by position over the drafts still agreeing with the chain,
    without building the tree (equal to the tree's chain whenever `budget` keeps every node, as
    the proposer's `max_len` x drafts does; ties go to the earlier draft, as in the tree).

    Raises:
        ValueError: a draft whose confidences do not match its tokens.
    """
    weights = weights or {}
    for d in drafts:
        if len(d.confidences) != len(d.token_ids):
            raise ValueError(f"draft of {d.drafter}: {len(d.token_ids)} tokens but {len(d.confidences)} confidences")
    # each draft still agreeing with the chain: (draft, its path priority so far, its weight in [0, 1]);
    # a token's score is token_score's, sqrt(confidence x weight), with the weight clamped once
    alive = [(d, 1.0, min(1.0, max(0.0, weights.get(d.drafter, 1.0)))) for d in drafts]
    chain: list[int] = []
    winners: list[DraftPath] = []
    sqrt = math.sqrt
    for depth in range(max_len):
        if len(alive) == 1:  # one draft still agrees: the chain follows it (priorities only rank drafts)
            d = alive[0][0]
            rest = d.token_ids[depth:max_len]
            chain += map(int, rest)
            winners += [d] * len(rest)
            break
        if len(alive) == 2 and depth < len(alive[0][0].token_ids) and depth < len(alive[1][0].token_ids):
            # the usual case, two candidates (the engine's and lookup's), as the general step below decides it
            (d0, p0, w0), (d1, p1, w1) = alive
            p0 *= sqrt(min(1.0, max(0.0, d0.confidences[depth])) * w0)
            p1 *= sqrt(min(1.0, max(0.0, d1.confidences[depth])) * w1)
            t0, t1 = int(d0.token_ids[depth]), int(d1.token_ids[depth])
            if t0 == t1:  # one token: the more confident draft wins it (the first of equals), both go on
                chain.append(t0)
                winners.append(d1 if p1 > p0 else d0)
                alive = [(d0, p0, w0), (d1, p1, w1)]
            else:  # the more confident token (the first of equals) continues, with its draft alone
                chain.append(t1 if p1 > p0 else t0)
                winners.append(d1 if p1 > p0 else d0)
                alive = [(d1, p1, w1) if p1 > p0 else (d0, p0, w0)]
            continue
        best: dict[int, tuple[float, DraftPath]] = {}  # token -> (its best path priority, that draft)
        scored = []
        for d, priority, w in alive:
            if depth >= len(d.token_ids):
                continue
            p = priority * sqrt(min(1.0, max(0.0, d.confidences[depth])) * w)
            token = int(d.token_ids[depth])
            scored.append((d, p, w, token))
            if token not in best or p > best[token][0]:
                best[token] = (p, d)
        if not best:
            break
        token = max(best, key=lambda t: best[t][0])  # the first of equals: dicts keep first appearance
        chain.append(token)
        winners.append(best[token][1])
        alive = [(d, p, w) for d, p, w, t in scored if t == token]
    return tuple(chain), tuple(winners)


def fuse(drafts: Sequence[DraftPath], budget: int, weights: Mapping[str, float] | None = None) -> TokenTree:
    """Merge drafts into a token tree of at most `budget` nodes (see the module docstring).

    Args:
        drafts: one draft per drafter (empty drafts are ignored).
        budget: maximum tree nodes (draft tokens verified in one pass, excluding the root).
        weights: per drafter, its measured acceptance rate in [0, 1] (default 1: confidence alone).

    Raises:
        ValueError: budget < 0, or a draft whose confidences do not match its tokens.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    weights = weights or {}
    # trie: (parent index, token) -> node index; node -> proposals
    index: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    claims: list[list[Proposal]] = []
    for d in drafts:
        if len(d.confidences) != len(d.token_ids):
            raise ValueError(f"draft of {d.drafter}: {len(d.token_ids)} tokens but {len(d.confidences)} confidences")
        parent, priority = -1, 1.0
        w = weights.get(d.drafter, 1.0)
        for i, token in enumerate(d.token_ids):
            priority *= token_score(d.confidences[i], w)
            key = (parent, int(token))
            node = index.get(key)
            if node is None:
                node = index[key] = len(tokens)
                tokens.append(int(token))
                parents.append(parent)
                depths.append(i + 1)
                claims.append([])
            claims[node].append(Proposal(d.drafter, priority))
            parent = node
    best = [max(p.priority for p in c) for c in claims]
    # keep the `budget` best nodes; ties go to the shallower node, so a parent ranks before its child
    kept = sorted(sorted(range(len(tokens)), key=lambda i: (-best[i], depths[i], i))[:budget])
    remap = {old: new for new, old in enumerate(kept)}
    nodes = tuple(
        TreeNode(tokens[i], remap[parents[i]] if parents[i] >= 0 else -1, depths[i],
                 tuple(sorted(claims[i], key=lambda p: -p.priority)))
        for i in kept
    )
    return TokenTree(nodes)
