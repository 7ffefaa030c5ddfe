"""Arrival patterns and caps: what the runner sends, how fast, and how it stops."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import pytest

from sluice.bench.arrivals import LoadMode, LoadSpec, poisson_gaps, ramp_users_at
from sluice.bench.client import OpenAIStreamClient
from sluice.bench.fake_server import FakeConfig, FakeServer
from sluice.bench.record import RequestRecord
from sluice.bench.runner import LiveStats, PhaseResult, run_phase
from sluice.bench.workload import RequestSpec, WorkloadSpec, generate_requests, parse_length
from tests.virtual_time import run_virtual

WL = WorkloadSpec(input_len=parse_length(8), output_len=parse_length(4))


@pytest.fixture
async def fake():
    servers: list[FakeServer] = []

    async def start(**kw):
        s = FakeServer(FakeConfig(**kw))
        servers.append(s)
        return s, await s.start()

    yield start
    for s in servers:
        await s.stop()


async def phase(url: str, load: LoadSpec, **kw):
    async with OpenAIStreamClient(url, model="m", timeout_s=5) as c:
        kw.setdefault("max_requests", 1000)
        kw.setdefault("duration_s", 10.0)
        kw.setdefault("drain_s", 5.0)
        return await run_phase(c, generate_requests(WL, 0), load, **kw)


def test_poisson_gaps_have_mean_one_over_rate_and_ramp_adds_users_over_time():
    gaps = [g for _, g in zip(range(20000), poisson_gaps(50.0, random.Random(1)), strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.03)
    assert [ramp_users_at(t, 10, 4) for t in (0, 0.24, 0.26, 1.0, 2.2, 9)] == [1, 1, 2, 5, 9, 10]


async def test_closed_loop_over_http_keeps_exactly_n_in_flight_and_honours_the_request_cap(fake):
    server, url = await fake(ttft_ms=20)
    res = await phase(url, LoadSpec(LoadMode.CLOSED, concurrency=6), max_requests=60)
    assert len(res.records) == 60 and server.num_requests == 60, "the cap is exact"
    assert server.max_in_flight == 6, "closed loop at concurrency 6 never exceeds 6 in flight"
    assert res.num_cancelled == 0


class FakeSender:
    """A server stand-in on the loop's (virtual) clock: every request takes ``latency_s``."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.num_requests = self.num_in_flight = self.max_in_flight = 0

    async def send(self, spec: RequestSpec, t0: float, phase: int = 0) -> RequestRecord:
        now = asyncio.get_running_loop().time
        start = now() - t0
        self.num_requests += 1
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            await asyncio.sleep(self.latency_s)
        finally:
            self.num_in_flight -= 1
        return RequestRecord(spec.index, spec.priority.label, start, end_s=now() - t0, ttft_s=self.latency_s,
                             status=200, phase=phase)  # fmt: skip


def virtual_phase(sender: FakeSender, load: LoadSpec, **kw: object) -> PhaseResult:
    """``run_phase`` on virtual time (tests/virtual_time.py): sleeps cost no wall time."""

    async def go() -> PhaseResult:
        kw.setdefault("max_requests", 1000)
        kw.setdefault("duration_s", 10.0)
        kw.setdefault("drain_s", 5.0)
        clock = asyncio.get_running_loop().time
        return await run_phase(sender, generate_requests(WL, 0), load, clock=clock, **kw)  # type: ignore[arg-type]

    return run_virtual(go())


def test_poisson_open_loop_sends_at_its_rate_however_slow_the_server_is() -> None:
    sender = FakeSender(latency_s=0.15)  # slow server: an open loop does not wait for it
    res = virtual_phase(sender, LoadSpec(LoadMode.POISSON, rate=100), max_requests=400, seed=3)
    starts = [r.start_s for r in res.records]
    rate = (len(starts) - 1) / (max(starts) - min(starts))
    assert rate == pytest.approx(100, rel=0.1), f"sent at {rate:.0f} req/s instead of 100"
    assert sender.max_in_flight > 8, "requests overlap: arrivals do not wait for responses"


def test_ramp_starts_one_user_then_spawn_rate_users_per_second() -> None:
    sender = FakeSender(latency_s=0.03)
    res = virtual_phase(sender, LoadSpec(LoadMode.RAMP, users=8, spawn_rate=20), max_requests=400, duration_s=0.8)
    early = [r for r in res.records if r.start_s < 0.04]
    assert len(early) == 2, "one user at the start (two requests of 30 ms in the first 40 ms), not all eight"
    assert sender.max_in_flight == 8, "all users run once the ramp is over (7 / 20 per s = 0.35 s)"


def test_duration_cap_stops_sending_and_drains_in_flight() -> None:
    sender = FakeSender(latency_s=0.1)
    res = virtual_phase(sender, LoadSpec(LoadMode.CLOSED, concurrency=4), duration_s=0.5)
    assert len(res.records) == 20, "0.5 s / 0.1 s per request x 4 users, the last round drained"
    assert all(not r.error for r in res.records), "in-flight requests finish, not cut"
    assert res.wall_s == pytest.approx(0.5, abs=1e-6)


def test_stop_event_cancels_in_flight_requests_after_the_grace() -> None:
    sender = FakeSender(latency_s=3.0)
    live = LiveStats(clock=time.monotonic)

    async def go() -> PhaseResult:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, stop.set)
        clock = asyncio.get_running_loop().time
        return await run_phase(sender, generate_requests(WL, 0), LoadSpec(LoadMode.CLOSED, concurrency=3),
                               max_requests=1000, duration_s=10.0, drain_s=0.2, stop=stop, live=live, clock=clock)  # fmt: skip

    res = run_virtual(go())
    assert res.is_interrupted and res.records == []
    assert res.num_cancelled == 3, "the three in-flight requests are counted as cancelled"
    assert live.num_sent == 3 and live.num_done == 0


async def test_live_stats_rolling_figures():
    t = [0.0]
    live = LiveStats(clock=lambda: t[0], window_s=10)

    for i in range(20):
        t[0] = 1.0 + i * 0.1
        live.on_sent()
        live.on_done(RequestRecord(i, "p1", 0.0, ttft_s=(i + 1) / 1000, error="x" if i == 0 else ""))
    t[0] = 3.0
    assert live.num_errors == 1 and live.current_rps() == pytest.approx(20 / 3)
    assert live.rolling_p95_ttft_ms() == pytest.approx(19.0)
    t[0] = 20.0
    assert live.rolling_p95_ttft_ms() is None and live.current_rps() == 0
