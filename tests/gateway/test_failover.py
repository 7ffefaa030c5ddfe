"""Failure handling against misbehaving fake replicas: retries, breakers, health, no loss."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx

from sluice.gateway.breaker import BreakerState
from tests.gateway.conftest import FakeClock, fake_backends, gateway_config, serve_gateway


def _body(stream: bool = False, prompt: str = "hello") -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream}


async def test_failover_before_first_byte(http: httpx.AsyncClient) -> None:
    async with fake_backends(3) as fakes:
        fakes[0].config.fault = "reset"
        fakes[1].config.fault = "status"  # 503
        cfg = gateway_config([f.url for f in fakes], policy="round_robin", retry={"max_attempts": 3})
        async with serve_gateway(cfg) as (url, _):
            for i in range(6):
                r = await http.post(url + "/v1/completions", json=_body(stream=i % 2 == 0))
                assert r.status_code == 200, f"a request must fail over to the good replica: {r.text}"
                assert r.headers["x-sluice-replica"] == fakes[2].url
        assert sum(fakes[2].completed.values()) == 6, "every request must be served exactly once by the good replica"


async def test_no_retry_after_the_first_byte(http: httpx.AsyncClient) -> None:
    async with fake_backends(2) as fakes:
        fakes[0].config.fault = "broken_sse"
        cfg = gateway_config([f.url for f in fakes], policy="round_robin")
        async with (
            serve_gateway(cfg) as (url, _),
            http.stream("POST", url + "/v1/completions", json=_body(stream=True)) as r,
        ):
            assert r.status_code == 200
            assert r.headers["x-sluice-replica"] == fakes[0].url, "round robin starts with the first replica"
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert json.loads(events[0][6:])["choices"][0]["text"] == "tok0 ", "the first chunk reached the client"
        assert "error" in json.loads(events[-1][6:]), f"a broken stream must end with an error event: {events}"
        assert fakes[1].num_requests == 0, "a request that already streamed must never be sent again (duplicate output)"


async def test_keeps_answering_with_hanging_resetting_and_broken_backends(http: httpx.AsyncClient) -> None:
    async with fake_backends(4) as fakes:
        fakes[0].config.fault = "hang"
        fakes[1].config.fault = "reset"
        fakes[2].config.fault = "broken_sse"
        cfg = gateway_config(
            [f.url for f in fakes],
            policy="least_load",
            timeouts={"first_byte_s": 0.3},
            retry={"max_attempts": 4},
        )
        async with serve_gateway(cfg) as (url, _):
            t0 = time.monotonic()
            statuses = Counter()
            for i in range(12):
                r = await http.post(url + "/v1/completions", json=_body(stream=False, prompt=f"p{i}"))
                statuses[r.status_code] += 1
            assert statuses == {200: 12}, f"non-streamed requests must all fail over to the good replica: {statuses}"
            assert time.monotonic() - t0 < 8, "a hung replica must cost at most first_byte_s per request"
            endings = Counter()
            for i in range(8):
                async with http.stream("POST", url + "/v1/completions", json=_body(stream=True, prompt=f"s{i}")) as r:
                    assert r.status_code == 200, "a streamed request must start on some replica"
                    events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                endings["done" if events[-1] == "data: [DONE]" else "error" if "error" in events[-1] else "other"] += 1
            assert endings["other"] == 0, f"a stream must end with [DONE] or an error event, never cut silently: {endings}"
            r = await http.post(url + "/v1/completions", json=_body())
            assert r.status_code == 200, "the gateway must keep answering after broken streams"
            health = (await http.get(url + "/health")).json()
            assert health["routable_replicas"]["m"] >= 1, "the gateway must keep a replica in rotation"


async def test_breaker_opens_on_failures_half_opens_after_open_s_and_closes_on_probes(
    http: httpx.AsyncClient, clock: FakeClock
) -> None:
    async with fake_backends(2) as fakes:
        bad = fakes[0]
        bad.config.fault = "status"
        bad.config.status = 500
        cfg = gateway_config(
            [f.url for f in fakes],
            policy="round_robin",
            breaker={"min_requests": 4, "open_s": 1.0, "half_open_probes": 2},
        )
        async with serve_gateway(cfg, clock=clock, run_scraper=False) as (url, app):
            replica = next(r for r in app.state.gateway.pool.replicas() if r.url == bad.url)
            for _ in range(8):
                r = await http.post(url + "/v1/completions", json=_body())
                assert r.status_code == 200, "failures at one replica must be hidden by retries"
            assert replica.breaker.state is BreakerState.OPEN, "a replica failing every request must be opened"
            received = bad.num_requests
            for _ in range(4):
                await http.post(url + "/v1/completions", json=_body())
            assert bad.num_requests == received, "an open breaker must keep traffic away"
            bad.config.fault = "ok"
            clock.advance(0.9)
            assert replica.breaker.state is BreakerState.OPEN, "the breaker stays open for open_s"
            clock.advance(0.2)
            assert replica.breaker.state is BreakerState.HALF_OPEN, "after open_s the breaker half-opens"
            for _ in range(6):
                await http.post(url + "/v1/completions", json=_body())
            assert replica.breaker.state is BreakerState.CLOSED, "successful probes must close the breaker"
            metrics = (await http.get(url + "/metrics")).text
            assert f'sluice_gateway_breaker_trips_total{{model="m",replica="{bad.url}"}} 1.0' in metrics


async def test_all_open_answers_503_with_retry_after_and_sends_nothing(http: httpx.AsyncClient, clock: FakeClock) -> None:
    async with fake_backends(1) as fakes:
        fakes[0].config.fault = "status"
        fakes[0].config.status = 502
        cfg = gateway_config([fakes[0].url], breaker={"min_requests": 3, "open_s": 30})
        async with serve_gateway(cfg, clock=clock, run_scraper=False) as (url, _):
            for _ in range(3):
                r = await http.post(url + "/v1/completions", json=_body())
                assert r.status_code == 502, "with no other replica, the replica's own error goes back"
                assert r.headers.get("retry-after") == "2", "the replica's Retry-After must reach the client"
            received = fakes[0].num_requests
            r = await http.post(url + "/v1/completions", json=_body())
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica", r.text
            assert r.headers["retry-after"] == "30", "Retry-After must say when the breaker's probe is due (open_s)"
            assert fakes[0].num_requests == received, "nothing may be sent to an open replica"
            assert (await http.get(url + "/health")).status_code == 503


async def test_no_request_lost_or_duplicated_when_a_replica_dies(http: httpx.AsyncClient) -> None:
    async with fake_backends(3, tokens_per_s=500) as fakes:
        cfg = gateway_config([f.url for f in fakes], policy="least_load", retry={"max_attempts": 3})
        async with serve_gateway(cfg) as (url, _):

            async def one(i: int) -> tuple[int, str]:
                rid = f"req-{i}"
                r = await http.post(url + "/v1/completions", json=_body(stream=False), headers={"x-request-id": rid})
                return r.status_code, rid

            first = await asyncio.gather(*(one(i) for i in range(30)))
            fakes[1].config.fault = "reset"  # dies mid-run
            second = await asyncio.gather(*(one(i) for i in range(30, 80)))
        results = first + second
        assert all(s == 200 for s, _ in results), f"every request must succeed: {Counter(s for s, _ in results)}"
        completed = sum((f.completed for f in fakes), Counter())
        assert set(completed) == {rid for _, rid in results}, "every request must be answered by some replica"
        assert max(completed.values()) == 1, "no request may be answered twice"


async def test_unhealthy_replica_is_taken_out_after_failed_probes_and_probed_back(
    http: httpx.AsyncClient, clock: FakeClock
) -> None:
    async with fake_backends(2) as fakes:
        fakes[0].config.health_status = 503
        cfg = gateway_config([f.url for f in fakes], policy="round_robin")  # unhealthy_after 2, healthy_after 1
        async with serve_gateway(cfg, clock=clock, run_scraper=False) as (url, app):
            scraper = app.state.scraper
            replica = next(r for r in app.state.gateway.pool.replicas() if r.url == fakes[0].url)
            await scraper.step()
            assert replica.health.is_up, "one failed probe is not enough (unhealthy_after = 2)"
            clock.advance(0.1)
            await scraper.step()
            assert replica.health.is_up, "no probe before interval_s has passed"
            clock.advance(0.1)
            await scraper.step()
            assert not replica.health.is_up, "failing /health probes must take the replica out"
            for _ in range(4):
                r = await http.post(url + "/v1/completions", json=_body())
                assert r.headers["x-sluice-replica"] == fakes[1].url, "a down replica gets no traffic"
            fakes[0].config.health_status = 200
            clock.advance(0.2)
            await scraper.step()
            assert replica.health.is_up, "a passing probe must bring the replica back"
            seen = {(await http.post(url + "/v1/completions", json=_body())).headers["x-sluice-replica"] for _ in range(4)}
            assert fakes[0].url in seen, "traffic must return to a recovered replica"


async def test_a_stream_that_stalls_mid_way_ends_with_an_error(http: httpx.AsyncClient) -> None:
    async with fake_backends(1) as fakes:
        fakes[0].config.fault = "stall_sse"
        cfg = gateway_config([fakes[0].url], timeouts={"idle_s": 0.3})
        async with serve_gateway(cfg) as (url, app):
            t0 = time.monotonic()
            async with http.stream("POST", url + "/v1/completions", json=_body(stream=True)) as r:
                events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert time.monotonic() - t0 < 3, "a stalled stream must be cut after idle_s, not hang"
            assert len(events) == 2 and "error" in json.loads(events[-1][6:]), (
                f"the client must get the first chunk, then an error event: {events}"
            )
            replica = next(iter(app.state.gateway.pool.replicas()))
            assert replica.num_inflight == 0, "a cut stream must release its load count"
            fakes[0].config.fault = "ok"
            r = await http.post(url + "/v1/completions", json=_body())
            assert r.status_code == 200, "the gateway must keep answering after a stalled stream"
