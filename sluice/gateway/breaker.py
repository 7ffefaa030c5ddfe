"""Adaptive circuit breaker, one per replica (pure; the clock is injected).

::

      failure rate >= threshold(score)         open_s elapsed
    CLOSED ───────────────────────────> OPEN ─────────────────> HALF_OPEN
       ^                                 ^  (open_s doubles)       │
       │   half_open_probes successes    └────── any failure ──────┤
       └───────────────────────────────────────────────────────────┘

The window is ``num_buckets`` time buckets covering ``window_s`` seconds; each
bucket keeps its call count, failure count and latencies.

NOTE(adaptive-threshold): the trip threshold is not fixed.  A stress score in
[0, 1] mixes (weights 0.3 / 0.4 / 0.3 by default)

  * load: the window's QPS relative to the replica's sustainable rate (given in
    the config, or learned as the highest rate it served without failing),
  * latency trend: the slope of the per-bucket p99 latency (least-squares fit),
    as the relative growth of p99 across the window,
  * memory: the replica's KV-cache usage (scraped),

and ``threshold = max_threshold - (max_threshold - min_threshold) * score``.
An idle healthy replica needs a clear failure rate (50% by default) before it
trips; one that is saturated, slowing down and out of KV blocks trips at 10%,
shedding load before it falls over.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice.gateway.config import BreakerConfig

__all__ = ["BreakerState", "Bucket", "CircuitBreaker", "p99", "linear_slope"]


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass
class Bucket:
    index: int  # int(time / bucket width)
    num_calls: int = 0
    num_failures: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds, successes and failures


def p99(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def linear_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=False)) / sxx


def _clamp01(v: float) -> float:
    return 0.0 if v < 0 else 1.0 if v > 1 else v


class CircuitBreaker:
    def __init__(
        self,
        config: BreakerConfig,
        *,
        sustainable_qps: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self._clock = clock
        self._configured_qps = sustainable_qps
        self._learned_qps = 0.0  # highest per-bucket rate served while healthy
        self._bucket_s = config.window_s / config.num_buckets
        self._buckets: deque[Bucket] = deque()
        self._state = BreakerState.CLOSED
        self._open_until = 0.0
        self._num_reopens = 0  # consecutive failed half-open rounds (backoff exponent)
        self._probes_in_flight = 0
        self._probe_successes = 0
        self.kv_cache_usage = 0.0  # set by the scraper
        self.num_trips = 0

    # ---- state -------------------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() >= self._open_until:
            self._state = BreakerState.HALF_OPEN
            self._probes_in_flight = 0
            self._probe_successes = 0
        return self._state

    def can_route(self) -> bool:
        """May a new request go to this replica now?"""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN:
            return self._probes_in_flight < self.config.half_open_probes - self._probe_successes
        return False

    def retry_after(self) -> float:
        """Seconds until this breaker lets a probe through (0 when it routes now)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._open_until - self._clock())

    def on_dispatch(self) -> None:
        """A request was sent to the replica (call once per attempt)."""
        if self.state is BreakerState.HALF_OPEN:
            self._probes_in_flight += 1

    def record(self, ok: bool, latency_s: float) -> None:
        """Outcome of one attempt: ``ok`` is False for connection errors, timeouts and 5xx."""
        state = self.state
        bad = not ok or (self.config.slow_call_s is not None and latency_s > self.config.slow_call_s)
        if state is BreakerState.HALF_OPEN:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)
            if bad:
                self._num_reopens += 1
                self._open()
            else:
                self._probe_successes += 1
                if self._probe_successes >= self.config.half_open_probes:
                    self._close()
            return
        if state is BreakerState.OPEN:
            return  # a straggler sent before the trip: the breaker already decided
        b = self._bucket(self._clock())
        b.num_calls += 1
        b.num_failures += int(bad)
        b.latencies.append(latency_s)
        if bad:
            self._maybe_trip()

    # ---- window figures ------------------------------------------------------------

    def _bucket(self, now: float) -> Bucket:
        idx = int(now / self._bucket_s)
        self._evict(idx)
        if not self._buckets or self._buckets[-1].index != idx:
            self._buckets.append(Bucket(idx))
        return self._buckets[-1]

    def _evict(self, idx: int) -> None:
        while self._buckets and self._buckets[0].index <= idx - self.config.num_buckets:
            old = self._buckets.popleft()
            if old.num_calls and old.num_failures / old.num_calls < self.config.min_threshold:
                self._learned_qps = max(self._learned_qps, old.num_calls / self._bucket_s)

    def window_counts(self) -> tuple[int, int]:
        """(calls, failures) in the window."""
        self._evict(int(self._clock() / self._bucket_s))
        return (
            sum(b.num_calls for b in self._buckets),
            sum(b.num_failures for b in self._buckets),
        )

    def failure_rate(self) -> float:
        calls, failures = self.window_counts()
        return failures / calls if calls else 0.0

    def qps_score(self) -> float:
        calls, _ = self.window_counts()
        if not calls:
            return 0.0
        now = self._clock()
        span = max(self._bucket_s, min(self.config.window_s, now - self._buckets[0].index * self._bucket_s))
        sustainable = self._configured_qps or max(1.0, self._learned_qps)
        return _clamp01((calls / span) / sustainable)

    def latency_slope_score(self) -> float:
        """Relative growth of p99 latency across the window, clamped to [0, 1]."""
        self._evict(int(self._clock() / self._bucket_s))
        points = [(b.index * self._bucket_s, p99(b.latencies)) for b in self._buckets if b.latencies]
        if len(points) < 2:
            return 0.0
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        mean = sum(ys) / len(ys)
        return _clamp01(linear_slope(xs, ys) * self.config.window_s / max(mean, 1e-3))

    def score(self) -> float:
        c = self.config
        total = c.w_qps + c.w_latency_slope + c.w_memory
        s = (
            c.w_qps * self.qps_score()
            + c.w_latency_slope * self.latency_slope_score()
            + c.w_memory * _clamp01(self.kv_cache_usage)
        )
        return s / total

    def threshold(self) -> float:
        c = self.config
        return c.max_threshold - (c.max_threshold - c.min_threshold) * self.score()

    # ---- transitions -------------------------------------------------------------

    def _maybe_trip(self) -> None:
        calls, failures = self.window_counts()
        if calls < self.config.min_requests:
            return
        rate = failures / calls
        # NOTE(breaker-cost): the score needs sorting latencies; only compute it
        # when the failure rate could trip even the most stressed replica.
        if rate >= self.config.min_threshold and rate >= self.threshold():
            self._open()

    def _open(self) -> None:
        c = self.config
        self._state = BreakerState.OPEN
        self._open_until = self._clock() + min(c.max_open_s, c.open_s * 2 ** self._num_reopens)
        self._probes_in_flight = 0
        self._probe_successes = 0
        self._buckets.clear()
        self.num_trips += 1

    def _close(self) -> None:
        self._state = BreakerState.CLOSED
        self._num_reopens = 0
        self._buckets.clear()
