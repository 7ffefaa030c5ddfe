"""The gateway's HTTP app: the OpenAI routes of ``sluice serve``, plus admin and metrics.

    POST /v1/completions, /v1/chat/completions   routed to a replica (pipeline.py)
    GET  /v1/models                              the configured models, and the LoRA adapters replicas serve (with parent)
    GET  /health                                 200 while some model has a routable replica
    GET  /metrics                                Prometheus text (metrics.py)
    GET  /admin/replicas, /admin/models          state and load figures (admin key, NOTE(admin-access)
                                                 in sluice.auth: closed unless an operator opens them)
    GET  /admin/degradation                      levels, load scores, level changes (admin key)
    GET  /admin/rollout, POST /admin/rollout     version shares, canary windows, rollbacks; set shares
    GET  /admin/autoscale                        autoscaled models: replicas, decisions (admin key)

``build_app(config, *, client=None, clock=None, keys=None, tracer_provider=None)``
builds everything;
the lifespan owns the scraper and autoscaler tasks and the upstream HTTP session.  Run it with
uvicorn (``sluice gateway``) or in-process in tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from opentelemetry.trace import TracerProvider
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from sluice.auth import AdminAccess, KeyStore
from sluice.errors import InvalidRequestError, PayloadTooLargeError, SluiceError
from sluice.gateway.adapters import adapters_by_model
from sluice.gateway.autoscale import Autoscaler
from sluice.gateway.config import GatewayConfig
from sluice.gateway.launchers import Launcher, make_launcher
from sluice.gateway.pipeline import Gateway, ProxyStream
from sluice.gateway.scraper import Scraper
from sluice.gateway.upstream import UpstreamClient
from sluice.http_errors import error_response, from_http_status

__all__ = ["build_app", "GatewayApp"]

log = logging.getLogger("sluice.gateway")

PROXY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class GatewayApp:
    """ASGI entry point: the two proxy routes go straight to the pipeline, the
    rest (and lifespan) to a Starlette app.

    NOTE(fast-path): Starlette's middleware stack and Request object cost about
    a fifth of the gateway's CPU per proxied request; the hot path needs only
    the path, the headers and the body, so it reads them from the ASGI scope.
    """

    def __init__(self, gateway: Gateway, fallback: Starlette):
        self.gateway = gateway
        self.fallback = fallback
        self.state = fallback.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in PROXY_PATHS or scope["method"] != "POST":
            await self.fallback(scope, receive, send)
            return
        chunks = []
        size, limit = 0, self.gateway.config.max_request_bytes
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                err = PayloadTooLargeError(limit, setting="max_request_bytes")
                rid = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
                await error_response(err, rid)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            response = await self.gateway.handle(scope["path"], b"".join(chunks), headers)
        except Exception:
            log.exception("gateway internal error on %s", scope["path"])
            response = _internal_error()
        await response(scope, receive, send)


def _internal_error() -> Response:
    return error_response(SluiceError("internal gateway error"))


def build_app(
    config: GatewayConfig,
    *,
    client: UpstreamClient | None = None,
    clock: Callable[[], float] = time.monotonic,
    keys: KeyStore | None = None,
    run_scraper: bool = True,
    tracer_provider: TracerProvider | None = None,
    launchers: dict[str, Launcher] | None = None,
) -> GatewayApp:
    gateway = Gateway(config, client=client, clock=clock, keys=keys, tracer_provider=tracer_provider)
    for key in config.admin_keys:
        gateway.keys.add_admin_key(key)
    admin = AdminAccess(gateway.keys, host=config.host, allow_without_key=config.allow_admin_without_key,
                        name="sluice gateway")  # fmt: skip
    log.info("%s", admin.describe())
    scraper = Scraper(config, gateway.pool, lambda: gateway.client.session, clock=clock)
    autoscaler = _build_autoscaler(config, gateway, launchers, clock)

    async def proxy(request: Request) -> Response | ProxyStream:  # only reached via fallback
        raw = await request.body()
        return await gateway.handle(request.url.path, raw, request.headers)

    def _rid(request: Request) -> str:
        return request.headers.get("x-request-id") or ""

    def _admin(request: Request) -> None:
        admin.check(request.headers, request.client.host if request.client else None)

    async def models(request: Request) -> Response:
        try:
            gateway.authenticate(request.headers)
        except SluiceError as e:
            return error_response(e, _rid(request))
        data = [{"id": m, "object": "model", "owned_by": "sluice"} for m in gateway.pool.models]
        data += [{"id": a, "object": "model", "owned_by": "sluice", "parent": m}
                 for a, m in sorted(adapters_by_model(gateway.pool.replicas()).items())]  # fmt: skip
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        routable = {m: gateway.pool.model_load(m).num_routable for m in gateway.pool.models}
        ok = any(routable.values())
        return JSONResponse(
            {"status": "ok" if ok else "no_healthy_replica", "routable_replicas": routable},
            status_code=200 if ok else 503,
        )

    async def metrics(request: Request) -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")

    async def admin_replicas(request: Request) -> Response:
        try:
            _admin(request)
        except SluiceError as e:
            return error_response(e, _rid(request))
        now = clock()
        return JSONResponse({"replicas": [r.describe(now) for r in gateway.pool.replicas()]})

    async def admin_models(request: Request) -> Response:
        try:
            _admin(request)
        except SluiceError as e:
            return error_response(e, _rid(request))
        out = {}
        for m in gateway.pool.models:
            out[m] = {
                "load": gateway.pool.model_load(m).__dict__,
                "versions": {v.name: v.share for v in gateway.pool.versions(m)},
            }
        return JSONResponse({"models": out, "policy": gateway.policy.name.value})

    async def admin_degradation(request: Request) -> Response:
        try:
            _admin(request)
        except SluiceError as e:
            return error_response(e, _rid(request))
        return JSONResponse(gateway.degradation_view())

    async def admin_rollout(request: Request) -> Response:
        try:
            _admin(request)
            if request.method == "POST":
                try:
                    body = json.loads(await request.body())
                except ValueError:
                    raise InvalidRequestError("request body is not valid JSON") from None
                if not isinstance(body, dict) or not isinstance(body.get("model"), str):
                    raise InvalidRequestError("expected {\"model\": <name>, \"shares\": {<version>: <share>}}", param="model")
                shares = body.get("shares")
                if not isinstance(shares, dict):
                    raise InvalidRequestError("'shares' must be an object {<version>: <share>}", param="shares")
                gateway.rollout.set_shares(body["model"], shares)
        except SluiceError as e:
            return error_response(e, _rid(request))
        return JSONResponse(gateway.rollout.describe())

    async def admin_autoscale(request: Request) -> Response:
        try:
            _admin(request)
        except SluiceError as e:
            return error_response(e, _rid(request))
        return JSONResponse({"models": autoscaler.describe() if autoscaler is not None else {}})

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        err = from_http_status(exc.status_code, request.method, request.url.path, str(exc.detail))
        return error_response(err, _rid(request))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("gateway internal error on %s", request.url.path)
        return _internal_error()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(scraper.run())] if run_scraper else []
        if autoscaler is not None:
            tasks.append(asyncio.create_task(autoscaler.run()))  # its finally stops what it launched
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await gateway.client.close()

    app = Starlette(
        routes=[
            Route("/v1/completions", proxy, methods=["POST"]),
            Route("/v1/chat/completions", proxy, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/admin/replicas", admin_replicas, methods=["GET"]),
            Route("/admin/models", admin_models, methods=["GET"]),
            Route("/admin/degradation", admin_degradation, methods=["GET"]),
            Route("/admin/rollout", admin_rollout, methods=["GET", "POST"]),
            Route("/admin/autoscale", admin_autoscale, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    app.state.scraper = scraper
    app.state.autoscaler = autoscaler
    return GatewayApp(gateway, app)


def _build_autoscaler(
    config: GatewayConfig,
    gateway: Gateway,
    launchers: dict[str, Launcher] | None,
    clock: Callable[[], float],
) -> Autoscaler | None:
    configs = {m: mc.autoscale for m, mc in config.models.items() if mc.autoscale is not None}
    if not configs:
        return None
    launchers = dict(launchers or {})
    for model, ac in configs.items():
        if model not in launchers:
            launchers[model] = make_launcher(ac.launcher)

    def decided(model: str, old: int, new: int, reason: str) -> None:
        gateway.metrics.autoscale_decisions.labels(model, "up" if new > old else "down").inc()

    autoscaler = Autoscaler(
        gateway.pool, configs, launchers, load_config=config.degradation, clock=clock, on_decision=decided
    )
    gateway.ops_metrics.autoscaler = autoscaler
    return autoscaler
