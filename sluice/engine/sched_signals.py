"""What the scheduler remembers between steps: TTFT targets seen and the step cycle time.

Each is a small piece of state with one rule, kept out of ``scheduler.py`` so that the scheduler
reads as the step it plans.  None of them touches requests' progress or blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["CycleClock", "TargetMemory", "CYCLE_DECAY", "IDLE_GAP_S", "TARGET_MEMORY_S"]

CYCLE_DECAY = 0.8  # per schedule(): memory of the step cycle time (NOTE(behind))
IDLE_GAP_S = 0.5  # a gap between schedule() calls longer than this is idle time, not a step cycle
TARGET_MEMORY_S = 2.0  # how long a TTFT target seen keeps bounding the rows of a step (NOTE(target-memory))


class TargetMemory:
    """The smallest TTFT target of the requests added in the last ``TARGET_MEMORY_S`` seconds.

    NOTE(target-memory): the engine bounds its steps for a tight target (NOTE(row-cap)) before
    the next request with it arrives, so a target is remembered for a
    while after its request came: long enough to hold through P0 traffic of a few a second,
    short enough to lift where P0 is rare (a P0 arriving into an unbounded step starts
    mid-step, NOTE(mid-step-express)).  The targets of requests still waiting or in their
    prefill stay in force however long ago they came.  The A/Bs: ``git show c2f0033:docs/benchmarks.md``.
    """

    def __init__(self) -> None:
        # (added at, ttft_target), targets increasing front to back: a sliding-window minimum
        self._recent: deque[tuple[float, float]] = deque()

    def add(self, target: float, now: float) -> None:
        if target <= 0.0:
            return
        while self._recent and self._recent[-1][1] >= target:  # never the minimum again
            self._recent.pop()
        self._recent.append((now, target))

    def tightest(self, now: float, current: Iterable[float] = ()) -> float | None:
        """The smallest positive target among those remembered at ``now`` and ``current``."""
        while self._recent and self._recent[0][0] < now - TARGET_MEMORY_S:
            self._recent.popleft()
        remembered = [self._recent[0][1]] if self._recent else []
        return min((t for t in (*remembered, *current) if t > 0.0), default=None)


class CycleClock:
    """Seconds from one ``schedule()`` to the next while busy, a decaying mean (NOTE(behind))."""

    def __init__(self) -> None:
        self.cycle_time = 0.0
        self._last: float | None = None

    def observe(self, now: float) -> None:
        prev, self._last = self._last, now
        if prev is not None and 0.0 < now - prev < IDLE_GAP_S:
            gap = now - prev
            self.cycle_time = gap if self.cycle_time <= 0.0 else CYCLE_DECAY * self.cycle_time + (1 - CYCLE_DECAY) * gap

