"""Streaming OpenAI client for the bench: one request in, one ``RequestRecord`` out.

All requests of a run share one ``aiohttp.ClientSession`` (one connection
pool).  The response is parsed as it arrives (``SSEDecoder``) and never
buffered whole.  Whatever the server does wrong (non-200, broken SSE, a
stream without ``[DONE]``, a reset connection, a timeout) becomes
``record.error`` with a one-line reason; ``send`` never raises for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from sluice.bench.record import RequestRecord
from sluice.bench.sse import SSEDecoder
from sluice.bench.workload import Api, Constraint, RequestSpec, constraint_body

__all__ = ["OpenAIStreamClient", "StreamChunk", "build_body", "decode_chunk", "error_text"]


class _Function(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolCall(msgspec.Struct):
    function: _Function | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[_ToolCall] | None = None

    def tool_text(self) -> str | None:
        """A tool-call delta's name and arguments: output like content (a tools workload)."""
        fns = [t.function for t in self.tool_calls or [] if t.function is not None]
        return "".join((f.name or "") + (f.arguments or "") for f in fns) or None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None  # chat
    text: str | None = None  # completions

    def output_text(self) -> str | None:
        if self.delta is None:
            return self.text
        return self.delta.content or self.delta.reasoning_content or self.delta.tool_text()


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Error(msgspec.Struct):
    message: str = ""


class StreamChunk(msgspec.Struct):
    """One ``data:`` event of an OpenAI stream (chat or completions); unknown fields ignored."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: _Error | str | None = None

    def error_message(self) -> str | None:
        if self.error is None:
            return None
        msg = self.error if isinstance(self.error, str) else self.error.message
        return " ".join(msg.split())


decode_chunk = msgspec.json.Decoder(StreamChunk).decode  # raises msgspec.DecodeError
_encode = msgspec.json.Encoder().encode


def build_body(spec: RequestSpec, api: Api, model: str, ignore_eos: bool, extra: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "stream": True}
    if api is Api.CHAT:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    body["stream_options"] = {"include_usage": True}
    if spec.constraint is not Constraint.NONE:
        body.update(constraint_body(spec.constraint))  # and no ignore_eos: the grammar ends the answer
    elif ignore_eos:
        body["ignore_eos"] = True
    body.update(extra)
    return body


def error_text(status: int, raw: bytes) -> str:
    """``HTTP 503: <OpenAI error message>`` on one line, at most 200 characters."""
    msg = ""
    try:
        d = msgspec.json.decode(raw)
        err = d.get("error") if isinstance(d, dict) else None
        msg = str(err.get("message", "")) if isinstance(err, dict) else str(err or "")
    except msgspec.DecodeError:
        msg = raw.decode("utf-8", "replace")
    return f"HTTP {status}: {' '.join(msg.split())}"[:200]


class OpenAIStreamClient:
    """Sends ``RequestSpec`` s to one OpenAI-compatible endpoint."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        api: Api = Api.CHAT,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        ignore_eos: bool = True,
        extra_body: dict[str, Any] | None = None,
        max_connections: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.url = base_url.rstrip("/") + api.path
        self.model, self.api, self.timeout_s = model, api, timeout_s
        self.ignore_eos, self.extra_body = ignore_eos, dict(extra_body or {})
        self.clock = clock
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenAIStreamClient:
        # NOTE(pool): limit=0 lets the arrival pattern, not the pool, bound concurrency;
        # a pool limit would silently turn an open loop into a closed one.
        conn = aiohttp.TCPConnector(limit=self._max_connections, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=conn,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            auto_decompress=False,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(self, spec: RequestSpec, t0: float, phase: int = 0) -> RequestRecord:
        """Send one request; ``t0`` is the run's start on ``clock``."""
        assert self._session is not None, "use 'async with OpenAIStreamClient(...)'"
        clock = self.clock
        headers = dict(self._headers)
        headers["x-priority"] = spec.priority.label
        body = _encode(build_body(spec, self.api, self.model, self.ignore_eos, self.extra_body))
        start = clock()
        rec = RequestRecord(
            index=spec.index,
            priority=spec.priority.label,
            start_s=start - t0,
            num_input_tokens=spec.num_prompt_tokens,
            prefix_group=spec.prefix_group,
            phase=phase,
        )
        try:
            async with self._session.post(self.url, data=body, headers=headers) as resp:
                rec.status = resp.status
                if resp.status != 200:
                    rec.error = error_text(resp.status, await resp.content.read(4096))
                else:
                    await self._read_stream(resp, rec, start)
        except asyncio.TimeoutError:
            rec.error = f"timeout after {self.timeout_s:g}s"
        except aiohttp.ClientError as e:
            rec.error = f"connection error: {type(e).__name__}: {' '.join(str(e).split())}"[:200]
        rec.end_s = clock() - t0
        return rec

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord, start: float) -> None:
        clock, dec = self.clock, SSEDecoder()
        last = 0.0
        usage: _Usage | None = None
        async for raw in resp.content.iter_any():
            now = clock()
            for data in dec.feed(raw):
                if data == b"[DONE]":
                    if usage and usage.completion_tokens is not None:
                        rec.num_output_tokens = usage.completion_tokens
                    if usage and usage.prompt_tokens is not None:
                        rec.num_input_tokens = usage.prompt_tokens
                    return
                try:
                    chunk = decode_chunk(data)
                except msgspec.DecodeError as e:
                    rec.error = f"malformed SSE chunk: {e}: {data[:60]!r}"[:200]
                    return
                if chunk.error is not None:
                    rec.error = f"error event in stream: {chunk.error_message()}"[:200]
                    return
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    if c.output_text():
                        if rec.ttft_s is None:
                            rec.ttft_s = now - start
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        rec.num_output_tokens += 1  # content chunks; usage overrides at the end
        rec.error = "stream ended without [DONE]"
