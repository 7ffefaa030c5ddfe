"""The parts of the API process that ``build_app`` (``app.py``) wires together, one builder each.

    build_access     the key store and who may call /admin/* (NOTE(admin-access) in sluice.auth)
    build_lanes      the engine cores behind this process (NOTE(data-parallel)), each with its
                     ``EngineClient``, and the one admission over them (``LanedAdmission``, 1..N lanes)
    build_serving    the ``OpenAIServing`` a request goes through, once the engine and tokenizer are ready
    lifespan         starts the engine cores, builds the serving object when they are ready, closes all

The metrics (``ServerMetrics``) and tracing (``Tracing``) need no builder of their own; the routes are
added by ``routes.py``, ``admin.py``, ``profiling.py`` and ``lora_routes.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from sluice.auth import AdminAccess, KeyStore
from sluice.engine.config import ModelInfo
from sluice.engine.protocol import EngineStats
from sluice.errors import SluiceError
from sluice.obs.placement import Placement
from sluice.obs.tracing import Tracing
from sluice.server.codec import TextCodec
from sluice.server.config import ServerSettings
from sluice.server.engine_client import EngineClient
from sluice.server.engine_proc import default_engine_factory
from sluice.server.engine_setup import EngineProcessSetup
from sluice.server.lanes import (
    AnyClient,
    LanedAdmission,
    LanedClient,
    build_admission,
    data_parallel_lanes,
    lane_configs,
    lane_lending,
)
from sluice.server.serving import OpenAIServing
from sluice.server.state import ServerState
from sluice.server.telemetry import ServerMetrics, record_lora_loads

__all__ = ["Lanes", "build_access", "build_lanes", "build_serving", "engine_dead", "lifespan", "shed_overdue", "start_serving"]

log = logging.getLogger("sluice.server")


def build_access(settings: ServerSettings) -> tuple[KeyStore, AdminAccess]:
    """The API keys (``--api-key``, ``--keys-file``, ``--admin-key``) and the admin routes' gate."""
    keys = KeyStore.build(settings.api_key, settings.keys_file, admin_keys=settings.admin_key)
    admin = AdminAccess(keys, host=settings.host, allow_without_key=settings.allow_admin_without_key)
    log.info("%s", admin.describe())  # NOTE(admin-access) in sluice.auth
    return keys, admin


@dataclass
class Lanes:
    """What ``build_lanes`` made: one engine core's client or the lanes' behind one interface, and the
    admission, one object for one lane or N."""

    client: AnyClient
    admission: LanedAdmission
    num_lanes: int  # engine core processes (NOTE(dp-auto) in sluice.server.lanes)


def build_lanes(
    settings: ServerSettings,
    metrics: ServerMetrics,
    tracing: Tracing,
    *,
    engine_factory: Callable[..., Any] | None,
    placement: Placement | None,
    clock: Callable[[], float],
    on_dead: Callable[[], None],
    on_stats: Callable[[], None],
) -> Lanes:
    """The engine cores (NOTE(data-parallel) in sluice.server.lanes), not started yet.

    Each lane's stats go to the metrics and to the admission (for that lane's predictions), then
    ``on_stats`` runs (the serving object sheds what is overdue); ``on_dead`` runs when an engine core dies."""
    engine_cpus = placement.engine_cpus if placement is not None else None
    n, why = data_parallel_lanes(settings.data_parallel_size, settings.engine, engine_cpus, engine_factory is not None)
    log.info("%d engine core%s (%s)", n, "s" if n > 1 else "", why)  # NOTE(dp-auto) in sluice.server.lanes
    assigned: dict[str, int] = {}  # request uid -> lane, written by LanedAdmission.admit
    admission = build_admission(settings, n, assigned, clock)  # one object for 1..N lanes (NOTE(data-parallel))

    def _on_stats(lane: int, stats: EngineStats) -> None:
        metrics.observe_stats(stats)
        admission.observe_stats(lane, stats)
        on_stats()

    lendings = lane_lending(settings.engine, n, engine_cpus)  # NOTE(lane-lend)
    clients = [
        EngineClient(
            engine_config,
            engine_factory=_engine_process(settings, engine_factory, placement, cpus),
            on_dead=on_dead,
            on_stats=functools.partial(_on_stats, lane),
            on_lora_loads=lambda records: record_lora_loads(tracing, metrics, records),
            lending=lendings[lane],
        )
        for lane, (engine_config, cpus) in enumerate(lane_configs(settings.engine, n, engine_cpus))
    ]
    metrics.signal.source = admission.signal
    if n == 1:
        return Lanes(clients[0], admission, 1)
    laned = LanedClient(clients, assigned)
    metrics.engine.source = lambda: laned.stats  # the gauges read the lanes' merged stats at scrape time
    return Lanes(laned, admission, n)


def _engine_process(
    settings: ServerSettings,
    engine_factory: Callable[..., Any] | None,
    placement: Placement | None,
    cpus: tuple[int, ...] | None,
) -> Callable[..., Any]:
    """What the engine core process calls to build its engine: with ``--cpu-affinity`` or a profiler
    agent, it pins itself (and starts the agent) first."""
    factory = engine_factory or default_engine_factory
    if placement is None and not settings.pyroscope_server:
        return factory
    return EngineProcessSetup(
        factory,
        cpus=cpus or (),
        numa_node=placement.engine_node if placement else None,
        pyroscope_server=settings.pyroscope_server,
    )


def build_serving(state: ServerState, info: ModelInfo, codec: TextCodec) -> OpenAIServing:
    """The serving object of a started engine (``info``: its ``ModelInfo``) and loaded tokenizer."""
    settings = state.settings
    serving = OpenAIServing(
        client=state.client,
        codec=codec,
        model_info=info,
        served_model_name=settings.served_model_name or info.name,
        model_aliases={settings.engine.model, info.name},
        keys=state.keys,
        rate_limiter=state.rate_limiter,
        admission=state.admission,
        metrics=state.metrics,
        tracing=state.tracing,
        is_draining=lambda: state.is_draining,
    )
    serving.lora_adapters.update(settings.engine.lora_module_paths)
    return serving


def engine_dead(state: ServerState) -> None:
    """An engine core died, or never started: tell whoever asked (the runner exits non-zero)."""
    if state.on_engine_dead is not None:
        state.on_engine_dead()


def shed_overdue(state: ServerState) -> None:
    """After each engine stats message: shed the queued requests that are overdue (once serving)."""
    if state.serving is not None:
        state.serving.shed_overdue()


async def start_serving(state: ServerState) -> None:
    """Wait for the engine cores while the tokenizer loads; then serve.  A failure is kept for ``/health``."""
    codec_task = asyncio.create_task(asyncio.to_thread(state.codec_factory, state.settings.engine.model))
    try:
        info = await state.client.wait_ready()
        codec = await codec_task
    except SluiceError as e:
        _startup_failed(state, e.message)
        return
    except Exception as e:  # noqa: BLE001 -- tokenizer load failures, reported once
        _startup_failed(state, f"{type(e).__name__}: {e}")
        return
    finally:
        if not codec_task.done():
            codec_task.cancel()
    state.model_info = info
    state.serving = build_serving(state, info, codec)
    state.metrics.info.labels(model=state.serving.served_model_name).set(1)
    if state.on_ready is not None:
        state.on_ready(info)


def _startup_failed(state: ServerState, error: str) -> None:
    state.startup_error = error
    log.error("start-up failed: %s", error)
    engine_dead(state)


def lifespan(state: ServerState) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: start the engine cores and ``start_serving`` in the background; on the way
    out stop it, close the engine cores and flush the traces."""

    @contextlib.asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        state.client.start()
        starter = asyncio.create_task(start_serving(state), name="sluice-startup")
        try:
            yield
        finally:
            starter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starter
            await state.client.close()
            state.tracing.shutdown()

    return run

