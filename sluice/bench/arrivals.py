"""Arrival patterns: when requests are sent.  One small interface, one factory.

    closed   N workers, each sends its next request when the last one ends
    poisson  open loop: exponential gaps at a fixed rate, whatever the server does
    ramp     locust-like: ``spawn_rate`` new closed-loop users per second up to ``users``
    trace    open loop at the trace's own timestamps (``trace_speed`` x faster)

A driver only decides *when* to send; ``DriveContext`` (owned by the runner)
hands out the next request (``None`` once a cap is reached or the run stops)
and owns every in-flight request, so stopping a driver never cuts a request.
The schedules themselves are pure functions (``poisson_gaps``, ``ramp_users_at``).
"""

from __future__ import annotations

import asyncio
import enum
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from sluice.bench.workload import RequestSpec

__all__ = [
    "LoadMode",
    "LoadSpec",
    "DriveContext",
    "Driver",
    "make_driver",
    "poisson_gaps",
    "ramp_users_at",
]


class LoadMode(str, enum.Enum):
    CLOSED = "closed"
    POISSON = "poisson"
    RAMP = "ramp"
    TRACE = "trace"


@dataclass(frozen=True)
class LoadSpec:
    mode: LoadMode
    concurrency: int = 0  # closed
    rate: float = 0.0  # poisson: requests/s
    users: int = 0  # ramp
    spawn_rate: float = 0.0  # ramp: users started per second
    trace_speed: float = 1.0  # trace: time compression

    def __post_init__(self) -> None:
        checks = {
            LoadMode.CLOSED: (self.concurrency >= 1, "concurrency must be >= 1"),
            LoadMode.POISSON: (self.rate > 0, "rate must be > 0"),
            LoadMode.RAMP: (self.users >= 1 and self.spawn_rate > 0, "ramp needs users >= 1 and spawn rate > 0"),
            LoadMode.TRACE: (self.trace_speed > 0, "trace speed must be > 0"),
        }  # fmt: skip
        is_valid, message = checks[self.mode]
        if not is_valid:
            raise ValueError(message)

    @property
    def level(self) -> float:
        """The one number a sweep varies: concurrency, rate or users."""
        return {
            LoadMode.CLOSED: self.concurrency, LoadMode.POISSON: self.rate,
            LoadMode.RAMP: self.users, LoadMode.TRACE: self.trace_speed,
        }[self.mode]  # fmt: skip

    def describe(self) -> str:
        return {
            LoadMode.CLOSED: f"closed loop, concurrency {self.concurrency}",
            LoadMode.POISSON: f"Poisson arrivals, {self.rate:g} req/s",
            LoadMode.RAMP: f"ramp to {self.users} users at {self.spawn_rate:g}/s",
            LoadMode.TRACE: f"trace replay at {self.trace_speed:g}x",
        }[self.mode]

    def to_dict(self) -> dict[str, object]:
        fields: dict[LoadMode, dict[str, object]] = {
            LoadMode.CLOSED: {"concurrency": self.concurrency},
            LoadMode.POISSON: {"rate": self.rate},
            LoadMode.RAMP: {"users": self.users, "spawn_rate": self.spawn_rate},
            LoadMode.TRACE: {"trace_speed": self.trace_speed},
        }
        return {"mode": self.mode.value, "level": self.level, **fields[self.mode]}


def poisson_gaps(rate: float, rng: random.Random) -> Iterator[float]:
    """Exponential inter-arrival gaps (seconds) of a Poisson process at ``rate``/s."""
    while True:
        yield rng.expovariate(rate)


def ramp_users_at(elapsed_s: float, users: int, spawn_rate: float) -> int:
    """Users running ``elapsed_s`` after the start: one at once, then ``spawn_rate``/s."""
    return min(users, 1 + math.floor(max(0.0, elapsed_s) * spawn_rate))


class DriveContext(Protocol):
    clock: Callable[[], float]
    t0: float  # the run's start on clock

    def next_spec(self) -> RequestSpec | None: ...

    def spawn(self, spec: RequestSpec) -> asyncio.Task[None]: ...


class Driver(Protocol):
    async def run(self, ctx: DriveContext) -> None: ...


async def _sleep_until(ctx: DriveContext, t: float) -> None:
    delay = t - ctx.clock()
    if delay > 0:
        await asyncio.sleep(delay)


async def _user(ctx: DriveContext) -> None:
    while (spec := ctx.next_spec()) is not None:
        # NOTE(shield): wait() does not cancel the request when the driver is
        # cancelled at the end of the run; the runner drains it.
        await asyncio.wait([ctx.spawn(spec)])


async def _gather_users(users: list[asyncio.Task[None]]) -> None:
    try:
        await asyncio.gather(*users)
    finally:
        for u in users:
            u.cancel()


def _all_done(tasks: list[asyncio.Task[None]]) -> bool:
    """True once users were started and every one has run out of requests."""
    return bool(tasks) and all(t.done() for t in tasks)


@dataclass(frozen=True)
class ClosedLoop:
    concurrency: int

    async def run(self, ctx: DriveContext) -> None:
        await _gather_users([asyncio.create_task(_user(ctx)) for _ in range(self.concurrency)])


@dataclass(frozen=True)
class Ramp:
    users: int
    spawn_rate: float

    async def run(self, ctx: DriveContext) -> None:
        tasks: list[asyncio.Task[None]] = []
        try:
            while len(tasks) < self.users and not _all_done(tasks):
                want = ramp_users_at(ctx.clock() - ctx.t0, self.users, self.spawn_rate)
                tasks += [asyncio.create_task(_user(ctx)) for _ in range(want - len(tasks))]
                if len(tasks) < self.users:
                    await asyncio.sleep(min(0.05, 1.0 / self.spawn_rate))
        finally:
            await _gather_users(tasks)


@dataclass(frozen=True)
class Poisson:
    rate: float
    seed: int

    async def run(self, ctx: DriveContext) -> None:
        gaps = poisson_gaps(self.rate, random.Random(f"arrivals-{self.seed}"))
        t = ctx.t0
        while (spec := ctx.next_spec()) is not None:
            t += next(gaps)
            await _sleep_until(ctx, t)  # absolute schedule: no drift from slow sends
            ctx.spawn(spec)


@dataclass(frozen=True)
class TraceReplay:
    speed: float

    async def run(self, ctx: DriveContext) -> None:
        while (spec := ctx.next_spec()) is not None:
            if spec.send_at_s is not None:
                await _sleep_until(ctx, ctx.t0 + spec.send_at_s / self.speed)
            ctx.spawn(spec)


def make_driver(load: LoadSpec, seed: int = 0) -> Driver:
    if load.mode is LoadMode.CLOSED:
        return ClosedLoop(load.concurrency)
    if load.mode is LoadMode.POISSON:
        return Poisson(load.rate, seed)
    if load.mode is LoadMode.RAMP:
        return Ramp(load.users, load.spawn_rate)
    return TraceReplay(load.trace_speed)
