"""Run the API process: uvicorn (uvloop + httptools) around ``build_app``.

Signals:
- SIGTERM drains: ``/health`` and new requests get 503 with Retry-After,
  in-flight requests finish (up to ``--shutdown-timeout``), then exit 0.
- SIGINT (twice to force) stops at once, uvicorn's usual way.
If the engine core process dies, in-flight requests fail with 503 and the
process exits 1 so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from sluice.engine.config import ModelInfo
from sluice.errors import ConfigError
from sluice.obs.heap import freeze_startup_heap
from sluice.obs.logging import configure_logging
from sluice.obs.placement import Placement, apply_placement, plan_placement
from sluice.obs.topology import read_topology
from sluice.server.app import ServerState, build_app
from sluice.server.codec import TextCodec
from sluice.server.config import ServerSettings

__all__ = ["run_server", "place_processes"]


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM starts a drain."""

    def __init__(self, config: uvicorn.Config, on_sigterm: Callable[[], None]):
        super().__init__(config)
        self._on_sigterm = on_sigterm
        self.is_draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.should_exit:
            # NOTE(no-reraise): not recorded in _captured_signals, so uvicorn does
            # not re-raise SIGTERM after shutdown and the exit status stays 0.
            if not self.is_draining:
                self.is_draining = True
                self._on_sigterm()
            return
        super().handle_exit(sig, frame)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def place_processes(settings: ServerSettings) -> Placement | None:
    """``--cpu-affinity``: plan where the engine core goes and move this (the API) process."""
    if not settings.cpu_affinity:
        return None
    placement = plan_placement(settings.cpu_affinity, read_topology(), settings.engine.device)
    if placement.api_cpus:
        apply_placement(placement.api_cpus)
    return placement


def _check_pyroscope(settings: ServerSettings) -> None:
    import importlib.util

    if settings.pyroscope_server and importlib.util.find_spec("pyroscope") is None:
        raise ConfigError("--pyroscope-server needs the pyroscope-io package: pip install 'sluice-llm[pyroscope]'",
                          setting="pyroscope_server")  # fmt: skip


def run_server(
    settings: ServerSettings,
    *,
    engine_factory: Callable[..., Any] | None = None,
    codec_factory: Callable[[str], TextCodec] | None = None,
) -> None:
    t0 = time.monotonic()
    configure_logging(settings.log_level)
    _check_pyroscope(settings)
    placement = place_processes(settings)
    if placement is not None:
        print(f"sluice serve: {placement.describe()}", flush=True)
    if settings.pyroscope_server:
        from sluice.server.engine_setup import start_pyroscope

        start_pyroscope(settings.pyroscope_server, "api")
    sock = _bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    exit_code = 0
    server: _DrainingServer | None = None
    loop_box: dict[str, asyncio.AbstractEventLoop] = {}

    def on_ready(info: ModelInfo) -> None:
        freeze_startup_heap("api")  # NOTE(gc-freeze)
        name = settings.served_model_name or info.name
        print(
            f"sluice serve: model {name} ({info.path}), dtype {info.dtype} on {info.device}, "
            f"{info.num_blocks} KV blocks x {info.block_size} tokens"
            + (f" in each of {lanes} engine cores" if (lanes := app.state.sluice.num_lanes) > 1 else "")
            + f", max_model_len {info.max_model_len}, "
            f"attention {info.attention_backend}, weights {info.quantization}"
            + (f", kernels {info.kernel_path}" if info.kernel_path else ""),
            flush=True,
        )
        print(f"sluice serve: ready in {time.monotonic() - t0:.1f} s at {url}  (OpenAI base URL {url}/v1)", flush=True)

    def on_engine_dead() -> None:
        nonlocal exit_code
        exit_code = 1
        state: ServerState = app.state.sluice
        if state.startup_error:
            print(f"sluice: error: {state.startup_error}", file=sys.stderr, flush=True)
        else:
            print("sluice: error: the engine core process died; exiting", file=sys.stderr, flush=True)
        if server is not None:
            server.should_exit = True

    app = build_app(
        settings,
        engine_factory=engine_factory,
        codec_factory=codec_factory,
        on_ready=on_ready,
        on_engine_dead=on_engine_dead,
        placement=placement,
    )
    state: ServerState = app.state.sluice

    async def drain() -> None:
        print(f"sluice serve: SIGTERM: draining {state.num_inflight} requests "
              f"(up to {settings.shutdown_timeout:g} s)", file=sys.stderr, flush=True)
        await state.drain(settings.shutdown_timeout)
        assert server is not None
        server.should_exit = True

    tasks: set[asyncio.Task[None]] = set()

    def on_sigterm() -> None:
        loop = loop_box.get("loop") or asyncio.get_event_loop()
        def _spawn() -> None:
            t = loop.create_task(drain())
            tasks.add(t)  # the lifespan outlives it; kept referenced until done
            t.add_done_callback(tasks.discard)
        loop.call_soon_threadsafe(_spawn)

    config = uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level="warning" if settings.log_level == "info" else settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=30,
        backlog=2048,
    )
    server = _DrainingServer(config, on_sigterm)

    async def main() -> None:
        loop_box["loop"] = asyncio.get_running_loop()
        await server.serve(sockets=[sock])

    try:
        import uvloop

        uvloop.run(main())
    except KeyboardInterrupt:
        pass
    sys.exit(exit_code)
