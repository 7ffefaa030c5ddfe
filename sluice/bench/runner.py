"""Run one load phase: drive requests through the client, collect records, stop cleanly.

Bounded by construction: a phase stops sending at ``max_requests`` or after
``duration_s``, whichever comes first, or when ``stop`` is set (Ctrl-C).  It
then waits for the requests in flight (at most ``drain_s``; each one is also
bounded by the client's timeout), cancels what is left and counts it in
``num_cancelled``: those requests appear in no figure.

``LiveStats`` is the running tally the progress display reads (pure, clock-injected).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from sluice.bench.arrivals import LoadSpec, make_driver
from sluice.bench.record import RequestRecord
from sluice.bench.workload import RequestSpec

__all__ = ["LiveStats", "PhaseResult", "Sender", "run_phase"]


class Sender(Protocol):
    async def send(self, spec: RequestSpec, t0: float, phase: int = 0) -> RequestRecord: ...


class LiveStats:
    """Counts and rolling figures for the live display (last ``window_s`` seconds)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, window_s: float = 10.0) -> None:
        self.clock, self.window_s = clock, window_s
        self.t0 = clock()
        self.num_sent = self.num_done = self.num_errors = 0
        self._done_at: deque[float] = deque()  # completion times within the window
        self._ttft: deque[tuple[float, float]] = deque()  # (time, ttft_s)

    def on_sent(self) -> None:
        self.num_sent += 1

    def on_done(self, rec: RequestRecord) -> None:
        now = self.clock()
        self.num_done += 1
        if rec.error:
            self.num_errors += 1
        self._done_at.append(now)
        if rec.ttft_s is not None:
            self._ttft.append((now, rec.ttft_s))

    def _trim(self, now: float) -> None:
        while self._done_at and self._done_at[0] < now - self.window_s:
            self._done_at.popleft()
        while self._ttft and self._ttft[0][0] < now - self.window_s:
            self._ttft.popleft()

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.t0

    def current_rps(self) -> float:
        now = self.clock()
        self._trim(now)
        span = min(self.window_s, now - self.t0)
        return len(self._done_at) / span if span > 0 else 0.0

    def rolling_p95_ttft_ms(self) -> float | None:
        self._trim(self.clock())
        if not self._ttft:
            return None
        vals = sorted(t for _, t in self._ttft)
        return vals[min(len(vals) - 1, math.ceil(0.95 * len(vals)) - 1)] * 1000


@dataclass
class PhaseResult:
    load: LoadSpec
    records: list[RequestRecord] = field(default_factory=list)
    num_cancelled: int = 0  # in flight when the phase was stopped; in no figure
    is_interrupted: bool = False  # stopped by Ctrl-C
    wall_s: float = 0.0


class _Context:
    """The runner's side of ``DriveContext``: caps, and ownership of in-flight requests."""

    def __init__(self, client: Sender, specs: Iterator[RequestSpec], max_requests: int,
                 deadline: float, stop: asyncio.Event, phase: int, live: LiveStats | None,
                 clock: Callable[[], float], run_t0: float | None) -> None:  # fmt: skip
        self.client, self.specs, self.max_requests = client, specs, max_requests
        self.deadline, self.stop, self.phase, self.live = deadline, stop, phase, live
        self.clock = clock
        self.t0 = clock()  # the phase's start: drivers schedule from it
        self.run_t0 = self.t0 if run_t0 is None else run_t0  # records' time axis
        self.num_sent = 0
        self.in_flight: set[asyncio.Task[None]] = set()
        self.records: list[RequestRecord] = []
        self.num_cancelled = 0
        self.exhausted = asyncio.Event()  # no more requests will be handed out

    def next_spec(self) -> RequestSpec | None:
        if self.num_sent >= self.max_requests or self.stop.is_set() or self.clock() >= self.deadline:
            self.exhausted.set()
            return None
        spec = next(self.specs, None)
        if spec is None:
            self.exhausted.set()
            return None
        self.num_sent += 1
        return spec

    def spawn(self, spec: RequestSpec) -> asyncio.Task[None]:
        task = asyncio.create_task(self._one(spec))
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)
        return task

    async def _one(self, spec: RequestSpec) -> None:
        if self.live:
            self.live.on_sent()
        try:
            rec = await self.client.send(spec, self.run_t0, self.phase)
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
        self.records.append(rec)
        if self.live:
            self.live.on_done(rec)


async def run_phase(
    client: Sender,
    specs: Iterator[RequestSpec],
    load: LoadSpec,
    *,
    max_requests: int,
    duration_s: float,
    drain_s: float,
    stop: asyncio.Event | None = None,
    phase: int = 0,
    seed: int = 0,
    live: LiveStats | None = None,
    clock: Callable[[], float] = time.perf_counter,
    run_t0: float | None = None,
) -> PhaseResult:
    """Send ``load`` until a cap, then drain; ``stop`` (Ctrl-C) ends it early.

    Records' times count from ``run_t0`` (default: this phase's start), so the
    phases of a sweep share one time axis.
    """
    if max_requests < 1 or not duration_s > 0:
        raise ValueError("a run needs a request cap >= 1 and a duration > 0")
    stop = stop or asyncio.Event()
    ctx = _Context(client, specs, max_requests, clock() + duration_s, stop, phase, live, clock, run_t0)
    driver = asyncio.create_task(make_driver(load, seed).run(ctx))
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([driver, stopper], timeout=duration_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (driver, stopper):
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await driver
        if ctx.in_flight:
            # NOTE(drain): Ctrl-C waits briefly; a cap waits for the requests in flight
            # (each bounded by the client timeout), up to drain_s.
            grace = min(drain_s, 5.0) if stop.is_set() else drain_s
            _, pending = await asyncio.wait(set(ctx.in_flight), timeout=grace)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    error = driver.exception() if driver.done() and not driver.cancelled() else None
    if error is not None:
        raise error  # a bug in a driver must not pass silently
    ctx.records.sort(key=lambda r: r.start_s)
    return PhaseResult(load, ctx.records, ctx.num_cancelled, stop.is_set(), clock() - ctx.t0)
