"""Which CPU cores each role of an embedded cluster runs on (`cosine serve` on one machine).

On a Kubernetes node the kubelet gives each pod its cores; on one machine `cosine serve` does it:
the verifier's engine threads (vLLM's OpenMP threads, bound through `VLLM_CPU_OMP_THREADS_BIND`)
and every drafter replica's engine threads (llama.cpp's, with the process pinned by
`sched_setaffinity`) get disjoint cores while there are enough. vLLM binds its OpenMP threads to
cores, so a drafter that shares one of them preempts the verifier's step (the whole step waits
for its slowest thread): disjoint cores are what decoupled drafting means on one machine.

Pure: cores in, an assignment out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """verifier: the verifier's cores. drafters: each drafter replica's cores, in the order asked.
    shared: some drafter shares cores with the verifier (too few cores for disjoint placement)."""

    verifier: tuple[int, ...]
    drafters: tuple[tuple[int, ...], ...]
    shared: bool


def place(cpus: Sequence[int], verifier_threads: int, drafter_threads: Sequence[int]) -> Placement:
    """Assign cores: the verifier takes the first `verifier_threads` of `cpus` (all of them if it
    asks for more), each drafter replica the next `threads` cores not yet taken; when the free
    cores run out, drafters take cores round-robin from the rest, then from the verifier's.

    Args:
        cpus: the cores this process may use (`os.sched_getaffinity(0)`), ascending.
        verifier_threads: cores for the verifier's engine threads (>= 1).
        drafter_threads: cores per drafter replica (each >= 1).
    Raises:
        ValueError: no cores, or a thread count below 1.
    """
    cores = sorted(set(cpus))
    if not cores:
        raise ValueError("no CPU cores to place roles on")
    if verifier_threads < 1 or any(t < 1 for t in drafter_threads):
        raise ValueError(
            f"thread counts must be >= 1, got verifier {verifier_threads}, drafters {list(drafter_threads)}"
        )
    verifier = tuple(cores[: min(verifier_threads, len(cores))])
    free = [c for c in cores if c not in verifier]
    drafters: list[tuple[int, ...]] = []
    shared = False
    cursor = 0
    for threads in drafter_threads:
        if len(free) >= threads:
            mine, free = free[:threads], free[threads:]
        else:  # not enough free cores: share, preferring cores the verifier does not use
            pool = [c for c in cores if c not in verifier] or list(cores)
            n = min(threads, len(pool))
            mine = [pool[(cursor + i) % len(pool)] for i in range(n)]
            cursor += n
            shared = shared or any(c in verifier for c in mine)
        drafters.append(tuple(mine))
    return Placement(verifier, tuple(drafters), shared)


def cpu_list(cores: Sequence[int]) -> str:
    """Cores as a Linux CPU list (`0,2-3`), as `VLLM_CPU_OMP_THREADS_BIND` and `taskset` take them."""
    out: list[str] = []
    for c in sorted(set(cores)):
        if out and "-" not in out[-1] and int(out[-1]) == c - 1:
            out[-1] = f"{out[-1]}-{c}"
        elif out and "-" in out[-1] and int(out[-1].split("-")[1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)
