"""Server test fixtures: a real ``sluice serve`` app (uvicorn in a thread, the
engine core in its own process over ZMQ) on a free port.

The fake engine (``sluice.server.testing``) backs the fast tests; the real
``EngineCore`` with the tiny random model backs ``test_real_engine.py``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice.server.app import ServerState, build_app
from sluice.server.config import load_settings
from sluice.server.testing import FakeEngineCore, fake_codec_factory


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1:<free port> from a background thread."""

    def __init__(self, app: Any):
        self.app = app
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(2048)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, loop="uvloop", http="httptools", lifespan="on", log_level="warning",
                             timeout_graceful_shutdown=3, backlog=2048)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def state(self) -> ServerState:
        return self.app.state.sluice

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if not self.thread.is_alive():
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server did not become healthy: {self.state.startup_error}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


@contextlib.contextmanager
def serve_smollm2_process(timeout: float = 300.0) -> Iterator[str]:
    """``sluice serve`` on the embedded SmolLM2 in a process of its own (a free port); yields its URL and
    stops it after."""
    from benchmarks.serving_procs import wait_line

    env = {**os.environ, "SLUICE_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "serve", "--model", "smollm2", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    try:
        m, _ = wait_line(proc, r"ready in .* at (http://\S+)", timeout)
        yield m.group(1)
    finally:
        proc.terminate()
        proc.wait(30)


def start_fake_server(step_delay: float = 0.002, tracer_provider: TracerProvider | None = None,
                      engine_kwargs: dict[str, Any] | None = None, **settings: Any) -> ServerThread:
    s = load_settings(model="fake", **settings)
    app = build_app(
        s,
        engine_factory=functools.partial(FakeEngineCore, step_delay=step_delay, **(engine_kwargs or {})),
        codec_factory=fake_codec_factory,
        tracer_provider=tracer_provider,
    )
    return ServerThread(app).start()


@pytest.fixture(scope="module")
def span_exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def fake_server(span_exporter: InMemorySpanExporter) -> Iterator[ServerThread]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    srv = start_fake_server(tracer_provider=provider)
    yield srv
    srv.stop()


@pytest.fixture
def server_factory() -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def make(**kw: Any) -> ServerThread:
        srv = start_fake_server(**kw)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


def render_engine_stats(stats: Any) -> str:
    """What a sluice server's /metrics shows for these ``EngineStats`` (the exporter itself, no server)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from sluice.server.telemetry import EngineStatsCollector

    reg = CollectorRegistry()
    c = EngineStatsCollector()
    c.latest = stats
    reg.register(c)
    return generate_latest(reg).decode()


def scrape(url: str) -> dict[str, float]:
    """Parse /metrics into {'name{labels}': value} (sample lines only)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_for(pred: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


async def until(pred: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Async ``wait_for``: polls without blocking the test's event loop."""
    import asyncio

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(interval)
    return pred()


async def running_in(url: str, n: int, timeout: float = 20.0) -> bool:
    """Wait until the server's engine reports ``n`` running requests."""
    import asyncio

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as c:
        while time.monotonic() < deadline:
            text = (await c.get(url + "/metrics")).text
            for line in text.splitlines():
                if line.startswith("sluice_num_requests_running ") and float(line.split()[1]) >= n:
                    return True
            await asyncio.sleep(0.05)
    return False
