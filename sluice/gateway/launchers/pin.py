"""Run a command pinned to some CPU cores: ``python -m sluice.gateway.launchers.pin 0,1 -- cmd args...``.

The affinity is set before ``exec``, so the command and every process it
starts later (the engine core of ``sluice serve``) inherit it; no race with a
child spawned before a parent-side ``sched_setaffinity``.
"""

from __future__ import annotations

import os
import sys


def parse_cores(text: str) -> set[int]:
    """``"0,2-3"`` -> {0, 2, 3} (the kernel's cpulist format)."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m sluice.gateway.launchers.pin CORES -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    cores = parse_cores(argv[0])
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    os.execvp(argv[2], argv[2:])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
