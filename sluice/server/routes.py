"""The API process's own HTTP surface: the request id middleware, the error handlers and the routes
``GET /health``, ``GET /metrics``, ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions``.  The admin and LoRA routes live in ``admin.py``, ``profiling.py`` and
``lora_routes.py``; ``build_app`` (``app.py``) adds them all.

A completion route reads the body (bounded by ``--max-request-bytes``), validates it against its
pydantic schema, and hands it to ``OpenAIServing`` (``serving.py``): auth, priority, tokenize,
admission, submit.  It wraps what comes back in a JSON or an SSE response, and turns every failure
into an OpenAI error.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.errors import PayloadTooLargeError, ServiceUnavailableError, SluiceError
from sluice.http_errors import error_response, from_http_status, to_sluice_error
from sluice.server.generation import Generation
from sluice.server.lora_routes import models_entries
from sluice.server.protocol import ChatCompletionRequest, CompletionRequest
from sluice.server.serving import OpenAIServing, RequestContext
from sluice.server.sse import ClientGone, SSEResponse, wait_or_disconnect
from sluice.server.state import ServerState
from sluice.server.telemetry import CONTENT_TYPE_LATEST

__all__ = ["RequestIdMiddleware", "add_error_handlers", "add_openai_routes", "add_status_routes"]

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


def add_error_handlers(app: FastAPI) -> None:
    """Every error, the framework's included, leaves in the OpenAI shape (``sluice.http_errors``)."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_exc(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(from_http_status(exc.status_code, request.method, request.url.path, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(SluiceError(str(exc)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        return error_response(to_sluice_error(exc))


def add_status_routes(app: FastAPI, state: ServerState) -> None:
    """``/health`` (200 only when the engine is ready and the server is not draining) and ``/metrics``."""

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
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _serving(state: ServerState) -> OpenAIServing:
    if state.serving is None:
        raise ServiceUnavailableError("the model is still loading", retry_after=1.0)
    return state.serving


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``."""

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            state.keys.authenticate(request.headers.get("authorization"))
            serving = _serving(state)
        except SluiceError as e:
            return error_response(e)
        return _json_response({"object": "list", "data": [_model_entry(state, serving), *models_entries(state)]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _handle(state, request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _handle(state, request, ChatCompletionRequest)


def _model_entry(state: ServerState, serving: OpenAIServing) -> dict[str, Any]:
    info = serving.model_info
    return {
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
    }


async def _read_body(request: Request, limit: int) -> bytes:
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


async def _handle(state: ServerState, request: Request, schema: type[BaseModel]) -> Response | SSEResponse:
    """One completion request: body -> schema -> ``OpenAIServing`` -> JSON or SSE; any failure an OpenAI error."""
    tracing = state.tracing
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
        serving = _serving(state)
        span.set_attribute("sluice.model", serving.served_model_name)
        serving.check_available()
        serving.authenticate(ctx, request.headers.get("authorization"))
        body = await _read_body(request, state.settings.max_request_bytes)
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
            state.metrics.count_request(err.status_code, ctx.priority.label)
            span.end()
        return error_response(err)
