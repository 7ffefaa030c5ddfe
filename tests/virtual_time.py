"""An asyncio event loop on virtual time, for tests of clock-driven code.

``loop.time()`` starts at 0 and jumps straight to the next timer whenever no
callback is ready, so ``asyncio.sleep(5)`` takes no wall time and the order of
events is exact whatever the machine's speed.  Use it only for code without
real I/O (fake senders, fake engines): with sockets in flight, time would jump
while bytes are still on their way.

    result = run_virtual(main())      # like asyncio.run, on virtual time
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def _run_once(self) -> None:
        # NOTE(virtual-jump): relies on CPython's BaseEventLoop internals (_ready,
        # _scheduled, TimerHandle._when), unchanged since 3.4: with nothing ready,
        # move the clock to the earliest live timer so select() does not wait.
        scheduled = self._scheduled  # type: ignore[attr-defined]
        while scheduled and scheduled[0]._cancelled:
            scheduled[0]._scheduled = False
            heapq.heappop(scheduled)
        if not self._ready and scheduled:  # type: ignore[attr-defined]
            self._virtual_now = max(self._virtual_now, scheduled[0]._when)
        super()._run_once()  # type: ignore[misc]


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
