"""Prometheus metrics of one gateway (its own registry: no global state).

Counters and the added-latency histogram are updated by the request pipeline;
state figures (breaker, health, scrape age, in-flight, per-model load) are read
from the pool at scrape time by a custom collector, so they are never stale.

    sluice_gateway_requests_total{model,replica,status}
    sluice_gateway_errors_total{model,replica,kind}         kind: connect, timeout, status, stream
    sluice_gateway_retries_total{model,replica}             replica = the one retried away from
    sluice_gateway_routing_decisions_total{model,policy,reason,replica}
    sluice_gateway_added_latency_seconds{model}             histogram
    sluice_gateway_breaker_state{model,replica}             0 closed, 1 half-open, 2 open
    sluice_gateway_breaker_trips_total{model,replica}
    sluice_gateway_replica_healthy{model,replica}
    sluice_gateway_replica_inflight_requests{model,replica}
    sluice_gateway_scrape_age_seconds{model,replica}        -1 before the first good scrape
    sluice_gateway_model_routable_replicas{model}
    sluice_gateway_model_inflight_tokens{model}
    sluice_gateway_model_ttft_p95_seconds{model}
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sluice.gateway.pool import ReplicaPool

__all__ = ["GatewayMetrics"]

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _PoolCollector(Collector):
    def __init__(self, pool: ReplicaPool, clock: Callable[[], float]):
        self._pool = pool
        self._clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = self._clock()
        labels = ["model", "replica"]
        state = GaugeMetricFamily("sluice_gateway_breaker_state", "0 closed, 1 half-open, 2 open", labels=labels)
        trips = CounterMetricFamily("sluice_gateway_breaker_trips", "Times the breaker opened", labels=labels)
        healthy = GaugeMetricFamily("sluice_gateway_replica_healthy", "1 when health checks pass", labels=labels)
        inflight = GaugeMetricFamily("sluice_gateway_replica_inflight_requests", "Requests in flight", labels=labels)
        age = GaugeMetricFamily("sluice_gateway_scrape_age_seconds", "Age of the last good /metrics scrape", labels=labels)
        for r in self._pool.replicas():
            lv = [r.model, r.url]
            state.add_metric(lv, float(int(r.breaker.state)))
            trips.add_metric(lv, float(r.breaker.num_trips))
            healthy.add_metric(lv, 1.0 if r.health.is_up else 0.0)
            inflight.add_metric(lv, float(r.num_inflight))
            age.add_metric(lv, -1.0 if r.scraped_at is None else now - r.scraped_at)
        routable = GaugeMetricFamily("sluice_gateway_model_routable_replicas", "Replicas taking traffic", labels=["model"])
        tokens = GaugeMetricFamily("sluice_gateway_model_inflight_tokens", "Outstanding tokens", labels=["model"])
        ttft = GaugeMetricFamily("sluice_gateway_model_ttft_p95_seconds", "p95 time to first byte, last minute", labels=["model"])
        for model in self._pool.models:
            load = self._pool.model_load(model)
            routable.add_metric([model], float(load.num_routable))
            tokens.add_metric([model], float(load.inflight_tokens))
            if load.p95_ttft_s is not None:
                ttft.add_metric([model], load.p95_ttft_s)
        yield from (state, trips, healthy, inflight, age, routable, tokens, ttft)


class GatewayMetrics:
    def __init__(self, pool: ReplicaPool, *, clock: Callable[[], float] = time.monotonic):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "sluice_gateway_requests", "Requests answered", ["model", "replica", "status"], registry=r
        )
        self.errors = Counter(
            "sluice_gateway_errors", "Failed attempts at a replica", ["model", "replica", "kind"], registry=r
        )
        self.retries = Counter(
            "sluice_gateway_retries", "Attempts retried on another replica", ["model", "replica"], registry=r
        )
        self.decisions = Counter(
            "sluice_gateway_routing_decisions",
            "Routing decisions",
            ["model", "policy", "reason", "replica"],
            registry=r,
        )
        self.added_latency = Histogram(
            "sluice_gateway_added_latency_seconds",
            "Time from request arrival to the upstream request being sent (auth, parsing, routing)",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_PoolCollector(pool, clock))

    def render(self) -> bytes:
        return generate_latest(self.registry)
