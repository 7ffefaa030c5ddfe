"""One attempt at one replica over HTTP (aiohttp): open, read the first byte, stream the rest.

``UpstreamClient.open`` returns an ``Upstream`` only once the replica has sent
its status line *and the first body chunk*: until then nothing has reached
the client and the pipeline may still retry elsewhere.  Everything that can go
wrong before that point raises ``AttemptError`` with a ``kind``:

    connect   refused / reset / DNS before a response: the replica is probably down
    timeout   no first byte within ``first_byte_s``: hung or overloaded
    status    the replica answered 5xx or 429 (``status``/``body`` carried along)
    stream    the connection broke while reading the body

The session is injectable (``build_app(client=...)``) so tests and benchmarks
can share one, and the only I/O in the gateway lives here and in ``scraper.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp

from sluice.gateway.config import TimeoutConfig

__all__ = ["AttemptError", "Upstream", "UpstreamClient", "RETRYABLE_STATUS"]

# NOTE(retryable-status): 429 means "this replica is full", another may not be;
# 500/502/503/504 mean the replica (not the request) is broken.  Other 4xx are
# the client's fault and go back as they are, never retried.
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class AttemptError(Exception):
    def __init__(
        self,
        kind: str,
        message: str,
        *,
        status: int | None = None,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status  # upstream status for kind == "status"
        self.body = body
        self.headers = {k.lower(): v for k, v in (headers or {}).items()}  # lower-case names

    @property
    def is_replica_failure(self) -> bool:
        """Counts against the replica's breaker (429 is load, not failure)."""
        return self.status != 429


@dataclass
class Upstream:
    status: int
    headers: Mapping[str, str]
    first_chunk: bytes  # the whole body when not streaming
    response: aiohttp.ClientResponse | None  # None once fully read
    idle_s: float
    _watchdog: asyncio.TimerHandle | None = None

    async def rest(self) -> AsyncIterator[bytes]:
        """Remaining body chunks as they arrive (no buffering); raises
        ``AttemptError('stream')`` if the connection breaks or idles out.

        NOTE(idle-watchdog): one timer per stream, re-armed lazily, instead of
        a timeout context per chunk (which cost ~7% of the gateway's CPU).  It
        only fires while we wait on the replica, never while the client is slow.
        """
        if self.response is None:
            return
        content = self.response.content
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        idle = self.idle_s
        last = loop.time()
        reading = fired = False

        def check() -> None:
            nonlocal fired
            now = loop.time()
            if reading and now >= last + idle:
                fired = True
                if task is not None:
                    task.cancel()
                return
            self._watchdog = loop.call_at(last + idle if reading else now + idle, check)

        self._watchdog = loop.call_at(last + idle, check)
        try:
            while True:
                last, reading = loop.time(), True
                try:
                    chunk = await content.readany()
                except asyncio.CancelledError:
                    if fired and task is not None:
                        task.uncancel()
                        raise AttemptError("stream", f"no data for {idle:g}s mid-stream") from None
                    raise
                except (aiohttp.ClientError, ConnectionError) as e:
                    raise AttemptError("stream", f"stream broken: {e!r}") from None
                finally:
                    reading = False
                if not chunk:
                    return
                yield chunk
        finally:
            self._watchdog.cancel()

    def close(self) -> None:
        """Release the connection; an unfinished stream is closed, which the
        replica sees as a client disconnect (and aborts the request)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.response is not None:
            if self.response.content.at_eof():
                self.response.release()
            else:
                self.response.close()
            self.response = None


class UpstreamClient:
    def __init__(self, timeouts: TimeoutConfig, session: aiohttp.ClientSession | None = None):
        self.timeouts = timeouts
        self._session = session
        self._owns_session = session is None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # NOTE(pool): no connection limit; replicas do their own admission.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=self.timeouts.connect_s, sock_connect=self.timeouts.connect_s
                ),
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def open(
        self, url: str, body: bytes, headers: Mapping[str, str], *, stream: bool
    ) -> Upstream:
        resp: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(self.timeouts.first_byte_s):
                try:
                    resp = await self.session.post(url, data=body, headers=headers)
                except (aiohttp.ClientConnectionError, ConnectionError, OSError) as e:
                    raise AttemptError("connect", f"cannot reach replica: {_short(e)}") from None
                try:
                    if resp.status in RETRYABLE_STATUS or not stream or resp.status != 200:
                        data = await resp.read()
                    else:
                        data = await resp.content.readany()
                except (aiohttp.ClientError, ConnectionError) as e:
                    raise AttemptError("stream", f"replica broke the response: {_short(e)}") from None
        except TimeoutError:
            if resp is not None:
                resp.close()
            raise AttemptError("timeout", f"no response within {self.timeouts.first_byte_s:g}s") from None
        except AttemptError:
            if resp is not None:
                resp.close()
            raise
        if resp.status in RETRYABLE_STATUS:
            resp.release()
            raise AttemptError(
                "status", f"replica answered {resp.status}", status=resp.status, body=data, headers=resp.headers
            )
        if stream and resp.status == 200 and not data:
            resp.close()
            raise AttemptError("stream", "replica closed the stream before the first byte")
        full = not stream or resp.status != 200
        if full:
            resp.release()
        return Upstream(resp.status, resp.headers, data, None if full else resp, self.timeouts.idle_s)


def _short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) < 200 else text[:200] + "..."
