"""The streaming client against the fake server: timings, token counts, every failure kind."""

from __future__ import annotations

import asyncio
import socket
import time
from itertools import islice

import pytest

from sluice.bench.client import OpenAIStreamClient, error_text
from sluice.bench.fake_server import FakeConfig, FakeServer
from sluice.bench.summary import summarize
from sluice.bench.workload import Api, WorkloadSpec, generate_requests, parse_length


async def send_all(url: str, n: int, *, api: Api = Api.CHAT, out: int = 8, conc: int = 8, timeout_s: float = 5.0):  # fmt: skip
    specs = list(islice(generate_requests(WorkloadSpec(api=api, output_len=parse_length(out), input_len=parse_length(20)), 0), n))  # fmt: skip
    sem = asyncio.Semaphore(conc)
    async with OpenAIStreamClient(url, model="m", api=api, timeout_s=timeout_s) as c:
        t0 = time.perf_counter()

        async def one(s):
            async with sem:
                return await c.send(s, t0)

        return await asyncio.gather(*(one(s) for s in specs))


@pytest.fixture
async def server_factory():
    servers: list[FakeServer] = []

    async def start(**kw) -> str:
        s = FakeServer(FakeConfig(**kw))
        servers.append(s)
        return await s.start()

    yield start
    for s in servers:
        await s.stop()


@pytest.mark.parametrize("api", [Api.CHAT, Api.COMPLETIONS])
async def test_measured_ttft_and_tpot_match_the_servers_pace(server_factory, api):
    url = await server_factory(ttft_ms=80, tokens_per_s=50)  # 20 ms per token
    await send_all(url, 1, api=api, out=1)  # the first connection's set-up is not the server's pace
    for _ in range(2):  # a loaded 2-core host can stall one burst of the loop (a suite run saw 211 ms): one more try
        recs = await send_all(url, 8, api=api, out=6, conc=4)
        s = summarize(recs)
        if s["num_errors"] == 0 and abs(s["ttft_ms"]["p50"] - 80) <= 15 and abs(s["tpot_ms"]["p50"] - 20) <= 4:
            break
    assert s["num_errors"] == 0, s["errors"]
    assert s["ttft_ms"]["p50"] == pytest.approx(80, abs=15), "TTFT should be the fake's 80 ms"
    assert s["tpot_ms"]["p50"] == pytest.approx(20, abs=4), "TPOT should be 1/50 s"
    assert s["itl_ms"]["p50"] == pytest.approx(20, abs=5)
    assert all(r.num_output_tokens == 6 for r in recs), "usage.completion_tokens is reported"
    assert all(r.num_input_tokens == 20 for r in recs), "usage.prompt_tokens is reported"
    assert s["e2e_ms"]["p50"] == pytest.approx(80 + 5 * 20, abs=25)


async def test_http_errors_are_counted_exactly(server_factory):
    url = await server_factory(error_rate=0.1)
    recs = await send_all(url, 100, out=4)
    errors = [r for r in recs if r.error]
    assert len(errors) == 10, "error_rate 0.1 over 100 requests is exactly 10 failures"
    assert all(r.status == 500 and r.error.startswith("HTTP 500: fake server") for r in errors)
    assert summarize(recs)["error_rate"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    "mode, reason",
    [
        ("reset", "connection error"),
        ("truncate", "stream ended without [DONE]"),
        ("garbage", "malformed SSE chunk"),
    ],
)
async def test_mid_stream_failures_become_errors_with_their_reason(server_factory, mode, reason):
    url = await server_factory(midstream_failure_rate=0.25, midstream_mode=mode)
    recs = await send_all(url, 40, out=8)
    bad = [r for r in recs if r.error]
    assert len(bad) == 10, f"{mode}: a quarter of 40 streams were cut, got {len(bad)}"
    assert all(r.error.startswith(reason) for r in bad), {r.error for r in bad}
    assert all(r.status == 200 for r in bad), "the stream began with a 200 before it broke"


async def test_timeout_and_refused_connection_are_recorded_not_raised(server_factory):
    url = await server_factory(ttft_ms=2000)
    recs = await send_all(url, 2, timeout_s=0.3)
    assert all(r.error == "timeout after 0.3s" for r in recs), [r.error for r in recs]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connection refused
        recs = await send_all(f"http://127.0.0.1:{port}", 2)
    assert all(r.error.startswith("connection error") and r.status == 0 for r in recs)


def test_error_text_reads_the_openai_message_on_one_line():
    raw = b'{"error": {"message": "model\\n  overloaded", "type": "overloaded_error"}}'
    assert error_text(429, raw) == "HTTP 429: model overloaded"
    assert error_text(502, b"<html>Bad Gateway</html>") == "HTTP 502: <html>Bad Gateway</html>"


def test_fake_server_runs_as_a_module_on_a_free_port():
    import subprocess
    import sys
    import urllib.request

    p = subprocess.Popen([sys.executable, "-m", "sluice.bench.fake_server", "--port", "0", "--model", "x"],
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = p.stdout.readline().strip()
        assert line.startswith("listening on http://127.0.0.1:"), line
        with urllib.request.urlopen(line.removeprefix("listening on ") + "/v1/models", timeout=5) as r:
            assert b'"x"' in r.read()
    finally:
        p.terminate()
        p.wait(timeout=10)
    bad = subprocess.run([sys.executable, "-m", "sluice.bench.fake_server", "--error-rate", "2"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert bad.returncode == 2 and "error_rate must be within [0, 1]" in bad.stderr
