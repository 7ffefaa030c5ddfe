"""Operator routes of ``sluice serve``: the KV cache and its tiers.

    GET  /admin/kv               blocks, bytes and hit rates per tier (memory, disk), from the
                                 engine's latest stats snapshot (no round trip to the engine)
    POST /admin/kv/checkpoint    write every cached prefix block the disk tier lacks, now, and
                                 wait until it is on disk (e.g. before a planned restart)

Like every admin endpoint (``/admin/*``, the LoRA load and unload routes)
they are closed unless an operator opens them (NOTE(admin-access) in
``sluice.auth``): an admin key (``--admin-key``, ``admin_keys`` or ``admin: true``
in the keys file), or ``--allow-admin-without-key`` behind the operator's own
proxy; with neither, they answer to loopback clients of a server bound to
loopback alone and without keys, and 403 to everyone else.

``doctor_report`` is the server's part of ``sluice doctor``: whether the
``sluice serve`` configured by this environment (``SLUICE_*``, ``SLUICE_CONFIG``)
would listen beyond loopback without keys, and what its model is (architecture, sizes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from sluice.auth import KeyInfo, is_loopback_host
from sluice.engine.protocol import EngineStats
from sluice.errors import SluiceError
from sluice.http_errors import error_response

if TYPE_CHECKING:
    from sluice.server.state import ServerState

__all__ = ["add_admin_routes", "kv_report", "authenticate_admin", "doctor_report"]


def authenticate_admin(state: ServerState, request: Request) -> KeyInfo:
    """The caller's key if it may use an admin endpoint; else a 401 / 403 ``SluiceError``."""
    return state.admin.check(request.headers, request.client.host if request.client else None)


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def kv_report(s: EngineStats) -> dict[str, Any]:
    """``GET /admin/kv``: one entry per tier; hit rates are shares of all prompt tokens looked up."""
    queries = s.prefix_cache_queries
    bytes_per_block = s.kv_cache_bytes // s.num_total_blocks if s.num_total_blocks else 0
    tiers: list[dict[str, Any]] = [{
        "name": "memory",
        "kv_cache_dtype": s.kv_cache_dtype,
        "num_blocks": s.num_total_blocks,
        "num_cached_blocks": s.num_cached_blocks,
        "num_bytes": s.kv_cache_bytes,
        "cached_bytes": s.num_cached_blocks * bytes_per_block,
        "usage": s.kv_cache_usage,
        "hit_tokens": s.prefix_cache_hits,
        "hit_rate": _rate(s.prefix_cache_hits, queries),
    }]
    for t in s.kv_tiers:
        tiers.append({
            "name": t.name,
            "enabled": t.is_enabled,
            "writable": t.is_writable,
            "num_blocks": t.num_blocks,
            "num_bytes": t.num_bytes,
            "capacity_bytes": t.capacity_bytes,
            "hit_blocks": t.hit_blocks,
            "hit_tokens": t.hit_tokens,
            "hit_rate": _rate(t.hit_tokens, queries),
            "loads": {"requests": t.num_request_loads, "seconds": t.load_seconds, "blocks": t.num_loaded_blocks,
                      "block_reads": t.num_block_reads, "bytes": t.load_bytes, "failures": t.num_load_failures},
            "stores": {"blocks": t.num_stored_blocks, "bytes": t.store_bytes, "seconds": t.store_seconds,
                       "dropped_blocks": t.num_dropped_blocks},
            "evicted_blocks": t.num_evicted_blocks,
            "corrupt": t.num_corrupt,
        })
    hits = s.prefix_cache_hits + sum(t.hit_tokens for t in s.kv_tiers)
    return {"prompt_tokens_looked_up": queries, "hit_rate": _rate(hits, queries), "tiers": tiers}


def add_admin_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/admin/kv")
    async def admin_kv(request: Request) -> Response:
        try:
            authenticate_admin(state, request)
        except SluiceError as e:
            return error_response(e)
        return _json(kv_report(state.client.stats))

    @app.post("/admin/kv/checkpoint")
    async def admin_kv_checkpoint(request: Request) -> Response:
        try:
            authenticate_admin(state, request)
            result = await state.client.control("kv_checkpoint")
        except SluiceError as e:
            return error_response(e)
        return _json(result)


def _json(doc: Any) -> Response:
    return Response(msgspec.json.encode(doc), media_type="application/json")


def model_report(spec: str) -> dict[str, Any]:
    """``model`` for ``sluice doctor``: the configured model's architecture, parameters, active parameters
    per token (MoE) and weight file bytes, read from its config or GGUF header without loading it
    (``/v1/models`` shows the served bytes once loaded)."""
    from sluice.models.formats import describe
    from sluice.models.source import resolve_model

    try:
        return {"name": spec, **describe(resolve_model(spec))}
    except Exception as e:  # noqa: BLE001 -- a missing or bad model is `sluice serve`'s to report; doctor goes on
        return {"name": spec, "error": f"{type(e).__name__}: {e}"}


def doctor_report(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``serve`` for ``sluice doctor``: the bind address and keys of the ``sluice serve`` this
    environment configures (``SLUICE_HOST``, ``SLUICE_API_KEY``, ..., ``SLUICE_CONFIG``)."""
    from sluice.server.config import load_settings

    try:
        s = load_settings(environ=os.environ if environ is None else environ)
    except Exception as e:  # noqa: BLE001 -- a bad setting is `sluice serve`'s to report; doctor goes on
        return {"serve": {"error": f"{type(e).__name__}: {e}"}}
    return {"model": model_report(s.engine.model), "serve": {
        "host": s.host,
        "is_loopback": is_loopback_host(s.host),
        "has_api_keys": bool(s.api_key or s.keys_file),
        "has_admin_key": bool(s.admin_key),
        "allow_admin_without_key": s.allow_admin_without_key,
        "enable_runtime_lora": s.enable_runtime_lora,
    }}  # fmt: skip
