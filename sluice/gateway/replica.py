"""A replica as the gateway sees it: config, counted load, scraped load, health, breaker.

Each ``Replica`` is owned by the ``ReplicaPool``; the request pipeline updates
its in-flight counters, the scraper its ``load``, and both feed its health
tracker and breaker.  Policies only read it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from sluice.gateway.breaker import BreakerState, CircuitBreaker
from sluice.gateway.config import BreakerConfig, HealthConfig, ReplicaConfig
from sluice.gateway.health import HealthTracker
from sluice.gateway.prom import ReplicaLoad
from sluice.types import Priority

__all__ = ["Replica"]


@dataclass(eq=False)
class Replica:
    config: ReplicaConfig
    model: str  # gateway-facing model name
    version: str
    health: HealthTracker
    breaker: CircuitBreaker
    num_inflight: int = 0  # requests the gateway has sent and not finished
    inflight_tokens: int = 0  # their prompt + max_tokens estimate
    p0_awaiting_first: int = 0  # P0 requests sent here and not yet answered (NOTE(p0-spread) in policies.py)
    load: ReplicaLoad = field(default_factory=ReplicaLoad)  # last scrape
    scraped_at: float | None = None  # monotonic time of the last good scrape
    scrape_error: str | None = None

    @classmethod
    def build(
        cls,
        config: ReplicaConfig,
        *,
        model: str,
        version: str,
        health: HealthConfig,
        breaker: BreakerConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> Replica:
        return cls(
            config=config,
            model=model,
            version=version,
            health=HealthTracker(health, clock=clock),
            breaker=CircuitBreaker(breaker, sustainable_qps=config.sustainable_qps, clock=clock),
        )

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def weight(self) -> float:
        return self.config.weight

    @property
    def num_pending(self) -> float:
        """Requests ahead of a new one: our own in-flight count or, when another
        gateway also feeds this replica, what the replica itself reports."""
        scraped = (self.load.num_running or 0.0) + (self.load.num_waiting or 0.0)
        return max(float(self.num_inflight), scraped)

    def is_routable(self) -> bool:
        return self.health.is_up and self.breaker.can_route()

    def retry_after(self) -> float:
        return max(self.health.retry_after(), self.breaker.retry_after())

    def add_request(self, num_tokens: int) -> None:
        self.num_inflight += 1
        self.inflight_tokens += num_tokens
        self.breaker.on_dispatch()

    def finish_request(self, num_tokens: int) -> None:
        self.num_inflight -= 1
        self.inflight_tokens -= num_tokens

    @contextlib.contextmanager
    def awaiting_answer(self, priority: Priority) -> Iterator[None]:
        """Around a request's send: its status and first byte, or its failure (counts P0s)."""
        p0 = priority == Priority.P0
        self.p0_awaiting_first += p0
        try:
            yield
        finally:
            self.p0_awaiting_first -= p0

    def describe(self, now: float) -> dict[str, object]:
        """JSON view for ``/admin/replicas``."""
        return {
            "url": self.url,
            "model": self.model,
            "version": self.version,
            "weight": self.weight,
            "health": self.health.state.label,
            "health_error": self.health.last_error,
            "breaker": self.breaker.state.label,
            "breaker_threshold": round(self.breaker.threshold(), 4),
            "failure_rate": round(self.breaker.failure_rate(), 4),
            "num_inflight": self.num_inflight,
            "inflight_tokens": self.inflight_tokens,
            "p0_awaiting_first": self.p0_awaiting_first,
            "load": self.load.__dict__,
            "scrape_age_s": None if self.scraped_at is None else round(now - self.scraped_at, 3),
            "scrape_error": self.scrape_error,
        }

    @property
    def breaker_state(self) -> BreakerState:
        return self.breaker.state
