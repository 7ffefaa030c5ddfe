"""The live progress line: elapsed, sent, done, errors, current req/s, rolling p95 TTFT.

Rendered with rich on stderr (stdout stays for the report and the JSON line),
refreshed 4 times a second by a task this context manager owns::

    async with LiveDisplay(stats, enabled=sys.stderr.isatty()): ...
"""

from __future__ import annotations

import asyncio
import contextlib

from rich.console import Console
from rich.live import Live
from rich.text import Text

from sluice.bench.runner import LiveStats

__all__ = ["LiveDisplay", "render"]


def render(stats: LiveStats, label: str = "") -> Text:
    p95 = stats.rolling_p95_ttft_ms()
    return Text(
        f"{label}elapsed {stats.elapsed_s:6.1f}s  sent {stats.num_sent}  done {stats.num_done}  "
        f"errors {stats.num_errors}  {stats.current_rps():7.1f} req/s  "
        f"p95 TTFT (10 s) {'-' if p95 is None else f'{p95:.0f} ms'}"
    )


class LiveDisplay:
    def __init__(self, stats: LiveStats, *, enabled: bool, console: Console | None = None) -> None:
        self.stats, self.enabled = stats, enabled
        self.console = console or Console(stderr=True)
        self.label = ""  # e.g. "step 2/5 " during a sweep
        self._task: asyncio.Task[None] | None = None
        self._live: Live | None = None

    async def __aenter__(self) -> LiveDisplay:
        if self.enabled:
            self._live = Live(render(self.stats), console=self.console, auto_refresh=False, transient=False)  # fmt: skip
            self._live.start()
            self._task = asyncio.create_task(self._refresh())
        return self

    async def _refresh(self) -> None:
        assert self._live is not None
        while True:
            await asyncio.sleep(0.25)
            self._live.update(render(self.stats, self.label), refresh=True)

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._live is not None:
            self._live.update(render(self.stats, self.label), refresh=True)
            self._live.stop()
