"""Retry budget: retries may add at most ``budget_ratio`` extra load (pure, clock-injected).

NOTE(retry-budget): per-request retry limits multiply load during an outage
(every request tries every replica), which is how a partial failure becomes a
total one.  A budget over a sliding window caps retries at ``budget_ratio`` x
first attempts (20% by default), plus ``min_retries_per_s`` so a quiet gateway
can still fail over a lone request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from sluice.gateway.config import RetryConfig

__all__ = ["RetryBudget"]


class RetryBudget:
    def __init__(self, config: RetryConfig, *, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        # one-second buckets: [second, num_requests, num_retries]
        self._buckets: deque[list[int]] = deque()

    def _current(self) -> list[int]:
        sec = int(self._clock())
        horizon = sec - int(self.config.budget_window_s)
        while self._buckets and self._buckets[0][0] <= horizon:
            self._buckets.popleft()
        if not self._buckets or self._buckets[-1][0] != sec:
            self._buckets.append([sec, 0, 0])
        return self._buckets[-1]

    def record_request(self) -> None:
        self._current()[1] += 1

    def try_spend(self) -> bool:
        """Take one retry from the budget; False when the budget is spent."""
        cur = self._current()
        requests = sum(b[1] for b in self._buckets)
        retries = sum(b[2] for b in self._buckets)
        allowed = self.config.budget_ratio * requests + self.config.min_retries_per_s * self.config.budget_window_s
        if retries + 1 > allowed:
            return False
        cur[2] += 1
        return True
