"""LoRA adapter routes of ``sluice serve``, compatible with vLLM's::

    POST /v1/load_lora_adapter     {"lora_name": "sql", "lora_path": "/adapters/sql"}
                                   200 once the adapter is loaded and registered;
                                   400 naming the problem (bad path, another base model,
                                   rank above --max-lora-rank, name taken); nothing is kept
    POST /v1/unload_lora_adapter   {"lora_name": "sql"}
                                   200; 404 for an unknown name.  New requests for it get 404,
                                   requests already in the engine finish.

When API keys are configured both need an admin key (``admin: true`` in the
keys file or ``admin_keys``); with no keys configured they are open, like the
rest of the server.  Both reach the engine core as ``EngineControl`` commands
(``lora_load`` is answered once the adapter is loaded).  The load runs in the
engine core's loader thread: other requests keep running while it loads.  Its
span (``lora_load``, built from the engine's ``LoRALoadRecord``) is a child of
this route's span.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from opentelemetry.trace import Status, StatusCode
from starlette.responses import Response

from sluice.errors import InvalidRequestError, ServiceUnavailableError
from sluice.http_errors import error_response, to_sluice_error
from sluice.server.admin import authenticate_admin

if TYPE_CHECKING:
    from sluice.server.state import ServerState

__all__ = ["add_lora_routes", "models_entries"]


class _LoadBody(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: str
    lora_path: str = ""


def _body(raw: bytes) -> _LoadBody:
    try:
        body = msgspec.json.decode(raw, type=_LoadBody)
    except msgspec.ValidationError as e:
        raise InvalidRequestError(f"invalid request body: {e}", param="lora_name") from None
    except msgspec.DecodeError:
        raise InvalidRequestError("request body is not valid JSON", code="invalid_json") from None
    if not body.lora_name or body.lora_name != body.lora_name.strip() or " " in body.lora_name:
        raise InvalidRequestError(f"invalid lora_name {body.lora_name!r}", param="lora_name")
    return body


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    tracing = state.tracing

    async def _run(request: Request, op: str) -> Response:
        span = tracing.start_request_span(
            f"POST {request.url.path}", tracing.extract(request.headers),
            {"http.request.method": "POST", "url.path": request.url.path},
        )  # fmt: skip
        status = 200
        try:
            authenticate_admin(state.keys, request.headers)
            serving = state.serving
            if serving is None:
                raise ServiceUnavailableError("the model is still loading", retry_after=1.0)
            body = _body(await request.body())
            name = body.lora_name
            span.set_attribute("sluice.lora.adapter", name)
            if op == "load":
                if not body.lora_path:
                    raise InvalidRequestError("lora_path is required", param="lora_path")
                if name in serving.model_names:
                    raise InvalidRequestError(f"lora_name {name!r} is the base model's name", param="lora_name")
                t0 = time.monotonic()
                result = await state.client.control("lora_load", name=name, path=body.lora_path,
                                                    traceparent=tracing.traceparent(span))  # fmt: skip
                serving.lora_adapters[name] = body.lora_path
                span.set_attribute("sluice.lora.load_seconds", time.monotonic() - t0)
                text = f"Success: LoRA adapter '{name}' added successfully."
            else:
                result = await state.client.control("lora_unload", name=name)
                serving.lora_adapters.pop(name, None)
                text = f"Success: LoRA adapter '{name}' removed successfully."
            return Response(text, media_type="text/plain", headers=_result_headers(result))
        except Exception as e:  # noqa: BLE001 -- every failure becomes an OpenAI error
            err = to_sluice_error(e)
            status = err.status_code
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            return error_response(err)
        finally:
            span.set_attribute("http.response.status_code", status)
            span.end()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await _run(request, "load")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await _run(request, "unload")


def _result_headers(result: dict[str, Any]) -> dict[str, str]:
    seconds = result.get("load_seconds")
    return {"x-sluice-lora-load-seconds": f"{seconds:.6f}"} if isinstance(seconds, (int, float)) else {}


def models_entries(state: ServerState) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the adapters: each names its base model as ``parent``."""
    serving = state.serving
    if serving is None:
        return []
    return [{"id": name, "object": "model", "created": state.started_at, "owned_by": "sluice",
             "root": path, "parent": serving.served_model_name}
            for name, path in sorted(serving.lora_adapters.items())]  # fmt: skip
