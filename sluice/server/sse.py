"""Server-sent events that stop when the client goes away.

``SSEResponse`` writes already-encoded ``data: ...`` events straight to the
socket and listens for ``http.disconnect`` at the same time: on disconnect
the body generator is closed at once (its ``finally`` aborts the engine
requests), even while it waits for the next token; ``on_close`` runs in
every case (a body generator that never started has no ``finally`` to run).  ``wait_or_disconnect``
gives the same guarantee before a response has started.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["SSEResponse", "ClientGone", "wait_or_disconnect"]

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


async def _until_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def wait_or_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``; if the client disconnects first, cancel it and raise ``ClientGone``."""
    task: asyncio.Future[T] = asyncio.ensure_future(aw)
    watcher: asyncio.Future[None] = asyncio.ensure_future(_until_disconnect(request.receive))
    pending: set[asyncio.Future[Any]] = {task, watcher}
    try:
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()


class SSEResponse(Response):
    # NOTE(response-subclass): a Response so FastAPI passes it through untouched;
    # __call__ is ours, the parent's body handling is unused.
    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        headers: dict[str, str],
        on_close: Callable[[], Any] | None = None,
    ):
        self.status_code = 200
        self.background = None
        self.body_iterator = body
        self.raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        self.raw_headers += [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self.on_close = on_close  # always called once the response is over

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        writer = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (writer, watcher):
                t.cancel()
            for t in (writer, watcher):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await self.body_iterator.aclose()
            if self.on_close is not None:
                self.on_close()
