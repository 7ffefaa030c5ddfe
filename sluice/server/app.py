"""The API process's FastAPI app: ``build_app(settings, ...)`` builds everything.

It is the composition root: each part has its builder (``sluice.server.wiring``: keys, lanes with
their engine clients and admission, the serving object, the lifespan; ``sluice.server.routes``: the
request id middleware, error handlers and the OpenAI routes), and ``build_app`` only connects them.
No globals: everything hangs off one ``ServerState``.  Tests pass fakes through the same parameters
(``engine_factory``, ``codec_factory``, ``tracer_provider``, ``clock``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (``sluice.server.routes``); ``/admin/profile`` (``sluice.server.profiling``);
``/admin/kv`` and ``/admin/kv/checkpoint`` (``sluice.server.admin``); ``POST /v1/load_lora_adapter``,
``POST /v1/unload_lora_adapter`` (``sluice.server.lora_routes``).  A completion request that admission
refuses whatever its body says is answered before the app parses it (NOTE(early-shed) in
``sluice.server.early_shed``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from opentelemetry.sdk.trace import TracerProvider

from sluice.auth import RateLimiter
from sluice.engine.config import ModelInfo
from sluice.obs.placement import Placement
from sluice.obs.tracing import Tracing, build_tracer_provider
from sluice.server.admin import add_admin_routes
from sluice.server.codec import TextCodec, load_codec
from sluice.server.config import ServerSettings
from sluice.server.early_shed import EarlyShedMiddleware
from sluice.server.lora_routes import add_lora_routes
from sluice.server.profiling import add_profile_routes
from sluice.server.routes import (
    RequestIdMiddleware,
    add_error_handlers,
    add_openai_routes,
    add_status_routes,
)
from sluice.server.state import ServerState
from sluice.server.telemetry import ServerMetrics
from sluice.server.wiring import build_access, build_lanes, engine_dead, lifespan, shed_overdue

__all__ = ["build_app", "ServerState"]


def build_app(
    settings: ServerSettings,
    *,
    engine_factory: Callable[..., Any] | None = None,
    codec_factory: Callable[[str], TextCodec] | None = None,
    tracer_provider: TracerProvider | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_ready: Callable[[ModelInfo], None] | None = None,
    on_engine_dead: Callable[[], None] | None = None,
    placement: Placement | None = None,
) -> FastAPI:
    metrics = ServerMetrics(settings.model_name)
    tracing = Tracing(tracer_provider or build_tracer_provider(settings.otlp_endpoint))
    keys, admin = build_access(settings)
    # the engine cores call back into the state built below, once they run (in the lifespan)
    lanes = build_lanes(
        settings, metrics, tracing, engine_factory=engine_factory, placement=placement, clock=clock,
        on_dead=lambda: engine_dead(state), on_stats=lambda: shed_overdue(state),
    )  # fmt: skip
    state = ServerState(
        settings=settings,
        client=lanes.client,
        metrics=metrics,
        tracing=tracing,
        keys=keys,
        rate_limiter=RateLimiter(clock),
        admission=lanes.admission,
        codec_factory=codec_factory or load_codec,
        admin=admin,
        on_ready=on_ready,
        on_engine_dead=on_engine_dead,
        num_lanes=lanes.num_lanes,
    )
    app = FastAPI(title="sluice", lifespan=lifespan(state), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sluice = state
    app.add_middleware(EarlyShedMiddleware, state=state)  # NOTE(early-shed); inside the request id's
    app.add_middleware(RequestIdMiddleware)
    add_error_handlers(app)
    add_status_routes(app, state)  # /health, /metrics
    add_profile_routes(app, state)  # /admin/profile
    add_admin_routes(app, state)  # /admin/kv
    add_openai_routes(app, state)  # /v1/models, /v1/completions, /v1/chat/completions
    add_lora_routes(app, state)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    return app
