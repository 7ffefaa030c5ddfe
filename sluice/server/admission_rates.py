"""What the admission measures over time (pure): exponentially weighted event rates, and one
class's queue with the rate it drains at.  The rules that read them live in ``admission``
(NOTE(higher-arrivals), NOTE(class-drain))."""

from __future__ import annotations

import math

__all__ = ["RATE_WINDOW_S", "DRAIN_MIN_BACKLOG_S", "Rate", "ClassDrain"]

RATE_WINDOW_S = 5.0  # time constant of the measured arrival and completion rates (NOTE(higher-arrivals))
DRAIN_MIN_BACKLOG_S = 1.0  # weighted seconds of backlog before a class's drain rate counts (NOTE(class-drain))


class Rate:
    """Events per second, exponentially weighted over ``window`` seconds (``RATE_WINDOW_S``)."""

    __slots__ = ("value", "at", "window")

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.value = 0.0
        self.at: float | None = None
        self.window = window

    def read(self, now: float) -> float:
        return 0.0 if self.at is None else self.value * math.exp(-max(0.0, now - self.at) / self.window)

    def tick(self, now: float, amount: float = 1.0) -> None:
        self.value = self.read(now) + amount / self.window
        self.at = now


class ClassDrain:
    """One class's queue: its queued requests in admission order, and first outputs per second of time
    with any queued (NOTE(class-drain))."""

    __slots__ = ("queued", "starts", "backlog", "at")

    def __init__(self) -> None:
        self.queued: dict[str, float] = {}  # key -> admitted at, oldest first
        self.starts = Rate()  # first outputs per second
        self.backlog = Rate()  # seconds with requests queued, per second
        self.at: float | None = None  # backlog counted up to here

    def _count(self, now: float) -> None:
        if self.queued and self.at is not None:
            self.backlog.tick(now, now - self.at)
        self.at = now

    def add(self, key: str, now: float) -> None:
        self._count(now)
        self.queued[key] = now

    def remove(self, key: str, now: float) -> None:
        self._count(now)
        self.queued.pop(key, None)

    def wait(self, now: float) -> float:
        """Seconds until a request queued now starts behind the queued ones: at least the oldest one's
        age, and, once ``DRAIN_MIN_BACKLOG_S`` of backlog was seen, ``(queued + 1) / drain rate``."""
        oldest = now - next(iter(self.queued.values())) if self.queued else 0.0
        backlog = self.backlog.read(now) * RATE_WINDOW_S
        if self.queued and self.at is not None:
            backlog += now - self.at
        if backlog < DRAIN_MIN_BACKLOG_S:
            return oldest
        starts = max(1.0, self.starts.read(now) * RATE_WINDOW_S)
        return max(oldest, (len(self.queued) + 1) * backlog / starts)
