"""Background I/O that keeps replica state fresh: ``/metrics`` scrapes and ``/health`` probes.

One loop, owned by the app's lifespan.  Every ``scrape_interval`` it scrapes
each replica's ``/metrics`` (parsed by ``prom.parse_replica_load``); every
``health.interval_s`` it probes ``/health``.  All replicas are handled
concurrently, each call bounded by ``health.timeout_s``, so one hung replica
never delays the others.  The decisions themselves (health state, breaker
memory pressure) live in the pure trackers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from sluice.gateway.config import GatewayConfig
from sluice.gateway.pool import ReplicaPool
from sluice.gateway.prom import parse_replica_load
from sluice.gateway.replica import Replica

__all__ = ["Scraper"]

log = logging.getLogger("sluice.gateway")


class Scraper:
    def __init__(
        self,
        config: GatewayConfig,
        pool: ReplicaPool,
        session: Callable[[], aiohttp.ClientSession],
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.pool = pool
        self._session = session
        self._clock = clock
        self._last_scrape = float("-inf")

    async def run(self) -> None:
        tick = min(self.config.scrape_interval, self.config.health.interval_s)
        while True:
            await self.step()
            await asyncio.sleep(tick)

    async def step(self) -> None:
        """One round: probe replicas that are due, scrape if the interval passed."""
        now = self._clock()
        scrape = now - self._last_scrape >= self.config.scrape_interval
        if scrape:
            self._last_scrape = now
        jobs = []
        for r in list(self.pool.replicas()):
            if r.health.is_probe_due():
                jobs.append(self.probe(r))
            if scrape:
                jobs.append(self.scrape(r))
        if jobs:
            await asyncio.gather(*jobs)

    def _timeout(self) -> aiohttp.ClientTimeout:
        t = self.config.health.timeout_s
        return aiohttp.ClientTimeout(total=t, connect=t, sock_connect=t)

    async def probe(self, r: Replica) -> None:
        was_up = r.health.is_up
        try:
            async with self._session().get(r.url + "/health", timeout=self._timeout()) as resp:
                await resp.read()
                ok, err = resp.status == 200, f"/health answered {resp.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            ok, err = False, f"/health failed: {type(e).__name__}: {e}"
        r.health.record_probe(ok, None if ok else err)
        if was_up != r.health.is_up:
            log.warning("replica %s is now %s (%s)", r.url, r.health.state.label, r.health.last_error or "ok")

    async def scrape(self, r: Replica) -> None:
        try:
            async with self._session().get(r.url + "/metrics", timeout=self._timeout()) as resp:
                text = await resp.text()
                if resp.status != 200:
                    r.scrape_error = f"/metrics answered {resp.status}"
                    return
            load = parse_replica_load(text)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, UnicodeDecodeError) as e:
            r.scrape_error = f"{type(e).__name__}: {e}"
            return
        r.load = load
        r.scraped_at = self._clock()
        r.scrape_error = None
        r.breaker.kv_cache_usage = load.kv_cache_usage or 0.0
