"""Gateway test fixtures: in-process fake replicas and a gateway served by uvicorn.

Everything runs in the test's event loop on 127.0.0.1 with ports picked by
the OS (port 0); every server is stopped when the test ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn

from sluice.bench.fake_server import FakeConfig, FakeServer
from sluice.gateway.app import build_app
from sluice.gateway.config import GatewayConfig, load_config


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def gateway_config(urls: list[str], model: str = "m", **overrides: Any) -> GatewayConfig:
    """A config for one model served by ``urls``; overrides are config fields."""
    data: dict[str, Any] = {
        "models": {model: {"versions": [{"name": "v1", "replicas": urls}]}},
        "seed": 0,
        # quick failure handling so tests stay fast
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "unhealthy_after": 2, "healthy_after": 1},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 1.0, "idle_s": 1.0},
    }
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    return load_config(None, **data)


@contextlib.asynccontextmanager
async def serve_gateway(config: GatewayConfig, **kwargs: Any) -> AsyncIterator[tuple[str, Any]]:
    """Run the gateway app under uvicorn in this loop; yields (base url, app)."""
    app = build_app(config, **kwargs)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", access_log=False)
    )
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(500):
            if server.started:
                break
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def fake_backends(n: int, **config: Any) -> AsyncIterator[list[FakeServer]]:
    """``n`` fake replicas named b0, b1, ... answering 4 tokens unless ``config`` says otherwise."""
    config.setdefault("output_tokens", 4)
    fakes = [FakeServer(FakeConfig(name=f"b{i}", **config)) for i in range(n)]
    try:
        for f in fakes:
            await f.start()
        yield fakes
    finally:
        for f in fakes:
            await f.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        yield client
