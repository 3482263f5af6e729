"""Collaborative drafting: several drafter pools behind one drafter, routed per request and fused.

`CollaborativeDrafters` is what the speculative decoding loop (`speculative_decoding`) and the
coordinator talk to when a cluster has more than one drafter pool (Gao et al. 2025,
arXiv:2503.10325, collaborative drafting):
- routing: each request is routed to the pools whose expertise fits (`routing.route`: measured
  acceptance per domain, the pools' own confidence, declared expertise as a prior), and re-routed
  every `reroute_every` verifications as the statistics move;
- fusion: with `fusion_width` > 1, the best `fusion_width` pools draft the same request (in
  parallel when `parallel`, e.g. remote pools), and the loop fuses their drafts into a token tree
  (`fusion.fuse`) weighted by the router's acceptance estimates;
- faults: a pool that raises is skipped for `retry_s`; the request goes on with the others, or
  without speculation (a crashed drafter costs speed, never a request).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from cosine.runtime import routing
from cosine.runtime.drafter import Draft, Drafter

log = logging.getLogger(__name__)

_EMPTY = Draft((), None, (), "none", 0.0)


class CollaborativeDrafters:
    """Drafter pools behind the `Drafter` interface, plus `propose_many` for fusion.

    Args:
        drafters: the pools (each a `Drafter`, local or `RemoteDrafter`), distinct names.
        expertise: declared domains per pool name (the routing prior).
        fusion_width: pools that draft each request together (1 = routing only, no fusion).
        tree_budget: maximum token-tree nodes per verification when fusing.
        parallel: call the fused pools concurrently (threads); right for remote pools, wrong for
            in-process models sharing the CPU.
        retry_s: seconds a failed pool is skipped.
        reroute_every: verifications between re-routing a running request.
        min_join_acceptance: a pool other than the best joins the fusion only while the router's
            expected per-token acceptance of it on the request's domain is at least this (its
            draft costs drafting time; a pool the target rarely agrees with only adds tree nodes).
        join_margin: nor when its expected acceptance is more than this below the best pool's:
            its branch wins only where it beats the best pool's, so a clearly weaker pool mostly
            adds drafting time (measured: SmolLM2 beside the 0.5B coder on math, 0.80x).
    """

    def __init__(
        self,
        drafters: Sequence[Drafter],
        expertise: dict[str, tuple[str, ...]] | None = None,
        *,
        settings: routing.RoutingSettings = routing.RoutingSettings(),
        fusion_width: int = 1,
        tree_budget: int = 16,
        parallel: bool = True,
        retry_s: float = 5.0,
        reroute_every: int = 8,
        min_join_acceptance: float = 0.35,
        join_margin: float = 0.1,
        seed: int = 0,
    ) -> None:
        if not drafters:
            raise ValueError("CollaborativeDrafters needs at least one drafter")
        if fusion_width < 1 or tree_budget < 1:
            raise ValueError(f"fusion_width and tree_budget must be >= 1, got {fusion_width}, {tree_budget}")
        self.drafters = {d.name: d for d in drafters}
        self.profiles = [routing.DrafterProfile(d.name, (expertise or {}).get(d.name, ())) for d in drafters]
        self.settings = settings
        self.fusion_width = min(fusion_width, len(self.drafters))
        self.tree_budget = tree_budget
        self.retry_s = retry_s
        self.reroute_every = reroute_every
        self.min_join_acceptance = min_join_acceptance
        self.join_margin = join_margin
        self.state = routing.RouterState()
        self.down_until: dict[str, float] = {}
        self.name = "collaborative"
        self._rng = random.Random(seed)
        self._routes: dict[str, tuple[str, list[str], int]] = {}  # request -> (domain, order, steps)
        self._lock = threading.Lock()
        workers = max(1, len(self.drafters)) if parallel else 1
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cosine-draft")
        self._parallel = parallel
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cosine-draft-ahead")

    @property
    def fuses(self) -> bool:
        return self.fusion_width > 1

    @property
    def drafts_ahead(self) -> bool:
        """Draft ahead during verification (`propose_async`) only when the pools run elsewhere."""
        return self._parallel

    def _up(self, name: str) -> bool:
        return self.down_until.get(name, 0.0) <= time.monotonic()

    def _route(self, domain: str) -> list[str]:
        s = replace(self.settings, max_drafters=len(self.profiles))
        return routing.route(domain, self.profiles, self.state, s, self._rng.betavariate)

    def assign(self, request_id: str, domain: str) -> list[str]:
        """Route a new request of `domain`: the pools to use, best first."""
        with self._lock:
            order = self._route(domain)
            self._routes[request_id] = (domain, order, 0)
        return order

    def route_of(self, request_id: str) -> tuple[str, list[str]]:
        """The request's domain and its pools, best first (unrouted: domain "chat", pool order)."""
        domain, order, _ = self._routes.get(request_id, ("chat", list(self.drafters), 0))
        return domain, order or list(self.drafters)

    def expected_acceptance(self, drafter: str, domain: str) -> float:
        """The router's posterior mean per-token acceptance of `drafter` on `domain`."""
        profile = next(p for p in self.profiles if p.name == drafter)
        with self._lock:
            return routing.expected_acceptance(self.state, profile, domain, self.settings)

    def optimistic_acceptance(self, request_id: str) -> float:
        """An upper confidence bound on the acceptance of the request's first pool on its domain
        (`routing.optimistic_acceptance`): what a first, costly try of that pool is weighed with."""
        domain, order = self.route_of(request_id)
        profile = next(p for p in self.profiles if p.name == order[0])
        with self._lock:
            return routing.optimistic_acceptance(self.state, profile, domain, self.settings)

    def weights(self, request_id: str) -> dict[str, float]:
        """Fusion weights for the request: each pool's expected acceptance on its domain."""
        domain, _ = self.route_of(request_id)
        return {p.name: self.expected_acceptance(p.name, domain) for p in self.profiles}

    def observe(self, request_id: str, drafter: str, num_draft_tokens: int, num_accepted: int,
                mean_confidence: float) -> None:
        """Fold one verification outcome of `drafter` into the router; re-route the request every
        `reroute_every` outcomes."""
        with self._lock:
            domain, order, steps = self._routes.get(request_id, ("chat", [], 0))
            if drafter in self.drafters:
                self.state = routing.observe(
                    self.state, drafter, domain, num_draft_tokens, num_accepted, mean_confidence, self.settings
                )
            if request_id in self._routes:
                steps += 1
                if steps % self.reroute_every == 0:
                    order = self._route(domain)
                self._routes[request_id] = (domain, order, steps)

    def _call(self, name: str, request_id, context_ids, max_tokens, params, min_confidence, generator) -> Draft | None:
        try:
            return self.drafters[name].propose(
                request_id, context_ids, max_tokens, params, min_confidence=min_confidence, generator=generator
            )
        except Exception as e:
            reason = e.code() if hasattr(e, "code") else e  # grpc.RpcError: the status code is enough
            log.warning("drafter %s failed (%s); skipping it for %.0f s", name, reason, self.retry_s)
            self.down_until[name] = time.monotonic() + self.retry_s
            return None

    def propose(self, request_id, context_ids, max_tokens, params, *, min_confidence=0.0, generator=None) -> Draft:
        """The draft of the best routed pool that is up (the next one if it fails); empty if none."""
        for name in self.route_of(request_id)[1]:
            if self._up(name):
                draft = self._call(name, request_id, context_ids, max_tokens, params, min_confidence, generator)
                if draft is not None:
                    return draft
        return _EMPTY

    def propose_many(self, request_id, context_ids, max_tokens, params, *, min_confidence=0.0,
                     generator=None) -> list[Draft]:
        """Drafts of the `fusion_width` best routed pools that are up (failed pools are dropped).
        Sampled drafts use independent RNG streams split from `generator`, as multi-draft
        verification requires."""
        domain, order = self.route_of(request_id)
        up = [n for n in order if self._up(n)]
        # the best pool always drafts; others join the fusion only while they earn it on this domain
        if up:
            floor = max(self.min_join_acceptance, self.expected_acceptance(up[0], domain) - self.join_margin)
            up = up[:1] + [n for n in up[1:] if self.expected_acceptance(n, domain) >= floor]
        names = up
        names = names[: self.fusion_width]
        gens = [None] * len(names)
        if generator is not None:
            import torch

            gens = [torch.Generator().manual_seed(int(torch.randint(0, 2**62, (), generator=generator)))
                    for _ in names]
        context = list(context_ids)
        if self._parallel and len(names) > 1:
            futures = [self._pool.submit(self._call, n, request_id, context, max_tokens, params, min_confidence, g)
                       for n, g in zip(names, gens, strict=True)]
            drafts = [f.result() for f in futures]
        else:
            drafts = [self._call(n, request_id, context, max_tokens, params, min_confidence, g)
                      for n, g in zip(names, gens, strict=True)]
        return [d for d in drafts if d is not None and d.num_tokens]

    def propose_async(self, request_id, context_ids, max_tokens, params, *, min_confidence=0.0,
                      generator=None) -> Future:
        """`propose` on a background thread (drafting ahead while the target verifies)."""
        return self._ahead.submit(
            self.propose, request_id, list(context_ids), max_tokens, params, min_confidence=min_confidence,
            generator=generator,
        )

    def release(self, request_id: str) -> None:
        with self._lock:
            self._routes.pop(request_id, None)
        for d in self.drafters.values():
            try:
                d.release(request_id)
            except Exception as e:  # best effort; a remote drafter's cache expires on its own
                log.debug("release on %s failed: %s", d.name, e)
