"""The API process's shared state: what the route modules (app, admin, profiling,
LoRA routes) read, kept apart from ``build_app`` so that they depend on it and
not on one another."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice.auth import AdminAccess, KeyStore, RateLimiter
from sluice.engine.config import ModelInfo
from sluice.obs.tracing import Tracing
from sluice.server.codec import TextCodec
from sluice.server.config import ServerSettings
from sluice.server.lanes import AnyAdmission, AnyClient
from sluice.server.serving import OpenAIServing
from sluice.server.telemetry import ServerMetrics

__all__ = ["ServerState"]


@dataclass
class ServerState:
    settings: ServerSettings
    client: AnyClient
    metrics: ServerMetrics
    tracing: Tracing
    keys: KeyStore
    rate_limiter: RateLimiter
    admission: AnyAdmission
    codec_factory: Callable[[str], TextCodec]
    admin: AdminAccess  # who may call /admin/* and the LoRA load/unload routes (NOTE(admin-access))
    on_ready: Callable[[ModelInfo], None] | None = None
    on_engine_dead: Callable[[], None] | None = None
    serving: OpenAIServing | None = None
    model_info: ModelInfo | None = None
    is_draining: bool = False
    started_at: int = field(default_factory=lambda: int(time.time()))
    startup_error: str | None = None
    num_lanes: int = 1  # engine core processes (--data-parallel-size, NOTE(dp-auto) in sluice.server.lanes)

    @property
    def is_ready(self) -> bool:
        return self.serving is not None and not self.client.is_dead

    @property
    def num_inflight(self) -> int:
        return len(self.serving.inflight) if self.serving else 0

    async def drain(self, timeout: float) -> bool:
        """Stop admitting; wait for in-flight requests up to ``timeout`` s. True if all finished."""
        self.is_draining = True
        deadline = time.monotonic() + timeout
        while self.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.num_inflight == 0
