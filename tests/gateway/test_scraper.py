"""The scraper: replica /metrics and /health feed replica state and the breaker."""

from __future__ import annotations

import aiohttp

from sluice.gateway.pool import ReplicaPool
from sluice.gateway.scraper import Scraper
from tests.gateway.conftest import fake_backends, gateway_config


async def test_scrape_feeds_load_breaker_and_health() -> None:
    async with fake_backends(1) as fakes, aiohttp.ClientSession() as session:
        fakes[0].config.metrics = {
            "sluice_num_requests_waiting": 5,
            "sluice_kv_cache_usage_ratio": 0.9,
            "sluice_host_cpu_utilization_ratio": 0.5,
        }
        dead = "http://127.0.0.1:9"  # discard port: nothing listens
        cfg = gateway_config([fakes[0].url, dead], health={"unhealthy_after": 1})
        pool = ReplicaPool(cfg)
        scraper = Scraper(cfg, pool, lambda: session)
        await scraper.step()
        live, gone = sorted(pool.replicas(), key=lambda r: r.url != fakes[0].url)
        assert live.load.num_waiting == 5 and live.load.cpu_utilization == 0.5, f"scraped load: {live.load}"
        assert live.breaker.kv_cache_usage == 0.9, "KV usage must reach the breaker's memory-pressure term"
        assert live.scraped_at is not None and live.health.is_up
        assert gone.scraped_at is None and gone.scrape_error, "an unreachable replica records why"
        assert not gone.health.is_up, "a replica that refuses /health must be taken out"
        fakes[0].config.metrics = {"sluice_num_requests_waiting": 1}
        await scraper.step()
        assert live.load.num_waiting == 5, "scrapes happen at most every scrape_interval"
        scraper._last_scrape -= cfg.scrape_interval
        await scraper.step()
        assert live.load.num_waiting == 1, "the next scrape replaces the load figures"
