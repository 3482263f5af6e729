"""`python -m cosine.reaper [--grace-s S] PGID...`: kill process groups once stdin closes.

The watchdog of `cosine.processes.start_reaper`: its parent holds the write end of its stdin, so
end-of-file comes when the parent closes it or dies (SIGKILL included: the kernel closes the
descriptors of a dead process). Then every group gets SIGTERM, and SIGKILL after the grace if any
of its processes is left. Standard library only, so it starts in milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a recycled id of another user's group: not ours
        return False
    return True


def kill_groups(pgids: list[int], grace_s: float) -> None:
    """SIGTERM each group in `pgids`, then SIGKILL those with a process left after `grace_s` s."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(g) for g in pgids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosine.reaper")
    parser.add_argument("--grace-s", type=float, default=5.0)
    parser.add_argument("pgids", type=int, nargs="+")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the groups on Ctrl-C itself
    while sys.stdin.buffer.read(4096):
        pass
    kill_groups(args.pgids, args.grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
