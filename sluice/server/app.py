"""The API process's FastAPI app: ``build_app(settings, ...)`` builds everything.

No globals: the engine client, codec, metrics registry, tracer provider,
admission queue and rate limiter all hang off one ``ServerState`` created
here; the lifespan starts the engine core process and the background task
that waits for it.  Tests pass fakes through the same parameters
(``engine_factory``, ``codec_factory``, ``tracer_provider``, ``clock``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health`` (200 only when the engine is ready and the
server is not draining), ``GET /metrics``; ``/admin/profile`` (``sluice.server.profiling``);
``/admin/kv`` and ``/admin/kv/checkpoint`` (``sluice.server.admin``);
LoRA adapters: ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``
(``sluice.server.lora_routes``).  A completion request that admission refuses
whatever its body says is answered before the app parses it (NOTE(early-shed)
in ``sluice.server.early_shed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from opentelemetry.sdk.trace import TracerProvider
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.auth import AdminAccess, KeyStore, RateLimiter
from sluice.engine.config import ModelInfo
from sluice.engine.protocol import EngineStats
from sluice.errors import PayloadTooLargeError, ServiceUnavailableError, SluiceError
from sluice.http_errors import error_response, from_http_status, to_sluice_error
from sluice.obs.placement import Placement
from sluice.obs.tracing import Tracing, build_tracer_provider
from sluice.server.admin import add_admin_routes
from sluice.server.admission import AdmissionController
from sluice.server.codec import TextCodec, load_codec
from sluice.server.config import ServerSettings
from sluice.server.early_shed import EarlyShedMiddleware
from sluice.server.engine_client import EngineClient
from sluice.server.engine_proc import default_engine_factory
from sluice.server.engine_setup import EngineProcessSetup
from sluice.server.generation import Generation
from sluice.server.lanes import (
    AnyAdmission,
    AnyClient,
    LanedAdmission,
    LanedClient,
    data_parallel_lanes,
    lane_configs,
    lane_lending,
)
from sluice.server.lora_routes import add_lora_routes, models_entries
from sluice.server.profiling import add_profile_routes
from sluice.server.protocol import ChatCompletionRequest, CompletionRequest
from sluice.server.serving import OpenAIServing, RequestContext
from sluice.server.sse import ClientGone, SSEResponse, wait_or_disconnect
from sluice.server.state import ServerState
from sluice.server.telemetry import CONTENT_TYPE_LATEST, ServerMetrics, record_lora_loads

__all__ = ["build_app", "ServerState"]

log = logging.getLogger("sluice.server")
_json = msgspec.json.Encoder()
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def _json_response(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(doc), status_code=status, headers=headers, media_type="application/json")


class RequestIdMiddleware:
    """Echo (or create) ``x-request-id`` on every response; add ``traceparent``."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                text = v.decode("latin-1")
                rid = text if _REQUEST_ID.match(text) else None
                break
        meta: dict[str, Any] = {"request_id": rid or uuid.uuid4().hex, "traceparent": None}
        scope.setdefault("state", {})["sluice"] = meta

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", meta["request_id"].encode()))
                if meta["traceparent"]:
                    headers.append((b"traceparent", meta["traceparent"].encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


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
    keys = KeyStore.build(settings.api_key, settings.keys_file, admin_keys=settings.admin_key)
    admin = AdminAccess(keys, host=settings.host, allow_without_key=settings.allow_admin_without_key)
    log.info("%s", admin.describe())  # NOTE(admin-access) in sluice.auth
    state_box: dict[str, ServerState] = {}

    def _dead() -> None:
        st = state_box["state"]
        if st.on_engine_dead is not None:
            st.on_engine_dead()

    # NOTE(data-parallel) in sluice.server.lanes: one engine core, or N lanes behind this API process
    engine_cpus = placement.engine_cpus if placement is not None else None
    n, why = data_parallel_lanes(settings.data_parallel_size, settings.engine, engine_cpus, engine_factory is not None)
    log.info("%d engine core%s (%s)", n, "s" if n > 1 else "", why)  # NOTE(dp-auto) in sluice.server.lanes
    admissions = [
        AdmissionController(
            -(-settings.max_queued_requests // n),  # the server's bounds, shared out over the lanes
            -(-settings.max_queued_tokens // n),
            slo=settings.slo_targets,
            policy=settings.engine.scheduling_policy,
            max_num_batched_tokens=settings.engine.max_num_batched_tokens,
            max_num_seqs=settings.engine.max_num_seqs,
            max_queue_wait=settings.max_queue_wait,
            clock=clock,
        )
        for _ in range(n)
    ]
    assigned: dict[str, int] = {}  # request uid -> lane, with n > 1

    def _on_stats(lane: int, stats: EngineStats) -> None:
        metrics.observe_stats(stats)  # with lanes the gauges read their merged stats at scrape time (below)
        admissions[lane].observe_stats(stats)
        st = state_box.get("state")
        if st is not None and st.serving is not None:
            st.serving.shed_overdue()

    clients = []
    lendings = lane_lending(settings.engine, n, engine_cpus)  # NOTE(lane-lend)
    for lane, (engine_config, cpus) in enumerate(lane_configs(settings.engine, n, engine_cpus)):
        factory = engine_factory or default_engine_factory
        if placement is not None or settings.pyroscope_server:
            # the engine core process pins itself (and starts its profiler agent) before building the engine
            factory = EngineProcessSetup(
                factory,
                cpus=cpus or (),
                numa_node=placement.engine_node if placement else None,
                pyroscope_server=settings.pyroscope_server,
            )
        clients.append(EngineClient(
            engine_config,
            engine_factory=factory,
            on_dead=_dead,
            on_stats=functools.partial(_on_stats, lane),
            on_lora_loads=lambda records: record_lora_loads(tracing, metrics, records),
            lending=lendings[lane],
        ))  # fmt: skip
    client: AnyClient = clients[0]
    admission: AnyAdmission = admissions[0]
    if n > 1:
        laned = client = LanedClient(clients, assigned)
        admission = LanedAdmission(admissions, assigned)
        metrics.engine.source = lambda: laned.stats
    metrics.signal.source = admission.signal
    state = ServerState(
        settings=settings,
        client=client,
        metrics=metrics,
        tracing=tracing,
        keys=keys,
        rate_limiter=RateLimiter(clock),
        admission=admission,
        codec_factory=codec_factory or load_codec,
        admin=admin,
        on_ready=on_ready,
        on_engine_dead=on_engine_dead,
        num_lanes=n,
    )
    state_box["state"] = state

    async def _start() -> None:
        codec_task = asyncio.create_task(asyncio.to_thread(state.codec_factory, settings.engine.model))
        try:
            info = await client.wait_ready()
            codec = await codec_task
        except SluiceError as e:
            state.startup_error = e.message
            log.error("start-up failed: %s", e.message)
            if state.on_engine_dead is not None:
                state.on_engine_dead()
            return
        except Exception as e:  # noqa: BLE001 -- tokenizer load failures, reported once
            state.startup_error = f"{type(e).__name__}: {e}"
            log.error("start-up failed: %s", state.startup_error)
            if state.on_engine_dead is not None:
                state.on_engine_dead()
            return
        finally:
            if not codec_task.done():
                codec_task.cancel()
        state.model_info = info
        name = settings.served_model_name or info.name
        state.serving = OpenAIServing(
            client=client,
            codec=codec,
            model_info=info,
            served_model_name=name,
            model_aliases={settings.engine.model, info.name},
            keys=keys,
            rate_limiter=state.rate_limiter,
            admission=state.admission,
            metrics=metrics,
            tracing=tracing,
            is_draining=lambda: state.is_draining,
        )
        state.serving.lora_adapters.update(settings.engine.lora_module_paths)
        metrics.info.labels(model=name).set(1)
        if state.on_ready is not None:
            state.on_ready(info)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        starter = asyncio.create_task(_start(), name="sluice-startup")
        try:
            yield
        finally:
            starter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starter
            await client.close()
            tracing.shutdown()

    app = FastAPI(title="sluice", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sluice = state
    app.add_middleware(EarlyShedMiddleware, state=state)  # NOTE(early-shed); inside the request id's
    app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(StarletteHTTPException)
    async def _http_exc(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(from_http_status(exc.status_code, request.method, request.url.path, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(SluiceError(str(exc)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        return error_response(to_sluice_error(exc))

    @app.get("/health")
    async def health() -> Response:
        if state.is_draining:
            return error_response(ServiceUnavailableError("draining", retry_after=1.0))
        if state.client.is_dead or state.startup_error:
            return error_response(ServiceUnavailableError(state.startup_error or "engine core is not running"))
        if not state.is_ready:
            return error_response(ServiceUnavailableError("engine core is starting", retry_after=1.0))
        return _json_response({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    add_profile_routes(app, state)  # /admin/profile
    add_admin_routes(app, state)  # /admin/kv

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            keys.authenticate(request.headers.get("authorization"))
            serving = _serving()
        except SluiceError as e:
            return error_response(e)
        info = serving.model_info
        return _json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": serving.served_model_name,
                        "object": "model",
                        "created": state.started_at,
                        "owned_by": "sluice",
                        "root": info.path,
                        "max_model_len": info.max_model_len,
                        "architecture": info.architecture or None,
                        "num_parameters": info.num_parameters or None,
                        "num_active_parameters": info.num_active_parameters or None,  # MoE: top-k experts
                        "weight_bytes": info.weight_bytes or None,  # as served (quantized)
                        "quantization": info.quantization,
                    },
                    *models_entries(state),
                ],
            }
        )

    def _serving() -> OpenAIServing:
        if state.serving is None:
            raise ServiceUnavailableError("the model is still loading", retry_after=1.0)
        return state.serving

    async def _read_body(request: Request) -> bytes:
        limit = settings.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(limit)
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _handle(request: Request, schema: type[BaseModel]) -> Response | SSEResponse:
        meta = request.scope["state"]["sluice"]
        span = tracing.start_request_span(
            f"POST {request.url.path}",
            tracing.extract(request.headers),
            {"http.request.method": "POST", "url.path": request.url.path, "sluice.request_id": meta["request_id"]},
        )
        meta["traceparent"] = tracing.traceparent(span)
        ctx = RequestContext(request_id=meta["request_id"], arrival=time.monotonic(), span=span)
        serving: OpenAIServing | None = state.serving
        gen: Generation | None = None
        try:
            serving = _serving()
            span.set_attribute("sluice.model", serving.served_model_name)
            serving.check_available()
            serving.authenticate(ctx, request.headers.get("authorization"))
            body = await _read_body(request)
            req = schema.model_validate_json(body)
            assert isinstance(req, (CompletionRequest, ChatCompletionRequest))
            lora_name = serving.check_model(req.model)
            serving.resolve_priority(ctx, request.headers.get("x-priority"), req.priority)
            prep = await serving.prepare(ctx, req)
            if lora_name is not None:
                prep.lora_name = ctx.extra["lora_name"] = lora_name
                span.set_attribute("sluice.lora.adapter", lora_name)
            gen = serving.submit(ctx, prep)
            if req.stream:
                first, r, it = await wait_or_disconnect(request, serving.first_events(ctx, prep, gen))
                body_iter = serving.stream_body(ctx, prep, gen, first, r, it)
                s, g = serving, gen
                return SSEResponse(body_iter, {}, on_close=lambda: s.finish(ctx, g))
            doc = await wait_or_disconnect(request, serving.collect(ctx, prep, gen))
            serving.finish(ctx, gen)
            return _json_response(doc)
        except ClientGone:
            ctx.status = 499
            if serving is not None:
                serving.finish(ctx, gen)
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 -- every failure becomes an OpenAI error
            err = to_sluice_error(e)
            ctx.status = err.status_code
            ctx.extra["error"] = err.message
            if serving is not None:
                serving.finish(ctx, gen)
            else:
                metrics.count_request(err.status_code, ctx.priority.label)
                span.end()
            return error_response(err)

    add_lora_routes(app, state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _handle(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _handle(request, ChatCompletionRequest)

    return app
