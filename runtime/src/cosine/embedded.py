"""`cosine serve`'s embedded cluster: its drafter pools as local replica processes, restarted when
they exit and scaled between `minReplicas` and `maxReplicas` by the operator's own rule when
`spec.autoscaling.enabled`, and the verifier beside them (`serve`).

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
  from the same spec (`policy_from_spec`): imported, not copied. Each decision is logged;
- the verifier is the verifier pod's own command, `cosine verifier`, given the pools' address
  files as its `--drafter`s and, on a CPU, the cores `placement.assign` leaves it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cosine.manifest import Manifest
from cosine.placement import Placement, cpu_list
from cosine.processes import child_setup, die_with_parent, free_port, poll_until, start_reaper, stop_group, stop_reaper

if TYPE_CHECKING:
    from cosine_spec.cluster_spec import DrafterPoolSpec
    from cosine_spec.scaling_loop import ScalingLoop

log = logging.getLogger(__name__)

DRAIN_S = 6.0  # an unlisted replica is stopped this long after (the verifier re-reads the list every 5 s)


@dataclass
class Child:
    """A drafter replica process of `cosine serve`: its command, environment, gRPC port, the cores it
    is pinned to (() = any) and how many times `supervise` restarted it."""

    name: str
    process: subprocess.Popen
    grpc_port: int
    cmd: list[str]
    env: dict[str, str]
    restarts: int = 0

    cores: tuple[int, ...] = ()
    metrics_port: int = 0  # its `cosine_drafter_*` series (the embedded autoscaler scrapes them)

    def start(self) -> None:
        """(Re)start the process with the same command, environment and cores."""
        self.process = subprocess.Popen(self.cmd, env=self.env, preexec_fn=child_setup(self.cores))


def start_replica(manifest: Manifest, pool, name: str, host: str = "127.0.0.1",
                  cores: Sequence[int] = ()) -> Child:
    """One `cosine drafter` process of `pool` (a `DrafterPoolSpec`) on free loopback ports, its
    engine threads `pool.threads`, pinned to `cores` when given; named `name`."""
    port, metrics_port = free_port(host), free_port(host)
    cmd = [sys.executable, "-m", "cosine", "drafter", "--pool", pool.name, "--grpc-port", str(port),
           "--metrics-port", str(metrics_port), "--host", host]
    if manifest.path:
        cmd += ["--cluster", str(manifest.path)]
    env = {**os.environ, "OMP_NUM_THREADS": str(pool.threads)}
    proc = subprocess.Popen(cmd, env=env, preexec_fn=child_setup(cores))
    log.info("started drafter %s (pid %d) on %s:%d, cores %s", name, proc.pid, host, port, list(cores) or "any")
    return Child(name, proc, port, cmd, env, cores=tuple(cores), metrics_port=metrics_port)


def serving(address: str, timeout_s: float = 1.0) -> bool:
    """Whether the drafter at `address` (host:port, plaintext) answers SERVING to a gRPC health
    check within `timeout_s` seconds (False if it does not answer)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status
        except grpc.RpcError:
            return False
    return bool(status == health_pb2.HealthCheckResponse.SERVING)


def wait_healthy(children: list[Child], host: str = "127.0.0.1", timeout_s: float = 600) -> None:
    """Block until every child answers its gRPC health check. Raises RuntimeError on exit/timeout."""
    deadline = time.monotonic() + timeout_s
    for c in children:
        address = f"{host}:{c.grpc_port}"
        poll_until(lambda a=address: serving(a), c.process, deadline, 0.5, f"drafter {c.name}",
                   f"not healthy after {timeout_s:.0f} s")


def stop_children(children: list[Child], timeout_s: float = 10) -> None:
    """SIGTERM every running child, then SIGKILL those still running after `timeout_s` seconds in all."""
    for c in children:
        if c.process.poll() is None:
            c.process.terminate()
    end = time.monotonic() + timeout_s
    for c in children:
        try:
            c.process.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.process.kill()
            c.process.wait()



class EmbeddedMetrics:
    """The embedded cluster's own series (`cosine_spec.metric_names.EMBEDDED_*`), in a registry of
    its own: each pool's replica processes, the autoscaler's passes and its failed stages, the
    replica processes that exited (and were restarted), by exit code. Each of `pools` starts at
    zero replicas with its price from the spec: a pool that runs none (`--placement lookup`, or
    scaled to zero) shows 0, not nothing."""

    def __init__(self, pools: Sequence[DrafterPoolSpec] = ()) -> None:
        from cosine_spec import metric_names as m
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.replicas = Gauge(m.EMBEDDED_REPLICAS, "replica processes the pool runs now", ["pool"],
                              registry=self.registry)
        self.passes = Counter(m.EMBEDDED_AUTOSCALER_PASSES, "autoscaling passes made", registry=self.registry)
        self.errors = Counter(m.EMBEDDED_AUTOSCALER_ERRORS, "failed stages of autoscaling passes", ["stage"],
                              registry=self.registry)
        self.exits = Counter(m.EMBEDDED_REPLICA_EXITS, "replica processes that exited, by exit code",
                             ["pool", "code"], registry=self.registry)
        self.price = Gauge(m.POOL_PRICE, "one replica's price per hour from the spec, USD", ["pool"],
                           registry=self.registry)
        for pool in pools:
            self.replicas.labels(pool.name).set(0)
            self.price.labels(pool.name).set(pool.replica_price_per_hour_usd)


class LocalPools:
    """The drafter replicas of every pool of a manifest's spec on this machine.

    Args:
        manifest: the cluster (`manifest.Manifest`: its spec, and its file the replicas read).
        directory: where the address files go (one `<pool>.addresses` per pool).
        cores: cores for the first replicas, in pool order (`placement.assign`); replicas added
            later run on any core.
        autoscaled: start each pool at its `replicas` within its bounds, zero allowed (else at
            least one, as without autoscaling).
        metrics: where the pools' series go (default: a registry of their own).
    """

    def __init__(self, manifest: Manifest, directory: Path, cores: Sequence[Sequence[int]] = (),
                 host: str = "127.0.0.1", autoscaled: bool = False, metrics: EmbeddedMetrics | None = None) -> None:
        spec = manifest.spec
        self.manifest, self.spec, self.host, self.directory = manifest, spec, host, directory
        self.autoscaled = autoscaled
        self.replicas: dict[str, list[Child]] = {p.name: [] for p in spec.drafter_pools}
        self.listed: dict[str, set[str]] = {p.name: set() for p in spec.drafter_pools}
        self._lock = threading.RLock()
        self._serial = 0
        self.scaling: ScalingLoop | None = None  # the autoscaling loop, while `autoscale` runs
        self.metrics = EmbeddedMetrics(spec.drafter_pools) if metrics is None else metrics
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
            self.metrics.replicas.labels(pool.name).set(len(self.replicas[pool.name]))
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
            self.metrics.replicas.labels(pool_name).set(len(children))
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
            with self._lock:
                children = [(pool, c) for pool, cs in self.replicas.items() for c in cs]
            for pool, c in children:
                if c.process.poll() is not None and not stop.is_set():
                    self.metrics.exits.labels(pool, str(c.process.returncode)).inc()
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

        self.scaling = ScalingLoop(policy_from_spec(self.spec), observed, resize, report, log=log,
                                   on_error=lambda stage, _: self.metrics.errors.labels(stage).inc())
        interval_s = float(self.spec.autoscaling.interval_s)
        while not await asyncio.to_thread(stop.wait, interval_s if previous is not None else 1.0):
            await self.scaling.tick(time.monotonic())
            self.metrics.passes.inc()


# ---------------------------------------------------------------------- the cluster


def serve(manifest: Manifest, where: Placement, mode: str, port: int, host: str, metrics_port: int,
          pools_metrics_port: int = 0) -> int:
    """Drafter processes (none for `lookup`; `LocalPools`, autoscaled with
    `spec.autoscaling.enabled`), their series on `pools_metrics_port` unless 0 (every pool at zero
    replicas for `lookup`, which runs none), then the verifier
    (`cosine verifier`: vLLM's server with CoSine's proposer) as a child, on the cores of `where`;
    returns the verifier's exit status when it exits, or 0 on SIGTERM / Ctrl-C, having stopped
    every child. Every child dies with this process however it dies (`processes`)."""
    spec = manifest.spec
    autoscaled = spec.autoscaling.enabled and mode != "lookup"
    if autoscaled and not metrics_port:
        metrics_port = free_port()  # the autoscaler reads the proposer's series
    stop = threading.Event()
    verifier: subprocess.Popen | None = None
    reaper: subprocess.Popen | None = None
    pools: LocalPools | None = None
    with tempfile.TemporaryDirectory(prefix="cosine-pools-") as directory:
        try:
            metrics = EmbeddedMetrics(spec.drafter_pools)
            if pools_metrics_port:
                from prometheus_client import start_http_server

                start_http_server(pools_metrics_port, addr=host, registry=metrics.registry)
            if mode != "lookup":
                pools = LocalPools(manifest, Path(directory), where.drafters, autoscaled=autoscaled, metrics=metrics)
                pools.wait_ready()
                threading.Thread(target=pools.supervise, args=(stop,), name="cosine-supervisor", daemon=True).start()
            verifier = subprocess.Popen(verifier_pod_command(manifest, port, host, metrics_port, where.verifier, pools),
                                        preexec_fn=die_with_parent, start_new_session=True)
            reaper = start_reaper([verifier.pid])  # its group dies with this process, however it dies
            log.info("verifier (pid %d): vLLM OpenAI server on http://%s:%d/v1, engine threads on cores %s",
                     verifier.pid, host, port, list(where.verifier) or "(vLLM's binding)")
            if pools is not None and autoscaled:
                log.info("autoscaling drafter pools every %d s (spec.autoscaling)", spec.autoscaling.interval_s)
                threading.Thread(target=pools.autoscale, args=(f"http://127.0.0.1:{metrics_port}/metrics", stop),
                                 name="cosine-autoscaler", daemon=True).start()
            def shut_down(signum, frame) -> None:  # noqa: ANN001
                # the replicas may get the signal too (the same process group): stop supervising
                # first, or the supervisor restarts each replica that drained and exited
                stop.set()
                if verifier is not None:
                    verifier.terminate()

            signal.signal(signal.SIGTERM, shut_down)
            try:
                return verifier.wait()
            except KeyboardInterrupt:
                return 0
        finally:
            stop.set()
            if verifier is not None:
                stop_group(verifier)
            if reaper is not None:
                stop_reaper(reaper)
            if pools is not None:
                pools.stop()


def verifier_pod_command(manifest: Manifest, port: int, host: str, metrics_port: int, cores: Sequence[int],
                     pools: LocalPools | None) -> list[str]:
    """The verifier pod's command (`cosine verifier`) for this machine: the manifest's file, the
    pools' address files as `--drafter`s, the verifier's `cores` (() = vLLM's own binding). The
    API key, if any, reaches it in the environment (`COSINE_API_KEY`), not on the command line."""
    cmd = [sys.executable, "-m", "cosine", "verifier", "--http-port", str(port), "--host", host,
           "--metrics-port", str(metrics_port)]
    if manifest.path:
        cmd += ["--cluster", str(manifest.path)]
    if cores:
        cmd += ["--cores", cpu_list(cores)]
    for flag in pools.drafter_flags() if pools else []:
        cmd += ["--drafter", flag]
    return cmd
