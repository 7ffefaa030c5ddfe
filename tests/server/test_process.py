"""Process-level behaviour of ``sluice serve`` (fake engine, real processes):
SIGTERM drains, and a dead engine core fails requests fast and exits non-zero."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from benchmarks.serving_procs import wait_line
from tests.server.conftest import running_in


def _start(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.server.testing", "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    m, _ = wait_line(proc, r"ready in .* at (http://\S+)", 60)
    return proc, m.group(1)


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen[str]] = []

    def make(*args: str) -> tuple[subprocess.Popen[str], str]:
        proc, url = _start(*args)
        procs.append(proc)
        return proc, url

    yield make
    for p in procs:  # a clean shutdown first, so each server removes its sockets' dir
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                for child in psutil.Process(p.pid).children(recursive=True):
                    child.kill()
                p.kill()
        p.wait(10)


def _engine_pid(api_pid: int) -> int:
    kids = psutil.Process(api_pid).children(recursive=True)
    engine = [k for k in kids if "resource_tracker" not in " ".join(k.cmdline())]
    assert engine, "the engine core must run in its own process"
    return engine[0].pid


async def test_sigterm_drains_in_flight_then_exits_zero(spawn) -> None:
    proc, url = spawn("--step-delay", "0.02", "--shutdown-timeout", "20")
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        inflight = [asyncio.create_task(c.post("/v1/completions", json={"prompt": "d", "max_tokens": 50}))
                    for _ in range(4)]
        assert await running_in(url, 4), "the 4 requests must be running before SIGTERM"
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        late = await c.post("/v1/completions", json={"prompt": "late", "max_tokens": 1})
        health = await c.get("/health")
        done = await asyncio.gather(*inflight)
    assert late.status_code == 503 and "retry-after" in late.headers, "new requests get 503 while draining"
    assert health.status_code == 503, "/health must fail while draining so balancers stop sending"
    assert [r.status_code for r in done] == [200] * 4, "in-flight requests complete during the drain"
    assert all(r.json()["usage"]["completion_tokens"] == 50 for r in done)
    assert proc.wait(20) == 0, "a drained server exits 0"


async def test_engine_death_fails_requests_with_503_and_exits_nonzero(spawn) -> None:
    proc, url = spawn("--step-delay", "0.02")
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        plain = [asyncio.create_task(c.post("/v1/completions", json={"prompt": "k", "max_tokens": 200}))
                 for _ in range(3)]

        async def stream() -> tuple[int, str]:
            async with c.stream("POST", "/v1/completions",
                                json={"prompt": "s", "max_tokens": 200, "stream": True}) as r:
                return r.status_code, "".join([line async for line in r.aiter_lines()])

        streaming = asyncio.create_task(stream())
        assert await running_in(url, 4), "all 4 requests must be running before the kill"
        t0 = time.monotonic()
        os.kill(_engine_pid(proc.pid), signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*plain), 10)
        s_status, s_body = await asyncio.wait_for(streaming, 10)
        elapsed = time.monotonic() - t0
    assert [r.status_code for r in results] == [503] * 3, "in-flight requests must get 503"
    assert all(r.json()["error"]["type"] == "service_unavailable" for r in results)
    assert s_status == 200 and '"error"' in s_body and s_body.endswith("data: [DONE]"), (
        "a started stream gets an error event and closes"
    )
    assert elapsed < 5, f"nothing may hang on a dead engine ({elapsed:.1f}s)"
    assert proc.wait(15) != 0, "the API process must exit non-zero so a supervisor restarts it"


def test_health_is_503_until_the_engine_is_ready() -> None:
    import functools

    from sluice.server.app import build_app
    from sluice.server.config import load_settings
    from sluice.server.testing import FakeEngineCore, fake_codec_factory
    from tests.server.conftest import ServerThread

    app = build_app(load_settings(model="fake"),
                    engine_factory=functools.partial(FakeEngineCore, load_delay=3.0),
                    codec_factory=fake_codec_factory)
    srv = ServerThread(app)
    srv.thread.start()
    try:
        codes: list[int] = []
        posts: list[int] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                r = httpx.get(srv.url + "/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            codes.append(r.status_code)
            if r.status_code == 200:
                break
            early = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, timeout=5)
            posts.append(early.status_code)
            if early.status_code == 503:
                assert "retry-after" in early.headers
            time.sleep(0.1)
        assert codes[0] == 503, "/health must not be 200 while the model loads"
        assert posts and posts[0] == 503, f"requests before the engine is ready get 503: {posts}"
        assert codes[-1] == 200, "/health turns 200 once the engine core is ready"
    finally:
        srv.stop()


def _ipc_dirs(root: Path, pid: int) -> list[Path]:
    return sorted(root.glob(f"sluice-ipc-{pid}-*"))


def test_a_killed_servers_socket_dir_is_removed_by_the_next_server(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the servers' temp dir
    killed, _ = _start("--step-delay", "0.01")
    try:
        assert len(_ipc_dirs(tmp_path, killed.pid)) == 1, "a server's sockets live in a dir named by its pid"
        engine = _engine_pid(killed.pid)
        killed.kill()
        killed.wait(10)
        os.kill(engine, signal.SIGKILL)  # no shutdown path at all
    finally:
        if killed.poll() is None:
            killed.kill()
    assert len(_ipc_dirs(tmp_path, killed.pid)) == 1, "SIGKILL leaves the dir"
    keep = tmp_path / f"sluice-ipc-{killed.pid}-withdata"  # not only sockets: not ours to remove
    keep.mkdir()
    (keep / "notes.txt").write_text("x")
    nxt, _ = _start("--step-delay", "0.01")
    try:
        assert _ipc_dirs(tmp_path, killed.pid) == [keep], "the next server removes the dead server's dir"
        assert len(_ipc_dirs(tmp_path, nxt.pid)) == 1, "and not its own"
        nxt.terminate()
        assert nxt.wait(20) == 0
        assert _ipc_dirs(tmp_path, nxt.pid) == [], "a clean shutdown removes its own"
    finally:
        if nxt.poll() is None:
            nxt.kill()


def test_the_sweep_keeps_a_dir_whose_socket_is_listened_on(tmp_path: Path) -> None:
    import socket

    from sluice.server.ipc import sweep_stale_ipc_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)  # a pid that no longer runs here, as another PID namespace's server's would look
    live, dead = tmp_path / f"sluice-ipc-{gone.pid}-live", tmp_path / f"sluice-ipc-{gone.pid}-dead"
    for d in (live, dead):
        d.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as closed:
        listener.bind(str(live / "in"))
        listener.listen()
        closed.bind(str(dead / "in"))  # bound, never listened on: what a killed server's socket is
        assert sweep_stale_ipc_dirs(str(tmp_path)) == [str(dead)]
    assert live.exists() and not dead.exists()
