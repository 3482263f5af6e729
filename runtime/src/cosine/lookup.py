"""Model-free drafting on Arctic Inference's suffix trees (SuffixDecoding, Oliaro et al.,
arXiv:2411.04975, §3-4).

`SuffixLookup` keeps one `arctic_inference.suffix_decoding.SuffixDecodingCache`: a suffix tree per
running request over its own prompt and output (prompt lookup), and one global tree over the
outputs of every request, running and finished (cross-request reuse: templates, code edits,
extraction), each node counting how often each continuation followed. A draft is the likeliest
path below the longest match of the context's end, each token carrying the tree's empirical
probability of that path (its count over its parent's, multiplied down the path: §4.2), which is
the draft's confidence (fusion weighs it against a pool's top-1 probability). `SuffixSettings`
holds vLLM's defaults for its `suffix` method (`vllm.config.SpeculativeConfig.suffix_decoding_*`).

Drafts are point-mass proposals: vLLM's rejection sampler verifies them losslessly (accept x with
p(x), else sample from p without x). Costs microseconds and no accelerator, so it runs beside anything.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from arctic_inference.suffix_decoding import SuffixDecodingCache

from cosine.drafter import Draft


@dataclass(frozen=True)
class SuffixSettings:
    """max_tree_depth: the longest context suffix matched and the deepest draft (tokens).
    max_spec_factor: a draft is at most `max_spec_factor` × the matched length (tokens).
    min_token_prob: a draft stops before a token whose path probability is below this.
    max_cached_requests: requests whose outputs the global tree keeps (first in, first out; -1: no bound).

    Raises ValueError for a depth below 1, a negative factor, a probability outside [0, 1] or
    max_cached_requests below -1."""

    max_tree_depth: int = 24
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_cached_requests: int = 10_000

    def __post_init__(self) -> None:
        if self.max_tree_depth < 1 or self.max_spec_factor < 0 or not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"need max_tree_depth >= 1, max_spec_factor >= 0 and min_token_prob in [0, 1], got {self}")
        if self.max_cached_requests < -1:
            raise ValueError(f"need max_cached_requests >= -1, got {self.max_cached_requests}")


class SuffixLookup:
    """Prompt lookup and cross-request lookup for the requests of one engine (not thread-safe:
    one caller thread, the engine's).

    A request is started with its prompt (`start`, or on its first `propose`); each `propose` first
    indexes the tokens the context gained since the last one (its output), which join the global
    tree at once; `release` drops its prompt's tree and keeps its output for other requests."""

    HIT_RATE_ALPHA = 0.02  # weight of one lookup in `hit_rate` (about the last 50 lookups)

    def __init__(self, settings: SuffixSettings = SuffixSettings()) -> None:
        self.settings = settings
        self.cache = SuffixDecodingCache(settings.max_tree_depth, settings.max_cached_requests)
        self._indexed: dict[str, int] = {}  # request id -> context tokens already in its trees
        self._prompt_len: dict[str, int] = {}  # running request id -> its prompt's tokens
        self._output_len: dict[str, int] = {}  # request id -> output tokens in the global tree
        self.lookups = 0  # propose calls that asked for a draft
        self.hits = 0  # ... and found one
        self.hit_rate = 0.0  # EMA over lookups of "found a draft": the suffix-affinity signal

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        """Index a new request's prompt (its own tree only); a request already started is left alone."""
        if request_id in self._indexed:
            return
        if request_id in self.cache.cached_requests:  # a finished request's id reused
            self.cache.evict_cached_response(request_id)
        self.cache.start_request(request_id, list(prompt))
        self._indexed[request_id] = len(prompt)
        self._prompt_len[request_id] = len(prompt)
        self._output_len[request_id] = 0

    def propose(self, request_id: str, context: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """(draft tokens, each one's path probability in (0, 1]) continuing `context` (prompt + every
        token emitted so far, a prefix of the next call's), at most `max_tokens`; ([], []) on no match.
        A context shorter than what was indexed (a preempted request recomputed) restarts the request."""
        done = self._indexed.get(request_id)
        if done is None or done > len(context):
            self.release(request_id)
            self.start(request_id, context)
        elif done < len(context):
            self.cache.add_active_response(request_id, list(context[done:]))
            self._indexed[request_id] = len(context)
            self._output_len[request_id] = self._output_len.get(request_id, 0) + len(context) - done
        if max_tokens <= 0:
            return [], []
        s = self.settings
        draft = self.cache.speculate(request_id, list(context[-s.max_tree_depth:]), max_spec_tokens=max_tokens,
                                     max_spec_factor=s.max_spec_factor, min_token_prob=s.min_token_prob)
        hit = bool(draft.token_ids)
        self.lookups += 1
        self.hits += hit
        self.hit_rate += self.HIT_RATE_ALPHA * (hit - self.hit_rate)
        return draft.token_ids, draft.probs  # (lists of the draft's own, made as it was read out)

    def held(self) -> tuple[int, int]:
        """(finished requests whose outputs the global tree holds, tokens indexed in the trees:
        running requests' prompts and outputs, finished requests' outputs). With ``hit_rate``, what
        ``cosine_suffix_tree_*`` export: how much this verifier has seen and how often it drafts
        from it (the router's suffix-affinity signal)."""
        cached = set(self.cache.cached_requests)
        for rid in [r for r in self._output_len if r not in cached and r not in self._indexed]:
            del self._output_len[rid]  # evicted from the global tree (first in, first out)
        tokens = sum(self._prompt_len.values()) + sum(self._output_len.values())
        return len(cached - set(self._indexed)), tokens

    def release(self, request_id: str) -> None:
        """Forget a finished request's prompt; its output stays in the global tree until evicted."""
        if self._indexed.pop(request_id, None) is not None:
            self.cache.stop_request(request_id)
            self._prompt_len.pop(request_id, None)

    def __len__(self) -> int:
        """Requests running (started, not released)."""
        return len(self._indexed)


class LookupDrafter:
    """A `Drafter` without a model (a pool of `engine: ngram`): `SuffixLookup` behind the drafter
    interface; each draft token's confidence is its path probability in the suffix trees."""

    def __init__(self, name: str = "ngram", settings: SuffixSettings = SuffixSettings()) -> None:
        self.name = name
        self.lookup = SuffixLookup(settings)

    def propose(self, request_id: str, context_ids: Sequence[int], max_tokens: int, *,
                min_confidence: float = 0.0) -> Draft:
        """Up to `max_tokens` draft tokens, cut before the first whose confidence is below `min_confidence`."""
        t0 = time.perf_counter()
        tokens, probs = self.lookup.propose(request_id, context_ids, max_tokens)
        keep = next((i for i, p in enumerate(probs) if p < min_confidence), len(tokens))
        return Draft(tuple(tokens[:keep]), tuple(probs[:keep]), self.name, time.perf_counter() - t0)

    def release(self, request_id: str) -> None:
        """Forget the request (its output stays for other requests)."""
        self.lookup.release(request_id)
