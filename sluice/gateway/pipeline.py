"""The request path of the gateway, one step per method::

    handle()
      authenticate         API key -> KeyInfo, rate limit, priority capped by tier
      parse_request        model (a LoRA adapter: its replicas' model), stream flag, prompt text, token estimate
      degrade              graded degradation: shed (429), cap max_tokens, or use the fallback version
      pick_version         traffic shares between a model's versions (canary rollouts)
      choose_replica       policy over routable, untried replicas (for an adapter: those that have it)
      forward              one attempt; retried elsewhere only before the first byte,
                           within the retry budget
      record_outcome       breaker, health, metrics, TTFT, canary windows (every attempt),
                           then every ``outcome_hooks`` callback

Streams pass through chunk by chunk (``ProxyStream``); a client disconnect
closes the upstream connection so the replica aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from opentelemetry import propagate, trace
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sluice.auth import KeyInfo, KeyStore, RateLimiter
from sluice.errors import (
    InvalidRequestError,
    OverloadedError,
    ServiceUnavailableError,
    SluiceError,
)
from sluice.gateway.adapters import model_of_adapter, prefer_adapter
from sluice.gateway.config import GatewayConfig
from sluice.gateway.degradation import DegradationPolicy, LevelChange, Plan, make_degradation
from sluice.gateway.metrics import GatewayMetrics
from sluice.gateway.policies import RouteRequest, RoutingPolicy, make_policy, spread_p0
from sluice.gateway.pool import ReplicaPool, Version
from sluice.gateway.replica import Replica
from sluice.gateway.retry import RetryBudget
from sluice.gateway.rollout import RolloutEvent, RolloutManager
from sluice.gateway.upstream import AttemptError, Upstream, UpstreamClient
from sluice.http_errors import error_response
from sluice.types import Priority, parse_priority

__all__ = ["Outcome", "Gateway", "ProxyStream"]

_DEFAULT_MAX_TOKENS = 256  # token estimate when the request gives none


@dataclass(frozen=True)
class Outcome:
    """What happened to one client request (handed to ``outcome_hooks``)."""

    model: str
    version: str | None
    replica: str | None  # url of the replica that answered (or failed last)
    status: int  # HTTP status sent to the client
    ok: bool  # the replica served it (2xx/4xx, stream completed)
    ttfb_s: float | None  # request arrival -> first upstream byte
    latency_s: float  # arrival -> last byte
    num_attempts: int
    error_kind: str | None  # connect / timeout / status / stream / no_replica / client_gone


@dataclass(frozen=True)
class _Parsed:
    raw: bytes
    body: dict[str, Any]
    model: str
    stream: bool
    route: RouteRequest
    max_tokens: int  # the client's max_tokens, or the gateway's default estimate
    priority: Priority = Priority.P1  # after the key's tier cap
    adapter: str | None = None  # the LoRA adapter the client's model names (``model`` is then its base)


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise InvalidRequestError("'messages' must be a non-empty list", param="messages")
        parts: list[str] = []
        for m in msgs:
            if not isinstance(m, dict):
                raise InvalidRequestError("each message must be an object", param="messages")
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '')}\x00{content or ''}\x00")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        return ",".join(str(t) for t in prompt)  # token ids
    raise InvalidRequestError("'prompt' must be a string or a list", param="prompt")


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        client: UpstreamClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        keys: KeyStore | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ):
        self.config = config
        # NOTE(tracing): the global provider is a no-op until configured; tests
        # pass their own provider instead of touching global state.
        provider = tracer_provider or trace.get_tracer_provider()
        self.tracer = provider.get_tracer("sluice.gateway")
        # NOTE(tracing-off): with no SDK configured a span is a no-op that costs
        # ~6% of the gateway's CPU per request; then trace headers pass through as-is.
        self.is_tracing = not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
        self.clock = clock
        rng = random.Random(config.seed)
        self.pool = ReplicaPool(config, clock=clock, rng=rng)
        self.policy: RoutingPolicy = make_policy(config.policy, config, rng=rng, clock=clock)
        self.retry_budget = RetryBudget(config.retry, clock=clock)
        self.metrics = GatewayMetrics(self.pool, clock=clock)
        self.keys = keys if keys is not None else KeyStore.build(config.api_keys, config.keys_file)
        self.limiter = RateLimiter(clock=clock)
        self.client = client or UpstreamClient(config.timeouts)
        self.outcome_hooks: list[Callable[[Outcome], None]] = []
        self.degradation: DegradationPolicy = make_degradation(
            config.degradation, clock=clock, on_change=self._level_changed, rng=rng
        )
        self.rollout = RolloutManager(config.rollout, self.pool, clock=clock, on_event=self._rollout_event)
        self.ops_metrics = self.metrics.watch_operations(self.degradation)

    # ---- the pipeline -----------------------------------------------------------------

    async def handle(self, path: str, raw: bytes, headers: Mapping[str, str]) -> Response | ProxyStream:
        t0 = self.clock()
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        try:
            key = self.authenticate(headers)
            parsed = self.parse_request(raw)
            self.limiter.check(key, parsed.route.num_tokens)
            priority = key.cap(parse_priority(headers.get("x-priority") or parsed.body.get("priority")))
        except ValueError as e:  # parse_priority
            if isinstance(e, SluiceError):
                return error_response(e, request_id)
            return error_response(InvalidRequestError(str(e), param="priority"), request_id)
        except SluiceError as e:
            return error_response(e, request_id)
        parsed = replace(parsed, priority=priority)
        upstream_headers = {
            "content-type": "application/json",
            "x-request-id": request_id,
            "x-priority": priority.label,
        }
        if not self.is_tracing:
            for name in ("traceparent", "tracestate"):
                if name in headers:
                    upstream_headers[name] = headers[name]
            return await self._route(path, parsed, upstream_headers, request_id, t0)
        ctx = propagate.extract(headers)
        with self.tracer.start_as_current_span("gateway.route", context=ctx) as span:
            span.set_attribute("sluice.model", parsed.model)
            if parsed.adapter is not None:
                span.set_attribute("sluice.lora.adapter", parsed.adapter)
            propagate.inject(upstream_headers)
            return await self._route(path, parsed, upstream_headers, request_id, t0)

    def authenticate(self, headers: Mapping[str, str]) -> KeyInfo:
        return self.keys.authenticate(headers.get("authorization"))

    def parse_request(self, raw: bytes) -> _Parsed:
        try:
            body = json.loads(raw)
        except ValueError:
            raise InvalidRequestError("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequestError("'model' is required", param="model")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise InvalidRequestError("'stream' must be true or false", param="stream")
        text = _prompt_text(body)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or _DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidRequestError("'max_tokens' must be a positive integer", param="max_tokens")
        adapter = None
        if model not in self.pool.versions_by_model:
            base = model_of_adapter(self.pool.replicas(), model)  # NOTE(lora-routing) in gateway/adapters.py
            if base is not None:
                adapter, model = model, base
        self.pool.versions(model)  # 404 for unknown models, before any routing
        # NOTE(token-estimate): ~4 characters per token; the gateway never tokenizes.
        route = RouteRequest(model, text, len(text) // 4 + max_tokens)
        return _Parsed(raw, body, model, stream, route, max_tokens, adapter=adapter)

    def degrade(self, parsed: _Parsed) -> Plan:
        """The degradation plan for one request; feeds the policy fresh load figures first."""
        model, d = parsed.model, self.degradation
        if d.is_observation_due(model):
            cfg = self.config.degradation
            ttft = self.pool.p95_ttft(model, window_s=cfg.ttft_window_s, min_samples=cfg.ttft_min_samples)
            d.observe(model, self.pool.model_load(model), ttft)
        fallback = self.config.models[model].fallback
        has_fallback = fallback is not None and bool(self.pool.version(model, fallback).routable())
        return d.plan(model, parsed.priority, parsed.max_tokens, has_fallback)

    def pick_version(self, model: str, plan: Plan | None = None) -> Version:
        if plan is not None and plan.use_fallback:
            fallback = self.config.models[model].fallback
            if fallback is not None:
                v = self.pool.version(model, fallback)
                if v.routable():
                    return v
        version = self.pool.pick_version(model)
        if version is None:
            raise ServiceUnavailableError(
                f"no healthy replica for model {model!r}",
                retry_after=self.pool.retry_after(model),
                code="no_healthy_replica",
            )
        return version

    def choose_replica(self, version: Version, parsed: _Parsed, tried: set[str]) -> Replica | None:
        candidates = [r for r in version.routable() if r.url not in tried]
        if not candidates:  # the version is exhausted: any other version of the model
            candidates = [
                r
                for v in self.pool.versions(parsed.model)
                for r in v.routable()
                if r.url not in tried
            ]
        if not candidates:
            return None
        reason = None
        if parsed.adapter is not None:
            candidates, reason = prefer_adapter(candidates, parsed.adapter)
        if parsed.priority == Priority.P0:
            candidates, spread = spread_p0(candidates)  # NOTE(p0-spread)
            reason = reason or spread
        decision = self.policy.choose(candidates, parsed.route)
        reason = reason or decision.reason
        self.metrics.decisions.labels(parsed.model, self.policy.name.value, reason, decision.replica.url).inc()
        return decision.replica

    async def _route(
        self, path: str, parsed: _Parsed, headers: dict[str, str], request_id: str, t0: float
    ) -> Response | ProxyStream:
        model = parsed.model
        plan = self.degrade(parsed)
        if plan.shed:
            self.metrics.degraded.labels(model, "shed", parsed.priority.label).inc()
            err = OverloadedError(
                f"model {model!r} is overloaded: {parsed.priority.label} requests are being shed, retry later",
                retry_after=plan.retry_after_s,
                code="degraded_shed",
            )
            self._record(Outcome(model, None, None, err.status_code, False, None, self.clock() - t0, 0, "shed"))
            return error_response(err, request_id)
        self.degradation.add_request(model, parsed.priority)
        try:
            result = await self._route_planned(path, parsed, plan, headers, request_id, t0)
        except BaseException:
            self.degradation.finish_request(model, parsed.priority)
            raise
        if not isinstance(result, ProxyStream):
            self.degradation.finish_request(model, parsed.priority)
        return result

    async def _route_planned(
        self, path: str, parsed: _Parsed, plan: Plan, headers: dict[str, str], request_id: str, t0: float
    ) -> Response | ProxyStream:
        model = parsed.model
        try:
            version = self.pick_version(model, plan)
        except SluiceError as e:
            self._record(Outcome(model, None, None, e.status_code, False, None, self.clock() - t0, 0, "no_replica"))
            return error_response(e, request_id)
        degraded = self._degraded_header(parsed, plan, version)
        body = self._upstream_body(raw_body=parsed, version=version, max_tokens=plan.max_tokens)
        self.retry_budget.record_request()
        tried: set[str] = set()
        last: AttemptError | None = None
        failed: Replica | None = None  # the last replica that failed this request
        tokens = parsed.route.num_tokens
        for attempt in range(1, self.config.retry.max_attempts + 1):
            replica = self.choose_replica(version, parsed, tried)
            if replica is None:
                break
            tried.add(replica.url)
            replica.add_request(tokens)
            t_sent = self.clock()
            if attempt == 1:
                self.metrics.added_latency.labels(model).observe(t_sent - t0)
            try:
                with replica.awaiting_answer(parsed.priority):  # NOTE(p0-spread) in policies.py
                    up = await self.client.open(replica.url + path, body, headers, stream=parsed.stream)
            except AttemptError as e:
                last, failed = e, replica
                replica.finish_request(tokens)
                self._attempt_failed(replica, e, self.clock() - t_sent)
                # NOTE(no-429-retry): a 429 is the replica's admission saying "not within
                # target, come back after Retry-After"; retrying it elsewhere at once turns a
                # shed wave into a second one.  It goes back to the client as it is.
                if e.status == 429:
                    break
                if attempt < self.config.retry.max_attempts and self.retry_budget.try_spend():
                    self.metrics.retries.labels(model, replica.url).inc()
                    continue
                break
            ttfb = self.clock() - t0
            self.pool.record_ttft(model, ttfb)
            out_headers = {
                "x-request-id": request_id,
                "x-sluice-replica": replica.url,
                "content-type": up.headers.get("content-type", "application/json"),
            }
            if degraded:
                out_headers["x-sluice-degraded"] = degraded
            if up.response is None:  # complete body in hand
                replica.finish_request(tokens)
                ok = up.status < 500
                replica.breaker.record(ok, self.clock() - t_sent)
                self.rollout.record_attempt(model, replica.version, status=up.status, ok=ok, ttfb_s=ttfb)
                self._record(Outcome(model, replica.version, replica.url, up.status, ok, ttfb, self.clock() - t0, attempt, None))
                return Response(up.first_chunk, status_code=up.status, headers=out_headers)
            return ProxyStream(self, up, replica, parsed, out_headers, t0, t_sent, ttfb, attempt)
        return self._give_up(parsed, version, failed, last, request_id, t0, len(tried))

    def _degraded_header(self, parsed: _Parsed, plan: Plan, version: Version) -> str:
        """``x-sluice-degraded`` value ("" when the request is served as asked); counts it."""
        parts = []
        if plan.max_tokens is not None:
            parts.append(f"max_tokens={plan.max_tokens}")
            self.metrics.degraded.labels(parsed.model, "cap", parsed.priority.label).inc()
        if plan.use_fallback and version.name == self.config.models[parsed.model].fallback:
            parts.append(f"fallback={version.name}")
            self.metrics.degraded.labels(parsed.model, "fallback", parsed.priority.label).inc()
        return ", ".join(parts)

    def _upstream_body(self, raw_body: _Parsed, version: Version, max_tokens: int | None = None) -> bytes:
        body = raw_body.body
        # an adapter request keeps its model: the replica serves the adapter under that name
        rename = version.served_model and version.served_model != raw_body.model and raw_body.adapter is None
        if not rename and "priority" not in body and max_tokens is None:
            return raw_body.raw  # NOTE(no-reencode): forward the client's bytes untouched
        body = {**body, "model": version.served_model} if rename else dict(body)
        body.pop("priority", None)  # sent as the x-priority header, capped by the key's tier
        if max_tokens is not None:  # degradation level 1: the replica ends it with finish_reason "length"
            body["max_tokens"] = max_tokens
            if "max_completion_tokens" in body:
                body["max_completion_tokens"] = max_tokens
        return json.dumps(body).encode()

    def _attempt_failed(self, replica: Replica, e: AttemptError, elapsed: float) -> None:
        self.metrics.errors.labels(replica.model, replica.url, e.kind).inc()
        # NOTE(429): a full replica is alive and answering; it must not trip its
        # breaker, but a half-open probe slot it held must be given back.
        replica.breaker.record(not e.is_replica_failure, elapsed)
        self.rollout.record_attempt(replica.model, replica.version, status=e.status, ok=not e.is_replica_failure, ttfb_s=None)
        if e.kind == "connect":
            replica.health.record_connect_failure(e.message)

    def _give_up(
        self,
        parsed: _Parsed,
        version: Version,
        replica: Replica | None,
        last: AttemptError | None,
        request_id: str,
        t0: float,
        num_attempts: int,
    ) -> Response:
        model = parsed.model
        url = replica.url if replica else None
        if last is not None and last.kind == "status" and last.status is not None:
            # The replica's own answer (its 503/429 body and Retry-After) is the most useful one.
            self._record(Outcome(model, version.name, url, last.status, False, None, self.clock() - t0, num_attempts, "status"))
            headers = {"x-request-id": request_id, "content-type": last.headers.get("content-type", "application/json")}
            if "retry-after" in last.headers:
                headers["retry-after"] = last.headers["retry-after"]
            if url:
                headers["x-sluice-replica"] = url
            return Response(last.body, status_code=last.status, headers=headers)
        if last is None:
            err = ServiceUnavailableError(
                f"no healthy replica for model {model!r}",
                retry_after=self.pool.retry_after(model),
                code="no_healthy_replica",
            )
        else:
            err = ServiceUnavailableError(
                f"replica failed ({last.kind}): {last.message}",
                retry_after=1.0,
                code=f"upstream_{last.kind}",
            )
        self._record(Outcome(model, version.name, url, 503, False, None, self.clock() - t0, num_attempts, last.kind if last else "no_replica"))
        return error_response(err, request_id)

    def _level_changed(self, change: LevelChange) -> None:
        direction = "up" if change.new > change.old else "down"
        self.metrics.degradation_changes.labels(change.model, direction).inc()

    def _rollout_event(self, event: RolloutEvent) -> None:
        if event.action == "rollback":
            self.metrics.rollbacks.labels(event.model, event.version).inc()

    def degradation_view(self) -> dict[str, object]:
        """JSON view for ``GET /admin/degradation``."""
        d = self.degradation
        out: dict[str, object] = {}
        for model in self.pool.models:
            pressure = getattr(d, "pressure", None)
            changes = getattr(d, "changes", None)
            p = pressure(model) if pressure is not None else None
            out[model] = {
                "level": int(d.level(model)),
                "level_name": d.level(model).name.lower(),
                "score": None if p is None else round(p.score, 4),
                "pressure": None if p is None else {"queue": round(p.queue, 4), "tokens": round(p.tokens, 4), "ttft": round(p.ttft, 4),
                                                    "predicted": None if p.predicted is None else [round(r, 4) for r in p.predicted]},
                "fallback": self.config.models[model].fallback,
                "changes": [
                    {"at": c.at, "from": int(c.old), "to": int(c.new), "score": round(c.score, 4), "reason": c.reason}
                    for c in (changes(model) if changes is not None else [])
                ],
            }
        return {"policy": d.name.value, "models": out}

    def _record(self, outcome: Outcome) -> None:
        self.metrics.requests.labels(outcome.model, outcome.replica or "none", str(outcome.status)).inc()
        for hook in self.outcome_hooks:
            hook(outcome)

    def stream_finished(
        self,
        stream: ProxyStream,
        error: AttemptError | None,
        client_gone: bool,
    ) -> None:
        replica = stream.replica
        replica.finish_request(stream.parsed.route.num_tokens)
        self.degradation.finish_request(stream.parsed.model, stream.parsed.priority)
        self.rollout.record_attempt(replica.model, replica.version, status=200, ok=error is None, ttfb_s=stream.ttfb_s)
        now = self.clock()
        if error is not None:
            self.metrics.errors.labels(replica.model, replica.url, error.kind).inc()
        # NOTE(breaker-latency): the breaker's latency is time to first byte;
        # a stream's length says nothing about the replica's health.
        replica.breaker.record(error is None, stream.ttfb_s - (stream.t_sent - stream.t0))
        kind = "stream" if error else "client_gone" if client_gone else None
        self._record(
            Outcome(
                stream.parsed.model,
                replica.version,
                replica.url,
                200,
                error is None,
                stream.ttfb_s,
                now - stream.t0,
                stream.num_attempts,
                kind,
            )
        )


class ProxyStream:
    """ASGI response that streams an ``Upstream`` to the client as it arrives.

    A background watcher waits for the client's ``http.disconnect`` and
    cancels the copy loop, so a gone client stops the replica's work at once.
    """

    def __init__(
        self,
        gateway: Gateway,
        upstream: Upstream,
        replica: Replica,
        parsed: _Parsed,
        headers: dict[str, str],
        t0: float,
        t_sent: float,
        ttfb_s: float,
        num_attempts: int,
    ):
        self.gateway = gateway
        self.upstream = upstream
        self.replica = replica
        self.parsed = parsed
        self.headers = headers
        self.t0 = t0
        self.t_sent = t_sent
        self.ttfb_s = ttfb_s
        self.num_attempts = num_attempts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        main = asyncio.current_task()
        client_gone = False
        finished = False  # the last byte is on its way: a disconnect now is normal

        async def watch() -> None:
            nonlocal client_gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:
                client_gone = True
                if main is not None:
                    main.cancel()

        watcher = asyncio.ensure_future(watch())
        error: AttemptError | None = None
        try:
            raw_headers = [(k.encode(), v.encode()) for k, v in self.headers.items()]
            await send({"type": "http.response.start", "status": self.upstream.status, "headers": raw_headers})
            await send({"type": "http.response.body", "body": self.upstream.first_chunk, "more_body": True})
            try:
                async for chunk in self.upstream.rest():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except AttemptError as e:
                error = e
                event = {"error": {"message": f"replica failed mid-stream: {e.message}", "type": "upstream_error", "param": None, "code": "upstream_stream"}}
                await send({"type": "http.response.body", "body": b"data: " + json.dumps(event).encode() + b"\n\n", "more_body": True})
            finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not client_gone:
                raise
            if main is not None:
                main.uncancel()
        finally:
            watcher.cancel()
            self.upstream.close()
            self.gateway.stream_finished(self, error, client_gone)
