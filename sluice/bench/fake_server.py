"""The one fake OpenAI-compatible server, for the bench's, the gateway's and the
server's tests and for client benchmarks (torch-free, model-free).

It streams ``tok0 tok1 ...`` back at a set pace, so a load generator's
measurements can be checked against known settings, and it misbehaves on
demand, so a gateway's failure handling can be.  Run it as::

    python -m sluice.bench.fake_server --port 8001 --ttft-ms 50 --tokens-per-s 100 \\
        --error-rate 0.01 --midstream-failure-rate 0.01 --knee-concurrency 32 --knee-ttft-ms 20

(``--port 0`` picks a free port; the first stdout line is ``listening on URL``.)
In-process (tests)::

    with FakeServerThread(FakeConfig(ttft_ms=50)) as url: ...   # own thread and event loop
    server = FakeServer(cfg); url = await server.start(); ...; await server.stop()
    server.config.fault = "hang"                                  # misbehave from now on

Behaviour (``FakeConfig``):

- ``POST /v1/chat/completions`` and ``/v1/completions``, streaming (SSE, with a
  ``usage`` chunk when ``stream_options.include_usage``) or not; ``GET /v1/models``,
  ``GET /health`` (``health_status``), ``GET /metrics`` (sluice names:
  ``sluice_num_requests_running`` plus the ``metrics`` given).
- TTFT: the first token is written ``ttft_ms`` after the request arrives, plus
  ``knee_ttft_ms`` for every request in flight beyond ``knee_concurrency``
  (a server whose latency rises past a known load).
- then one token every ``1 / tokens_per_s`` seconds (0: all at once, fastest);
  ``output_tokens`` overrides the request's ``max_tokens``.
- errors are exact, not random: request n (counting from 0) fails with HTTP 500
  when ``floor((n + 1) * error_rate) > floor(n * error_rate)``, so N requests
  give exactly ``floor(N * error_rate)`` failures.  Mid-stream failures count the
  same way over the requests that did not fail: after half the tokens the
  stream is cut (``midstream_mode``: ``reset`` aborts the connection,
  ``truncate`` ends the body without ``[DONE]``, ``garbage`` sends a broken
  JSON line).
- faults on demand (``fault``, may change while it runs)::

      ok           answer normally
      hang         accept the request and never answer
      reset        drop the connection before answering
      broken_sse   stream the first chunk, then drop the connection
      stall_sse    stream the first chunk, then send nothing more
      status       answer ``status`` (e.g. 503) with an OpenAI error body and Retry-After: 2

- every response carries ``x-request-id``; ``prompt_tokens`` is the number of
  whitespace-separated words of the prompt.  ``completed`` counts the answers
  finished per ``x-request-id``, so tests can prove none was lost or doubled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from sluice.bench.aio import run_event_loop

__all__ = ["FakeConfig", "FakeServer", "FakeServerThread", "FAULTS", "main"]

FAULTS = ("ok", "hang", "reset", "broken_sse", "stall_sse", "status")


@dataclass
class FakeConfig:
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0  # 0: write every token at once
    output_tokens: int | None = None  # None: the request's max_tokens
    error_rate: float = 0.0  # fraction of requests answered with HTTP 500
    midstream_failure_rate: float = 0.0  # fraction of streams cut halfway
    midstream_mode: str = "reset"  # reset | truncate | garbage
    knee_concurrency: int = 0  # 0: no knee
    knee_ttft_ms: float = 0.0  # extra TTFT per in-flight request beyond the knee
    model: str = "fake-model"
    name: str = "fake"  # "backend" in every answer: which replica served it
    fault: str = "ok"  # one of FAULTS; tests flip it while the server runs
    status: int = 503  # the answer of fault == "status"
    health_status: int = 200  # GET /health
    metrics: dict[str, float] = field(default_factory=dict)  # extra /metrics gauges (name -> value)

    def __post_init__(self) -> None:
        for name in ("error_rate", "midstream_failure_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")
        if self.midstream_mode not in ("reset", "truncate", "garbage"):
            raise ValueError("midstream_mode must be reset, truncate or garbage")
        if self.ttft_ms < 0 or self.tokens_per_s < 0 or self.knee_ttft_ms < 0:
            raise ValueError("times and rates must be >= 0")
        if self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(FAULTS)}")


def _is_hit(n: int, rate: float) -> bool:
    return math.floor((n + 1) * rate) > math.floor(n * rate)


def _chunk(api: str, text: str) -> bytes:
    if api == "chat":
        d: dict[str, Any] = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}  # fmt: skip
    else:
        d = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}  # fmt: skip
    return b"data: " + msgspec.json.encode(d) + b"\n\n"


class FakeServer:
    """The aiohttp application plus its runner; one per test or process."""

    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.url = ""
        self.num_requests = 0  # requests received (decides HTTP errors)
        self.num_streams = 0  # requests that were not HTTP errors (decides mid-stream cuts)
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.completed: Counter[str] = Counter()  # x-request-id -> answers finished
        self.bodies: deque[dict[str, Any]] = deque(maxlen=256)  # the latest request bodies
        self.headers: deque[dict[str, str]] = deque(maxlen=256)  # ... and their headers (lower-case)
        self._chunks: dict[str, list[bytes]] = {"chat": [], "completions": []}  # token i's SSE event
        self._hung: list[asyncio.Event] = []
        self._runner: web.AppRunner | None = None
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        bound = self._runner.addresses[0][1]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        for ev in self._hung:
            ev.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.config.model, "object": "model"}]})  # fmt: skip

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.config.health_status, text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        values = {"sluice_num_requests_running": float(self.num_in_flight), **self.config.metrics}
        lines, typed = [], set()
        for name, v in values.items():  # a name may carry labels: 'sluice_x{priority="p0"}'
            family = name.split("{", 1)[0]
            if family not in typed:
                typed.add(family)
                lines.append(f"# TYPE {family} gauge")
            lines.append(f"{name} {v}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def _hang(self) -> None:
        ev = asyncio.Event()
        self._hung.append(ev)
        await ev.wait()

    async def _serve(self, request: web.Request, api: str) -> web.StreamResponse:
        n = self.num_requests
        self.num_requests += 1
        rid = request.headers.get("x-request-id", f"fake-{n}")
        try:
            body = msgspec.json.decode(await request.read())
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            max_tokens = int(body.get("max_tokens") or 16)
            if api == "chat":
                prompt = " ".join(str(m.get("content", "")) for m in body["messages"])
            else:
                prompt = str(body["prompt"])
        except (msgspec.DecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            return _error(400, f"invalid request: {e}", "invalid_request_error", rid)
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            return await self._answer(request, api, rid, n, body, prompt, max_tokens)
        finally:
            self.num_in_flight -= 1

    async def _answer(
        self, request: web.Request, api: str, rid: str, n: int, body: dict[str, Any], prompt: str, max_tokens: int
    ) -> web.StreamResponse:
        cfg = self.config
        if cfg.fault in ("hang", "reset"):
            if cfg.fault == "hang":
                await self._hang()
            elif request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError
        if cfg.fault == "status":
            return _error(cfg.status, f"fake {cfg.status}", "fake", rid, {"Retry-After": "2"})
        if _is_hit(n, cfg.error_rate):
            return _error(500, "fake server: injected error", "internal_error", rid)
        m = self.num_streams
        self.num_streams += 1
        num_out = cfg.output_tokens if cfg.output_tokens is not None else max_tokens
        num_in = len(prompt.split())
        extra = max(0, self.num_in_flight - cfg.knee_concurrency) * cfg.knee_ttft_ms if cfg.knee_concurrency else 0.0  # fmt: skip
        if not body.get("stream"):
            await asyncio.sleep((cfg.ttft_ms + extra) / 1000 + (num_out / cfg.tokens_per_s if cfg.tokens_per_s else 0))  # fmt: skip
            doc = _full_response(api, num_in, num_out, model=body.get("model"), backend=cfg.name)
            self.completed[rid] += 1
            return web.json_response(doc, headers={"x-request-id": rid})
        cut_at = num_out // 2 if _is_hit(m, cfg.midstream_failure_rate) else None
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp, is_complete = await self._stream(request, api, rid, num_in, num_out, extra, cut_at, usage)
        if is_complete:
            self.completed[rid] += 1
        return resp

    def _tokens(self, api: str, start: int, end: int) -> bytes:
        chunks = self._chunks[api]
        while len(chunks) < end:  # NOTE(chunk-cache): each token's event is encoded once per server
            chunks.append(_chunk(api, f"tok{len(chunks)} "))
        return b"".join(chunks[start:end])

    async def _stream(
        self, request: web.Request, api: str, rid: str, num_in: int, num_out: int,
        extra_ms: float, cut_at: int | None, usage: bool,
    ) -> tuple[web.StreamResponse, bool]:  # fmt: skip
        """The SSE answer, and whether it was sent to the end."""
        cfg = self.config
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-request-id": rid})
        await resp.prepare(request)
        delay = (cfg.ttft_ms + extra_ms) / 1000
        if delay > 0:
            await asyncio.sleep(delay)
        end = num_out if cut_at is None else cut_at
        if cfg.fault in ("broken_sse", "stall_sse"):
            await resp.write(self._tokens(api, 0, 1))
            if cfg.fault == "stall_sse":
                await self._hang()
            elif request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError
        try:
            if cfg.tokens_per_s <= 0:
                await resp.write(self._tokens(api, 0, end))
            else:
                gap = 1.0 / cfg.tokens_per_s
                for i in range(end):
                    if i:
                        await asyncio.sleep(gap)
                    await resp.write(self._tokens(api, i, i + 1))
        except ConnectionResetError:  # the client went away (a load test stopping): not an error
            return resp, False
        if cut_at is not None:
            if cfg.midstream_mode == "reset":
                if request.transport is not None:
                    request.transport.abort()
                raise asyncio.CancelledError  # the connection is gone; aiohttp drops the handler
            if cfg.midstream_mode == "garbage":
                await resp.write(b"data: {not json\n\n")
            await resp.write_eof()
            return resp, False
        tail = b""
        if usage:
            u = {"object": "chunk", "choices": [], "usage": {"prompt_tokens": num_in, "completion_tokens": num_out, "total_tokens": num_in + num_out}}  # fmt: skip
            tail = b"data: " + msgspec.json.encode(u) + b"\n\n"
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp, True


def _error(status: int, message: str, kind: str, rid: str, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.json_response(body, status=status, headers={"x-request-id": rid, **(headers or {})})


def _full_response(api: str, num_in: int, num_out: int, *, model: Any = None, backend: str = "fake") -> dict[str, Any]:
    text = "".join(f"tok{i} " for i in range(num_out))
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if api == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    usage = {"prompt_tokens": num_in, "completion_tokens": num_out, "total_tokens": num_in + num_out}
    return {"object": "chat.completion" if api == "chat" else "text_completion", "model": model,
            "backend": backend, "choices": [choice], "usage": usage}  # fmt: skip


class FakeServerThread:
    """Run a ``FakeServer`` on its own event loop in a daemon thread (for sync tests).

    ``with FakeServerThread(cfg) as url`` ... the server stops on exit.
    ``.server`` gives the counters (``num_requests``, ``max_in_flight``).
    """

    def __init__(self, config: FakeConfig, host: str = "127.0.0.1") -> None:
        self.server = FakeServer(config)
        self._host = host
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fake-openai")
        self.url = ""

    def __enter__(self) -> str:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self.server.start(self._host), self._loop)
        self.url = fut.result(timeout=10)
        return self.url

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def _parse_args(argv: list[str] | None) -> tuple[FakeConfig, str, int]:
    p = argparse.ArgumentParser(prog="python -m sluice.bench.fake_server", description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--tokens-per-s", type=float, default=0.0)
    p.add_argument("--output-tokens", type=int, default=None)
    p.add_argument("--error-rate", type=float, default=0.0)
    p.add_argument("--midstream-failure-rate", type=float, default=0.0)
    p.add_argument("--midstream-mode", default="reset", choices=["reset", "truncate", "garbage"])
    p.add_argument("--knee-concurrency", type=int, default=0)
    p.add_argument("--knee-ttft-ms", type=float, default=0.0)
    p.add_argument("--model", default="fake-model")
    a = p.parse_args(argv)
    try:
        cfg = FakeConfig(
            ttft_ms=a.ttft_ms, tokens_per_s=a.tokens_per_s, output_tokens=a.output_tokens,
            error_rate=a.error_rate, midstream_failure_rate=a.midstream_failure_rate,
            midstream_mode=a.midstream_mode, knee_concurrency=a.knee_concurrency,
            knee_ttft_ms=a.knee_ttft_ms, model=a.model,
        )  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    return cfg, a.host, a.port


async def _serve_forever(cfg: FakeConfig, host: str, port: int) -> None:
    server = FakeServer(cfg)
    url = await server.start(host, port)
    print(f"listening on {url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    cfg, host, port = _parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        run_event_loop(_serve_forever(cfg, host, port))


if __name__ == "__main__":
    main()
