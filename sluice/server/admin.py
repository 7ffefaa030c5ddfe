"""Operator routes of ``sluice serve``: the KV cache and its tiers.

    GET  /admin/kv               blocks, bytes and hit rates per tier (memory, disk), from the
                                 engine's latest stats snapshot (no round trip to the engine)
    POST /admin/kv/checkpoint    write every cached prefix block the disk tier lacks, now, and
                                 wait until it is on disk (e.g. before a planned restart)

When API keys are configured, both need an admin key (``admin: true`` in the
keys file, or ``admin_keys``); with no keys configured they are open, like the
rest of the server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from sluice.auth import KeyInfo, KeyStore
from sluice.engine.protocol import EngineStats
from sluice.errors import AuthenticationError, SluiceError
from sluice.http_errors import error_response

if TYPE_CHECKING:
    from sluice.server.state import ServerState

__all__ = ["add_admin_routes", "kv_report", "authenticate_admin"]


def authenticate_admin(keys: KeyStore, headers: Mapping[str, str]) -> KeyInfo | None:
    """Open when no keys are configured (like the rest of the server); else an admin key."""
    if not keys.enabled:
        return None
    if not keys.has_admin:
        raise AuthenticationError("admin endpoints are disabled: API keys are configured but no admin key")
    key = keys.authenticate(headers.get("authorization"))
    if not key.is_admin:
        raise AuthenticationError("this endpoint needs an admin key")
    return key


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
            authenticate_admin(state.keys, request.headers)
        except SluiceError as e:
            return error_response(e)
        return _json(kv_report(state.client.stats))

    @app.post("/admin/kv/checkpoint")
    async def admin_kv_checkpoint(request: Request) -> Response:
        try:
            authenticate_admin(state.keys, request.headers)
            result = await state.client.control("kv_checkpoint")
        except SluiceError as e:
            return error_response(e)
        return _json(result)


def _json(doc: Any) -> Response:
    return Response(msgspec.json.encode(doc), media_type="application/json")
