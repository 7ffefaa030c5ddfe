"""A fake OpenAI-compatible replica for gateway tests and benchmarks (no model, no torch).

It answers ``/v1/completions`` and ``/v1/chat/completions`` (JSON or SSE),
``/health`` and ``/metrics`` (sluice names, values settable), and can misbehave
on demand through ``FakeBackend.behavior``:

    ok           answer normally
    hang         accept the request and never answer
    reset        drop the connection before answering
    broken_sse   stream the first chunk, then drop the connection
    stall_sse    stream the first chunk, then send nothing more
    status       answer ``status`` (e.g. 503) with an OpenAI error body
    slow         wait ``delay_s`` before the first byte

It counts requests it *completed* by ``x-request-id`` so tests can prove no
request was lost or duplicated.  Run one as a process::

    python -m sluice.gateway.fake_backend --port 8001 --chunks 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web

__all__ = ["Behavior", "FakeBackend"]


@dataclass
class Behavior:
    mode: str = "ok"  # ok | hang | reset | broken_sse | stall_sse | status | slow
    status: int = 503  # for mode == "status"
    delay_s: float = 0.0  # for mode == "slow"
    num_chunks: int = 4  # SSE content chunks per streamed answer
    chunk_delay_s: float = 0.0  # pause between streamed chunks
    health_status: int = 200
    metrics: dict[str, float] = field(default_factory=dict)  # series name -> value


class FakeBackend:
    def __init__(self, name: str = "fake", behavior: Behavior | None = None):
        self.name = name
        self.behavior = behavior or Behavior()
        self.num_received = 0  # every request that arrived
        self.completed: Counter[str] = Counter()  # x-request-id -> answers completed
        self.bodies: list[dict] = []  # request bodies as received
        self.headers: list[dict[str, str]] = []
        self.num_in_flight = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._hung: list[asyncio.Event] = []

    # ---- lifecycle ------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.make_app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        for ev in self._hung:
            ev.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- handlers -------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.behavior.health_status, text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = []
        values = {"sluice_num_requests_running": float(self.num_in_flight), **self.behavior.metrics}
        for name, value in values.items():
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.num_received += 1
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        rid = request.headers.get("x-request-id", "")
        b = self.behavior
        self.num_in_flight += 1
        try:
            if b.mode == "hang":
                ev = asyncio.Event()
                self._hung.append(ev)
                await ev.wait()
                raise ConnectionResetError
            if b.mode == "reset":
                assert request.transport is not None
                request.transport.abort()
                raise ConnectionResetError
            if b.mode == "status":
                return web.json_response(
                    {"error": {"message": f"fake {b.status}", "type": "fake", "param": None, "code": None}},
                    status=b.status,
                    headers={"Retry-After": "2"},
                )
            if b.mode == "slow":
                await asyncio.sleep(b.delay_s)
            chat = request.path.endswith("chat/completions")
            if body.get("stream"):
                resp = await self._stream(request, body, chat)
            else:
                text = "".join(f"tok{i} " for i in range(b.num_chunks))
                choice = {"index": 0, "finish_reason": "length"}
                choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
                resp = web.json_response(
                    {
                        "id": "cmpl-" + rid,
                        "object": "chat.completion" if chat else "text_completion",
                        "model": body.get("model"),
                        "backend": self.name,
                        "choices": [choice],
                        "usage": {"prompt_tokens": 1, "completion_tokens": b.num_chunks, "total_tokens": b.num_chunks + 1},
                    },
                    headers={"x-request-id": rid},
                )
            self.completed[rid] += 1
            return resp
        finally:
            self.num_in_flight -= 1

    async def _stream(self, request: web.Request, body: dict, chat: bool) -> web.StreamResponse:
        b = self.behavior
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-request-id": request.headers.get("x-request-id", "")})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        for i in range(b.num_chunks):
            delta = {"delta": {"content": f"tok{i} "}} if chat else {"text": f"tok{i} "}
            chunk = {"id": "x", "object": obj, "created": created, "model": body.get("model"), "backend": self.name, "choices": [{"index": 0, **delta, "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if b.mode == "broken_sse":
                assert request.transport is not None
                request.transport.abort()
                raise ConnectionResetError
            if b.mode == "stall_sse":
                ev = asyncio.Event()
                self._hung.append(ev)
                await ev.wait()
                raise ConnectionResetError
            if b.chunk_delay_s:
                await asyncio.sleep(b.chunk_delay_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--chunk-delay", type=float, default=0.0)
    args = p.parse_args()

    async def serve() -> None:
        fake = FakeBackend(behavior=Behavior(num_chunks=args.chunks, chunk_delay_s=args.chunk_delay))
        url = await fake.start(args.host, args.port)
        print(url, flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve())


if __name__ == "__main__":
    main()
