"""Replica health: taken out after consecutive failures, probed back in (pure).

Two kinds of evidence feed one tracker:

  * active probes: ``GET /health`` every ``interval_s`` (200 = ok);
  * passive evidence from live traffic: a connection refused/reset counts as a
    failed probe, so a killed replica leaves the rotation on the first request
    that hits it instead of waiting for the next probe.

The breaker (``breaker.py``) judges *quality* (error rate, latency) of a
replica that answers; health judges whether it answers at all.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from sluice.gateway.config import HealthConfig

__all__ = ["HealthState", "HealthTracker"]


class HealthState(enum.IntEnum):
    UP = 0
    DOWN = 1

    @property
    def label(self) -> str:
        return self.name.lower()


class HealthTracker:
    def __init__(self, config: HealthConfig, *, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        # NOTE(health-start): a replica starts UP so the gateway serves at once;
        # the first failed probe or refused connection takes it out quickly.
        self.state = HealthState.UP
        self._num_failures = 0  # consecutive
        self._num_successes = 0  # consecutive, while DOWN
        self.last_probe_at: float | None = None
        self.last_change_at = clock()
        self.last_error: str | None = None

    @property
    def is_up(self) -> bool:
        return self.state is HealthState.UP

    def is_probe_due(self) -> bool:
        if self.last_probe_at is None:
            return True
        return self._clock() - self.last_probe_at >= self.config.interval_s

    def record_probe(self, ok: bool, error: str | None = None) -> None:
        self.last_probe_at = self._clock()
        self._record(ok, error)

    def record_connect_failure(self, error: str) -> None:
        """Live traffic could not reach the replica at all."""
        self._record(False, error)

    def _record(self, ok: bool, error: str | None) -> None:
        if ok:
            self._num_failures = 0
            self._num_successes += 1
            if self.state is HealthState.DOWN and self._num_successes >= self.config.healthy_after:
                self._set(HealthState.UP)
            return
        self.last_error = error
        self._num_successes = 0
        self._num_failures += 1
        if self.state is HealthState.UP and self._num_failures >= self.config.unhealthy_after:
            self._set(HealthState.DOWN)

    def _set(self, state: HealthState) -> None:
        self.state = state
        self.last_change_at = self._clock()
        if state is HealthState.UP:
            self.last_error = None

    def retry_after(self) -> float:
        """Seconds until the next probe could bring the replica back."""
        if self.is_up:
            return 0.0
        if self.last_probe_at is None:
            return self.config.interval_s
        return max(0.0, self.last_probe_at + self.config.interval_s - self._clock())
