"""Arrival patterns and caps: what the runner sends, how fast, and how it stops."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest

from sluice.bench.arrivals import LoadMode, LoadSpec, poisson_gaps, ramp_users_at
from sluice.bench.client import OpenAIStreamClient
from sluice.bench.fake_server import FakeConfig, FakeServer
from sluice.bench.runner import LiveStats, run_phase
from sluice.bench.workload import WorkloadSpec, generate_requests, parse_length

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


async def test_closed_loop_keeps_exactly_n_in_flight_and_honours_the_request_cap(fake):
    server, url = await fake(ttft_ms=20)
    res = await phase(url, LoadSpec(LoadMode.CLOSED, concurrency=6), max_requests=60)
    assert len(res.records) == 60 and server.num_requests == 60, "the cap is exact"
    assert server.max_in_flight == 6, "closed loop at concurrency 6 never exceeds 6 in flight"
    assert res.num_cancelled == 0


async def test_poisson_open_loop_reaches_its_rate_regardless_of_latency(fake):
    server, url = await fake(ttft_ms=150)  # slow server: an open loop does not wait for it
    res = await phase(url, LoadSpec(LoadMode.POISSON, rate=100), max_requests=120, seed=3)
    starts = [r.start_s for r in res.records]
    rate = (len(starts) - 1) / (max(starts) - min(starts))
    assert rate == pytest.approx(100, rel=0.25), f"sent at {rate:.0f} req/s instead of 100"
    assert server.max_in_flight > 8, "requests overlap: arrivals do not wait for responses"


async def test_ramp_starts_users_gradually(fake):
    server, url = await fake(ttft_ms=30)
    res = await phase(url, LoadSpec(LoadMode.RAMP, users=8, spawn_rate=20), max_requests=400, duration_s=0.8)  # fmt: skip
    early = [r for r in res.records if r.start_s < 0.04]
    assert 1 <= len(early) <= 2, "one user at the start, not all eight"
    assert server.max_in_flight == 8, "all users run once the ramp is over"


async def test_duration_cap_stops_sending_and_drains_in_flight(fake):
    server, url = await fake(ttft_ms=100)
    res = await phase(url, LoadSpec(LoadMode.CLOSED, concurrency=4), duration_s=0.5)
    assert 12 <= len(res.records) <= 28, f"~0.5 s / 0.1 s x 4 requests, got {len(res.records)}"
    assert all(not r.error for r in res.records), "in-flight requests finish, not cut"
    assert res.wall_s < 1.5


async def test_stop_event_cancels_in_flight_requests_after_the_grace(fake):
    server, url = await fake(ttft_ms=3000)
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.3, stop.set)
    live = LiveStats()
    res = await phase(url, LoadSpec(LoadMode.CLOSED, concurrency=3), stop=stop, drain_s=0.2, live=live)  # fmt: skip
    assert res.is_interrupted and res.records == []
    assert res.num_cancelled == 3, "the three in-flight requests are counted as cancelled"
    assert live.num_sent == 3 and live.num_done == 0


async def test_live_stats_rolling_figures():
    t = [0.0]
    live = LiveStats(clock=lambda: t[0], window_s=10)
    from sluice.bench.record import RequestRecord

    for i in range(20):
        t[0] = 1.0 + i * 0.1
        live.on_sent()
        live.on_done(RequestRecord(i, "p1", 0.0, ttft_s=(i + 1) / 1000, error="x" if i == 0 else ""))
    t[0] = 3.0
    assert live.num_errors == 1 and live.current_rps() == pytest.approx(20 / 3)
    assert live.rolling_p95_ttft_ms() == pytest.approx(19.0)
    t[0] = 20.0
    assert live.rolling_p95_ttft_ms() is None and live.current_rps() == 0
