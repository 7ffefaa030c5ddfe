"""What the scheduler remembers between steps: TTFT targets seen, the step cycle time, and each
class's recent peak of running requests, with the slot reservation it sets.

Each is a small piece of state or a rule, kept out of ``scheduler.py`` so that the scheduler reads as
the step it plans, and so that its model of itself (``ttft_model``) shares the rule.  None of them
touches requests' progress or blocks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from sluice.engine.request import Request
from sluice.types import Priority

__all__ = [
    "CycleClock", "RunningPeaks", "TargetMemory", "CYCLE_DECAY", "IDLE_GAP_S", "PEAK_DECAY_S", "TARGET_MEMORY_S",
    "reserved_seq_limit",
]

CYCLE_DECAY = 0.8  # per schedule(): memory of the step cycle time (NOTE(behind))
IDLE_GAP_S = 0.5  # a gap between schedule() calls longer than this is idle time, not a step cycle
TARGET_MEMORY_S = 2.0  # how long a TTFT target seen keeps bounding the step time (EngineCore, NOTE(target-memory))
PEAK_DECAY_S = 5.0  # time constant of the decaying peak of running requests by class (NOTE(trunk-reservation))


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


class RunningPeaks:
    """Each class's recent peak of running requests, decaying with time constant ``PEAK_DECAY_S``
    (NOTE(trunk-reservation) in ``Scheduler.seq_limit_for``)."""

    def __init__(self, now: float) -> None:
        self.peaks = [0.0 for _ in Priority]
        self._at = now

    def update(self, now: float, holders: Iterable[Request]) -> None:
        """Fold in the requests holding a slot now (running, and loading from a KV tier)."""
        decay = math.exp(-max(0.0, now - self._at) / PEAK_DECAY_S)
        self._at = now
        counts = [0 for _ in Priority]
        for r in holders:
            counts[r.priority] += 1
        self.peaks = [max(float(n), p * decay) for n, p in zip(counts, self.peaks, strict=True)]


def reserved_seq_limit(max_num_seqs: int, p0_peak: float) -> int:
    """The slots a class below P0 may fill: all but P0's recent peak of running requests plus one
    (NOTE(trunk-reservation) in ``Scheduler.seq_limit_for``); all of them with no P0 of late."""
    return max_num_seqs if p0_peak <= 0.0 else max(1, max_num_seqs - math.ceil(p0_peak) - 1)
