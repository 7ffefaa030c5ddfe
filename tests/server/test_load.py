"""Many concurrent streams, and clients that vanish mid-stream (fake engine)."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx

from tests.server.conftest import scrape, until, wait_for


async def _stream(session: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[int, int, bool]:
    body = {"prompt": "load", "max_tokens": max_tokens, "stream": True, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as r:
        events, done = 0, False
        async for raw in r.content:
            line = raw.strip()
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                events += 1
        return r.status, events, done


def _drained(url: str) -> bool:
    m = scrape(url)
    return m["sluice_num_requests_running"] == 0 and m["sluice_kv_cache_usage_ratio"] == 0.0


async def test_256_concurrent_streams_complete_without_errors(server_factory) -> None:
    srv = server_factory(step_delay=0.002, max_num_seqs=256, max_queued_requests=512)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        results = await asyncio.gather(*[_stream(s, srv.url, 16) for _ in range(256)], return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException) or r[0] != 200 or not r[2] or r[1] != 16]
    assert not errors, f"{len(errors)} of 256 streams failed, e.g. {errors[:3]}"
    assert wait_for(lambda: _drained(srv.url), 10), "running requests and KV usage must return to 0"
    m = scrape(srv.url)
    assert m['sluice_requests_total{priority="p1",status="200"}'] == 256


async def test_100_clients_disconnect_mid_stream_and_blocks_are_freed(server_factory) -> None:
    srv = server_factory(step_delay=0.005, max_num_seqs=128)

    async def vanish(session: aiohttp.ClientSession) -> int:
        body = {"prompt": "bye", "max_tokens": 400, "stream": True}
        async with session.post(srv.url + "/v1/completions", json=body) as r:
            seen = 0
            async for raw in r.content:
                if raw.startswith(b"data: "):
                    seen += 1
                    if seen == 3:
                        return seen  # leaving the block closes the connection
        return seen

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:
        seen = await asyncio.gather(*[vanish(s) for _ in range(100)])
    assert all(n == 3 for n in seen)
    assert wait_for(lambda: _drained(srv.url), 10), (
        f"after 100 disconnects every KV block must be freed: {scrape(srv.url)['sluice_kv_cache_usage_ratio']}"
    )
    assert srv.state.client.num_open_requests == 0, "no engine request may stay registered"
    assert scrape(srv.url).get('sluice_requests_total{priority="p1",status="499"}') == 100
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "still", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200, "the server keeps answering after mass disconnects"


async def test_disconnect_while_queued_aborts_the_request(server_factory) -> None:
    srv = server_factory(step_delay=0.02, max_num_seqs=1)
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        hog = asyncio.create_task(c.post("/v1/completions", json={"prompt": "h", "max_tokens": 100}))
        assert await until(lambda: srv.state.client.num_open_requests == 1 and srv.state.admission.num_queued == 0)
        waiting = asyncio.create_task(c.post("/v1/completions", json={"prompt": "w", "max_tokens": 60}))
        assert await until(lambda: srv.state.admission.num_queued == 1)
        waiting.cancel()  # the client gives up before its first token
        for _ in range(40):
            await asyncio.sleep(0.025)
            if srv.state.admission.num_queued == 0:
                break
        assert not hog.done(), "the hog must still hold the only slot (else this proves nothing)"
        assert srv.state.admission.num_queued == 0, "a vanished client leaves the queue at once"
        assert srv.state.client.num_open_requests == 1, "its engine request is aborted"
        assert (await hog).status_code == 200
