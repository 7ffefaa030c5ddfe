"""LoRA adapter routes of ``sluice serve``, compatible with vLLM's::

    POST /v1/load_lora_adapter     {"lora_name": "sql", "lora_path": "/adapters/sql"}
                                   200 once the adapter is loaded and registered;
                                   400 naming the problem (bad path, another base model,
                                   rank above --max-lora-rank, name taken); nothing is kept
    POST /v1/unload_lora_adapter   {"lora_name": "sql"}
                                   200; 404 for an unknown name.  New requests for it get 404,
                                   requests already in the engine finish.

Both are admin endpoints (NOTE(admin-access) in ``sluice.auth``) and exist only
with ``--enable-runtime-lora`` (404 without it; ``--lora-modules`` at start-up
needs neither).  A ``lora_path`` must lie inside a ``--lora-dir``
(NOTE(lora-roots)).  Both reach the engine core as ``EngineControl`` commands
(``lora_load`` is answered once the adapter is loaded).  The load runs in the
engine core's loader thread: other requests keep running while it loads.  Its
span (``lora_load``, built from the engine's ``LoRALoadRecord``) is a child of
this route's span.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from opentelemetry.trace import Status, StatusCode
from starlette.responses import Response

from sluice.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from sluice.http_errors import error_response, to_sluice_error
from sluice.server.admin import authenticate_admin

if TYPE_CHECKING:
    from sluice.server.state import ServerState

__all__ = ["add_lora_routes", "models_entries", "confine_lora_path"]

# The files an adapter directory holds (``sluice.models.lora``, which needs torch: not imported here).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


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


def _is_inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def confine_lora_path(lora_path: str, roots: Sequence[str]) -> str:
    """The real path of the adapter directory ``lora_path`` names, if it lies inside one of ``roots``.

    NOTE(lora-roots): the path is resolved as the engine would open it (``..``
    segments and every symlink, the adapter's files included) and must stay
    inside a root; outside, the 400 is the same whether the path exists or not,
    so the endpoint cannot probe the server's filesystem.  Inside, the error
    names the problem.  The engine gets the resolved path, so a symlink swapped
    after this check does not lead it out; ``LoRAManager`` checks file sizes
    before parsing.  Blocking (file system): call it off the event loop.
    """
    outside = InvalidRequestError(
        f"lora_path {lora_path!r} is not inside a directory this server loads adapters from (--lora-dir)",
        param="lora_path", code="lora_path_not_allowed")  # fmt: skip
    real = os.path.realpath(lora_path)
    root = next((r for r in (os.path.realpath(r) for r in roots) if _is_inside(real, r)), None)
    if root is None:
        raise outside
    if not os.path.isdir(real):
        raise InvalidRequestError(f"LoRA adapter path {lora_path!r} is not a directory", param="lora_path",
                                  code="invalid_lora_adapter")  # fmt: skip
    for name in ADAPTER_FILES:
        file = os.path.join(real, name)
        if os.path.lexists(file) and not _is_inside(os.path.realpath(file), root):
            raise outside
    if not os.path.isfile(os.path.join(real, ADAPTER_FILES[0])):
        raise InvalidRequestError(f"LoRA adapter path {lora_path!r} holds no adapter ({ADAPTER_FILES[0]})",
                                  param="lora_path", code="invalid_lora_adapter")  # fmt: skip
    return real


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    tracing = state.tracing

    async def _run(request: Request, op: str) -> Response:
        span = tracing.start_request_span(
            f"POST {request.url.path}", tracing.extract(request.headers),
            {"http.request.method": "POST", "url.path": request.url.path},
        )  # fmt: skip
        status = 200
        try:
            authenticate_admin(state, request)
            if not state.settings.enable_runtime_lora:
                raise NotFoundError("runtime LoRA loading is off on this server: start it with "
                                    "--enable-runtime-lora and --lora-dir DIR (or load adapters at start-up "
                                    "with --lora-modules)", code="runtime_lora_off")  # fmt: skip
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
                path = await asyncio.to_thread(confine_lora_path, body.lora_path, state.settings.lora_dir)
                t0 = time.monotonic()
                result = await state.client.control("lora_load", name=name, path=path,
                                                    traceparent=tracing.traceparent(span))  # fmt: skip
                serving.lora_adapters[name] = path
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
