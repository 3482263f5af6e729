"""Model-free drafting: prompt lookup and a suffix cache of accepted continuations.

`ngram_propose` (pure, after vLLM's n-gram proposer and prompt-lookup decoding, Saxena 2023): find
the most recent earlier occurrence of the context's last n tokens (longest n first) and propose
the tokens that followed it. `SuffixCache` extends the lookup across requests: continuations the
target emitted for earlier requests are indexed by their preceding n-gram (after SuffixDecoding,
arXiv:2411.04975), which pays off on repeated templates, code edits and extraction.

Drafts carry no distribution: they are point-mass proposals, which vLLM's rejection sampler
verifies losslessly (accept x with p(x), else sample from p without x).
Costs microseconds and no accelerator, so it runs beside anything.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence as Seq

from cosine.drafter import Draft


def ngram_propose(context: Seq[int], max_tokens: int, *, min_n: int = 2, max_n: int = 4) -> tuple[list[int], int]:
    """Prompt lookup: (proposed tokens, n of the matched n-gram); ([], 0) when nothing matches.

    Looks for the latest earlier occurrence of context[-n:] for n = max_n .. min_n and returns up to
    `max_tokens` tokens that followed it.
    """
    size = len(context)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = list(context[size - n:])
        first = suffix[0]
        for start in range(size - n - 1, -1, -1):  # latest occurrence first, excluding the suffix itself
            if context[start] == first and list(context[start:start + n]) == suffix:
                follow = list(context[start + n:start + n + max_tokens])
                if follow:
                    return follow, n
    return [], 0


class SuffixCache:
    """Continuations the target accepted in earlier requests, keyed by the n-gram before them.

    Bounded (least recently used entries are dropped beyond `max_entries`)."""

    def __init__(self, n: int = 3, max_entries: int = 200_000, continuation_tokens: int = 16) -> None:
        self.n = n
        self.max_entries = max_entries
        self.continuation_tokens = continuation_tokens
        self._table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def add(self, tokens: Seq[int]) -> None:
        """Index a finished request's tokens (prompt + output)."""
        n, c = self.n, self.continuation_tokens
        for i in range(len(tokens) - n):
            key = tuple(tokens[i:i + n])
            self._table[key] = tuple(tokens[i + n:i + n + c])
            self._table.move_to_end(key)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)

    def lookup(self, context: Seq[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed `context`'s last n tokens; [] on a miss."""
        if len(context) < self.n:
            return []
        follow = self._table.get(tuple(context[-self.n:]))
        return list(follow[:max_tokens]) if follow else []


class NgramDrafter:
    """A `Drafter` without a model: prompt lookup in the request's own context, then the suffix
    cache. Confidence of a proposal is matched n / max_n (0.5 for suffix-cache hits)."""

    def __init__(self, name: str = "ngram", *, min_n: int = 2, max_n: int = 4, cache: SuffixCache | None = None):
        self.name = name
        self.min_n = min_n
        self.max_n = max_n
        self.cache = cache if cache is not None else SuffixCache()
        self._contexts: dict[str, list[int]] = {}

    def propose(self, request_id: str, context_ids: Seq[int], max_tokens: int, *, min_confidence: float = 0.0) -> Draft:
        """Up to `max_tokens` tokens by prompt lookup, else from the suffix cache; empty when the
        confidence is below `min_confidence`. Remembers the context for `release`."""
        t0 = time.perf_counter()
        self._contexts[request_id] = list(context_ids)
        if max_tokens <= 0:
            return Draft((), (), self.name, 0.0)
        tokens, n = ngram_propose(context_ids, max_tokens, min_n=self.min_n, max_n=self.max_n)
        conf = n / self.max_n
        if not tokens:
            tokens, conf = self.cache.lookup(context_ids, max_tokens), 0.5
        if conf < min_confidence:
            tokens = []
        return Draft(tuple(tokens), (conf,) * len(tokens), self.name, time.perf_counter() - t0)

    def release(self, request_id: str) -> None:
        """Forget the request, indexing its last seen context in the suffix cache."""
        ctx = self._contexts.pop(request_id, None)
        if ctx:
            self.cache.add(ctx)
