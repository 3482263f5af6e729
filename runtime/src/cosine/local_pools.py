"""`cosine serve`'s drafter pools: local replica processes, restarted when they exit, and scaled
between `minReplicas` and `maxReplicas` by the operator's own rule when `spec.autoscaling.enabled`.

What a Deployment, its headless Service and the operator's autoscaler do on a cluster, on one
machine:
- each pool's ready replicas are listed, one `host:port` per line, in a file the verifier's pool
  client re-reads (`file://` addresses, `transport.replica_pool.resolve_addresses`), as a headless
  Service lists its ready pods. A replica is listed once it answers its health check and unlisted
  before it is stopped, so the verifier stops giving it requests first;
- a replica that exits is restarted on the same ports (`supervise`);
- every `spec.autoscaling.intervalSeconds` the autoscaler reads the verifier's and each replica's
  `/metrics` (the operator's `metrics_scrape.scrape_pods`), takes rates (`metrics_scrape.rates`)
  and runs `cosine_spec.autoscaling.desired_replicas` with the policy the operator builds
  from the same spec (`policy_from_spec`): imported, not copied. Each decision is logged.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cosine.manifest import Manifest
from cosine.processes import Child, start_replica, stop_children, wait_healthy

if TYPE_CHECKING:
    from cosine_spec.scaling_loop import ScalingLoop

log = logging.getLogger(__name__)

DRAIN_S = 6.0  # an unlisted replica is stopped this long after (the verifier re-reads the list every 5 s)


class LocalPools:
    """The drafter replicas of every pool of a manifest's spec on this machine.

    Args:
        manifest: the cluster (`manifest.Manifest`: its spec, and its file the replicas read).
        directory: where the address files go (one `<pool>.addresses` per pool).
        cores: cores for the first replicas, in pool order (`roles.placement`); replicas added
            later run on any core.
        autoscaled: start each pool at its `replicas` within its bounds, zero allowed (else at
            least one, as without autoscaling).
    """

    def __init__(self, manifest: Manifest, directory: Path, cores: Sequence[Sequence[int]] = (),
                 host: str = "127.0.0.1", autoscaled: bool = False) -> None:
        spec = manifest.spec
        self.manifest, self.spec, self.host, self.directory = manifest, spec, host, directory
        self.autoscaled = autoscaled
        self.replicas: dict[str, list[Child]] = {p.name: [] for p in spec.drafter_pools}
        self.listed: dict[str, set[str]] = {p.name: set() for p in spec.drafter_pools}
        self._lock = threading.RLock()
        self._serial = 0
        self.scaling: ScalingLoop | None = None  # the autoscaling loop, while `autoscale` runs
        directory.mkdir(parents=True, exist_ok=True)
        cores = list(cores)
        first: list[Child] = []
        for pool in spec.drafter_pools:
            n = pool.clamp(pool.replicas) if autoscaled else max(1, pool.replicas)
            for _ in range(n):
                child = self._start(pool, tuple(cores.pop(0)) if cores else ())
                first.append(child)
            self._write(pool.name)
        self.first = first

    # ------------------------------------------------------------------ addresses

    def address_file(self, pool: str) -> Path:
        return self.directory / f"{pool}.addresses"

    def drafter_flags(self) -> list[str]:
        """The verifier's `--drafter POOL=file://…` flags, one per pool."""
        return [f"{name}=file://{self.address_file(name)}" for name in self.replicas]

    def _write(self, pool: str) -> None:
        with self._lock:
            lines = [f"{self.host}:{c.grpc_port}" for c in self.replicas[pool] if c.name in self.listed[pool]]
            tmp = self.address_file(pool).with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in lines))
            tmp.replace(self.address_file(pool))  # atomic: a reader never sees half a file

    def _list(self, pool: str, child: Child) -> None:
        with self._lock:
            if child in self.replicas[pool]:
                self.listed[pool].add(child.name)
                self._write(pool)

    # ------------------------------------------------------------------ replicas

    def _start(self, pool, cores: tuple[int, ...] = ()) -> Child:
        with self._lock:
            self._serial += 1
            child = start_replica(self.manifest, pool, f"{pool.name}-{self._serial}", self.host, cores)
            self.replicas[pool.name].append(child)
        return child

    def wait_ready(self, timeout_s: float = 600) -> None:
        """Block until the first replicas answer their health checks, then list them.
        Raises RuntimeError when one exits or times out."""
        wait_healthy(self.first, self.host, timeout_s)
        for pool, children in self.replicas.items():
            for child in children:
                self._list(pool, child)

    def scale(self, pool_name: str, replicas: int) -> None:
        """Start or stop replicas of a pool until it has `replicas`: a new one is listed once
        healthy (in the background), a removed one (the newest) unlisted at once and stopped
        `DRAIN_S` later."""
        pool = self.spec.pool(pool_name)
        with self._lock:
            children = self.replicas[pool_name]
            while len(children) < replicas:
                child = self._start(pool)
                threading.Thread(target=self._list_when_healthy, args=(pool_name, child), daemon=True).start()
            gone = []
            while len(children) > replicas:
                child = children.pop()
                self.listed[pool_name].discard(child.name)
                gone.append(child)
            self._write(pool_name)
        if gone:
            threading.Timer(DRAIN_S, stop_children, args=(gone,)).start()

    def _list_when_healthy(self, pool: str, child: Child) -> None:
        try:
            wait_healthy([child], self.host, timeout_s=600)
        except RuntimeError as e:
            log.warning("drafter %s did not become healthy: %s", child.name, e)
            return
        self._list(pool, child)

    def all(self) -> list[Child]:
        with self._lock:
            return [c for children in self.replicas.values() for c in children]

    def supervise(self, stop: threading.Event, period_s: float = 1.0) -> None:
        """Restart replicas that exit (as a Deployment would), on the same ports: the verifier's
        client reconnects and lets the replica back in."""
        while not stop.wait(period_s):
            for c in self.all():
                if c.process.poll() is not None and not stop.is_set():
                    c.restarts += 1
                    log.warning("drafter %s exited with %s; restarting (restart %d)", c.name, c.process.returncode,
                                c.restarts)
                    c.start()

    def stop(self) -> None:
        stop_children(self.all())

    # ------------------------------------------------------------------ autoscaler

    def autoscale(self, verifier_metrics_url: str, stop: threading.Event) -> None:
        """The one scaling loop (`cosine_spec.scaling_loop`) with the operator's rule on this
        machine's scrape, every `spec.autoscaling.intervalSeconds` (see the module docstring), in
        an event loop of its own for the thread's life; returns when `stop` is set. A failed
        scrape or resize is counted in `self.scaling.errors`, logged with its cause and survived."""
        asyncio.run(self._autoscale(verifier_metrics_url, stop))

    async def _autoscale(self, verifier_metrics_url: str, stop: threading.Event) -> None:
        from cosine_spec.autoscaling import policy_from_spec
        from cosine_spec.metrics_scrape import Scrape, ScrapeTarget, observe, scrape_pods
        from cosine_spec.scaling_loop import ScalingLoop  # noqa: F811 - at run time

        previous: Scrape | None = None
        counts: dict[str, tuple[int, int]] = {}
        held: dict[str, str | None] = {}  # the condition last logged per pool: a hold is logged once

        async def observed():  # noqa: ANN202
            nonlocal previous, counts
            with self._lock:
                targets = [ScrapeTarget("verifier", "verifier", None, verifier_metrics_url)]
                targets += [ScrapeTarget(c.name, "drafter", pool, f"http://{self.host}:{c.metrics_port}/metrics")
                            for pool, children in self.replicas.items() for c in children
                            if c.name in self.listed[pool]]
                counts = {pool: (len(children), len(self.listed[pool])) for pool, children in self.replicas.items()}
            scrape = await scrape_pods(targets, timeout_s=2.0, time_s=time.monotonic())
            for target, why in scrape.failures:
                log.warning("autoscaler: could not read %s %s's metrics at %s: %s", target.role, target.pod,
                            target.url, why)
            before, previous = previous, scrape
            return observe(before, scrape, counts) if before is not None else None

        def resize(d) -> None:  # noqa: ANN001
            log.info("autoscaler: pool %s %d -> %d: %s", d.pool, d.current, d.desired, d.reason)
            self.scale(d.pool, d.desired)

        def report(_, decisions) -> None:  # noqa: ANN001
            for d in decisions:
                if not d.changed and d.condition and held.get(d.pool) != d.condition:
                    log.info("autoscaler: pool %s holds at %d (%s): %s", d.pool, d.current, d.condition, d.reason)
                held[d.pool] = d.condition

        self.scaling = ScalingLoop(policy_from_spec(self.spec), observed, resize, report, log=log)
        interval_s = float(self.spec.autoscaling.interval_s)
        while not await asyncio.to_thread(stop.wait, interval_s if previous is not None else 1.0):
            await self.scaling.tick(time.monotonic())
