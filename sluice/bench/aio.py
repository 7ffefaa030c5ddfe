"""Run the bench's event loop: uvloop when installed (it ships with uvicorn[standard]).

NOTE(uvloop): the client's own overhead decides how many streamed requests per
second one core can drive; uvloop roughly halves the loop's share of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run_event_loop"]

T = TypeVar("T")


def run_event_loop(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result
