"""NOTE(p0-spread): a P0 goes to a replica with the fewest P0s still waiting for their answer there."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from sluice.gateway.config import ReplicaConfig
from sluice.gateway.policies import spread_p0
from sluice.gateway.replica import Replica
from sluice.types import Priority
from tests.gateway.conftest import FakeClock, fake_backends, gateway_config, serve_gateway


def _replicas(n: int) -> list[Replica]:
    cfg = gateway_config(["http://x:1"])
    return [
        Replica.build(ReplicaConfig(url=f"http://r{i}:80"), model="m", version="v1", health=cfg.health,
                      breaker=cfg.breaker, clock=FakeClock())
        for i in range(n)
    ]


def test_spread_keeps_the_replicas_with_the_fewest_waiting_p0s() -> None:
    a, b, c = _replicas(3)
    assert spread_p0([a, b, c]) == ([a, b, c], None), "all equal: every replica stays, no reason"
    a.p0_awaiting_first, b.p0_awaiting_first, c.p0_awaiting_first = 2, 1, 1
    assert spread_p0([a, b, c]) == ([b, c], "p0_spread")
    assert spread_p0([a]) == ([a], None), "one candidate is kept whatever it holds"


def test_awaiting_answer_counts_p0_only_and_always_gives_back() -> None:
    (r,) = _replicas(1)
    with r.awaiting_answer(Priority.P0):
        assert r.p0_awaiting_first == 1
        with r.awaiting_answer(Priority.P2):
            assert r.p0_awaiting_first == 1, "a lower class is not counted"
    assert r.p0_awaiting_first == 0
    with pytest.raises(RuntimeError), r.awaiting_answer(Priority.P0):
        raise RuntimeError("the attempt failed")
    assert r.p0_awaiting_first == 0, "a failed attempt gives its count back"


async def test_a_second_p0_goes_where_no_p0_waits_even_against_the_load(http: httpx.AsyncClient) -> None:
    async with fake_backends(2, ttft_ms=400) as fakes:
        cfg = gateway_config([f.url for f in fakes], policy="least_load", scrape_interval=3600,
                             timeouts={"first_byte_s": 5.0, "idle_s": 5.0})
        async with serve_gateway(cfg) as (url, app):
            replicas = {r.url: r for r in app.state.gateway.pool.replicas()}

            async def send(priority: str) -> httpx.Response:
                body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}
                return await http.post(url + "/v1/completions", json=body, headers={"x-priority": priority})

            first = asyncio.create_task(send("p0"))
            for _ in range(200):
                busy = [r for r in replicas.values() if r.p0_awaiting_first]
                if busy:
                    break
                await asyncio.sleep(0.005)
            assert len(busy) == 1 and busy[0].p0_awaiting_first == 1, "the first P0 is counted where it went"
            (free,) = [r for r in replicas.values() if r is not busy[0]]
            free.inflight_tokens += 100_000  # least_load alone would now send everything to the busy one
            try:
                second, lower = await asyncio.gather(send("p0"), send("p2"))
            finally:
                free.inflight_tokens -= 100_000
            r1 = await first
            assert {r1.status_code, second.status_code, lower.status_code} == {200}
            assert r1.headers["x-sluice-replica"] == busy[0].url
            assert second.headers["x-sluice-replica"] == free.url, "the second P0 avoids the replica where one waits"
            assert lower.headers["x-sluice-replica"] == busy[0].url, "a P2 is routed by load alone"
            assert all(r.p0_awaiting_first == 0 for r in replicas.values()), "every count is given back"
            metrics = (await http.get(url + "/metrics")).text
            assert 'reason="p0_spread"' in metrics
