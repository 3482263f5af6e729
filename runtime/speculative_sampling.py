"""Verification math of speculative decoding: tensors in, accepted / recovered / bonus tokens out.

Terms (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
arXiv:2211.17192, §2.3 and Algorithm 1; Chen et al. 2023, arXiv:2302.01318):

- draft tokens x_1..x_k were proposed by a drafter, x_i ~ q_i (its distribution at position i);
- the target model scores all of them in one pass, giving p_1..p_{k+1};
- **accepted** tokens: the longest prefix where each x_i passes the test below;
- **recovered** token: at the first rejected position i, a token sampled from
  norm(max(0, p_i - q_i)) (greedy: the target's argmax), which replaces x_i;
- **bonus** token: when all k draft tokens are accepted, one more token from p_{k+1} for free.

Each verification therefore emits `num_accepted + 1` tokens, and the emitted sequence has exactly the
distribution of sampling from the target alone (greedy: exactly the target's greedy output).

Rules:
- greedy (temperature 0): x_i is accepted iff x_i == argmax p_i;
- sampling: accept with probability min(1, p_i(x_i) / q_i(x_i)); on rejection sample the recovered
  token from norm(max(0, p_i - q_i)).
- a draft token with no distribution (n-gram drafter, a translated token, a fused token no single q
  produced) is a point-mass proposal q = delta(x): accept with probability p(x), otherwise sample from p
  with x removed (the same formula with q one-hot).

No requests, caches or sockets here: a function of tensors and `SamplingParams`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the target's distribution p is formed from its logits (OpenAI request semantics).

    temperature: 0 means greedy decoding. top_p: nucleus mass in (0, 1]. top_k: keep the k most
    likely tokens (0 = off). seed: per-request seed for reproducible sampling, or None.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class VerificationResult:
    """Outcome of verifying one draft.

    num_accepted: accepted draft tokens (0..k). output_token_ids: the accepted draft tokens followed by
    one recovered token (if a draft token was rejected) or one bonus token (if all were accepted);
    length num_accepted + 1. bonus: whether the last token is a bonus token.
    """

    num_accepted: int
    output_token_ids: tuple[int, ...]
    bonus: bool


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the sampling distribution: temperature, then top-k, then top-p.

    Args:
        logits: [n, vocab] (any float dtype).
        params: sampling settings; must not be greedy.

    Returns:
        float32 probabilities [n, vocab], rows summing to 1.
    """
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix with mass >= top_p (always at least the top token)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def verify_greedy(draft_token_ids: Sequence[int], target_logits: torch.Tensor) -> VerificationResult:
    """Greedy verification.

    Args:
        draft_token_ids: k draft tokens.
        target_logits: [k + 1, vocab]; row i scores the position of draft token i (row k: bonus).

    Returns:
        the accepted prefix plus the target's argmax at the first mismatch (or the bonus argmax).
    """
    k = len(draft_token_ids)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, expected k + 1 = {k + 1}")
    argmax = target_logits.argmax(dim=-1).tolist()  # [k + 1]
    n = 0
    while n < k and int(draft_token_ids[n]) == argmax[n]:
        n += 1
    return VerificationResult(n, tuple(int(t) for t in draft_token_ids[:n]) + (argmax[n],), bonus=n == k)


def verify_sampling(
    draft_token_ids: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerificationResult:
    """Lossless speculative sampling (Leviathan et al. 2023, Algorithm 1).

    Args:
        draft_token_ids: k draft tokens, x_i ~ q_i.
        draft_probs: [k, vocab] float32 q, exactly the distributions the drafter sampled from; None
            (or an all-zero row) marks point-mass proposals.
        target_probs: [k + 1, vocab] float32 p from `logits_to_probs` on the target's logits.
        generator: torch RNG for the accept tests and resampling.

    Returns:
        accepted tokens plus one recovered or bonus token.
    """
    k = len(draft_token_ids)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, expected k + 1 = {k + 1}")
    if draft_probs is not None and draft_probs.shape[0] != k:
        raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows, expected k = {k}")
    out: list[int] = []
    for i in range(k):
        x = int(draft_token_ids[i])
        p = target_probs[i]
        q = _proposal(draft_probs, i, x, p)
        px, qx = float(p[x]), float(q[x])
        u = float(torch.rand((), generator=generator))
        if qx > 0 and u < min(1.0, px / qx):
            out.append(x)
            continue
        out.append(_sample(_residual(p, q), generator))
        return VerificationResult(i, tuple(out), bonus=False)
    out.append(_sample(target_probs[k], generator))
    return VerificationResult(k, tuple(out), bonus=True)


def _proposal(draft_probs: torch.Tensor | None, i: int, x: int, like: torch.Tensor) -> torch.Tensor:
    """q_i, or the point mass at x when the drafter sent no distribution for position i."""
    if draft_probs is not None:
        q = draft_probs[i]
        if float(q.sum()) > 0:
            return q
    q = torch.zeros_like(like)
    q[x] = 1.0
    return q


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); falls back to p if the residual has no mass (p == q up to rounding)."""
    r = torch.clamp(p - q, min=0.0)
    total = float(r.sum())
    return r / total if total > 1e-12 else p


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None = None) -> list[int]:
    """One token per row of probs [n, vocab]."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()


@dataclass(frozen=True)
class TreeVerificationResult:
    """Outcome of verifying a token tree.

    path: indices of the accepted tree nodes, root to leaf (length = accepted tokens).
    output_token_ids: the accepted nodes' tokens followed by one recovered or bonus token.
    bonus: whether the last token is a bonus token (the accepted path ended at a leaf).
    """

    path: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    bonus: bool

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def verify_tree_greedy(tree, target_logits: torch.Tensor) -> TreeVerificationResult:
    """Greedy tree verification: from the root, descend into the child whose token is the target's
    argmax, until no child matches; then emit that argmax (SpecInfer, arXiv:2305.09781, §4).

    Args:
        tree: a `fusion.TokenTree` of n nodes.
        target_logits: [n + 1, vocab]; row 0 scores the token after the root (the last accepted
            token), row i + 1 the token after node i.
    """
    _check_tree_rows(tree, target_logits)
    argmax = target_logits.argmax(dim=-1).tolist()
    path: list[int] = []
    node = -1
    while True:
        want = argmax[node + 1]
        kids = tree.children(node)
        nxt = next((c for c in kids if tree.nodes[c].token_id == want), None)
        if nxt is None:
            tokens = tuple(tree.nodes[i].token_id for i in path) + (want,)
            return TreeVerificationResult(tuple(path), tokens, bonus=not kids)
        path.append(nxt)
        node = nxt


def verify_tree_sampling(
    tree, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> TreeVerificationResult:
    """Lossless multi-step speculative sampling over a token tree (SpecInfer, Miao et al. 2024,
    arXiv:2305.09781, §4.2, Algorithm 2).

    At a node, each child proposal (a drafter's token x_i, drawn independently from its q_i, or a
    point mass when q_i is None) is tried in priority order: accept with probability
    min(1, p(x_i) / q_i(x_i)); on rejection p <- norm(max(0, p - q_i)). On acceptance the walk
    descends into that child; when every proposal is rejected, a token is sampled from the residual
    p; at a leaf, the bonus token is sampled from p. A token proposed by two drafters is one node
    with two proposals, tried in turn; each drafter's deeper tokens stay independent draws from its
    own q given the path, so the output is distributed exactly as the target's.

    Args:
        tree: a `fusion.TokenTree` of n nodes; proposals carry q as a [vocab] float32 row or None.
        target_probs: [n + 1, vocab] float32 target distributions (row 0: after the root).
        generator: torch RNG for the accept tests and resampling.
    """
    _check_tree_rows(tree, target_probs)
    path: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1]
        kids = tree.children(node)
        if not kids:
            tokens = tuple(tree.nodes[i].token_id for i in path) + (_sample(p, generator),)
            return TreeVerificationResult(tuple(path), tokens, bonus=True)
        attempts = sorted(((prop.priority, c, prop) for c in kids for prop in tree.nodes[c].proposals),
                          key=lambda a: -a[0])
        accepted = None
        for _, child, prop in attempts:
            x = tree.nodes[child].token_id
            q = prop.q if prop.q is not None and float(prop.q.sum()) > 0 else _point_mass(x, p)
            px, qx = float(p[x]), float(q[x])
            u = float(torch.rand((), generator=generator))
            if qx > 0 and u < min(1.0, px / qx):
                accepted = child
                break
            p = _residual(p, q)
        if accepted is None:
            tokens = tuple(tree.nodes[i].token_id for i in path) + (_sample(p, generator),)
            return TreeVerificationResult(tuple(path), tokens, bonus=False)
        path.append(accepted)
        node = accepted


def _point_mass(x: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[x] = 1.0
    return q


def _check_tree_rows(tree, rows: torch.Tensor) -> None:
    if rows.shape[0] != tree.num_nodes + 1:
        raise ValueError(f"expected {tree.num_nodes + 1} rows (root + tree nodes), got {rows.shape[0]}")
