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

Operations (docs/operations.md):

    sluice_gateway_degradation_level{model}                 0 normal .. 3 shedding
    sluice_gateway_degradation_score{model}                 load score, 1.0 = at capacity
    sluice_gateway_degradation_changes_total{model,direction}   up / down
    sluice_gateway_degraded_requests_total{model,action,priority}   cap / fallback / shed
    sluice_gateway_version_share{model,version}             current traffic share
    sluice_gateway_rollbacks_total{model,version}
    sluice_gateway_autoscale_replicas{model}                replicas of the autoscaled version
    sluice_gateway_autoscale_decisions_total{model,direction}   up / down
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sluice.gateway.autoscale import Autoscaler
from sluice.gateway.degradation import DegradationPolicy
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


class _OpsCollector(Collector):
    """Degradation levels, version shares and autoscaled replica counts, read at scrape time."""

    def __init__(self, pool: ReplicaPool, degradation: DegradationPolicy):
        self._pool = pool
        self._degradation = degradation
        self.autoscaler: Autoscaler | None = None  # set by build_app when a model autoscales

    def collect(self) -> Iterator[GaugeMetricFamily]:
        level = GaugeMetricFamily("sluice_gateway_degradation_level", "0 normal, 1 max_tokens cap, 2 fallback, 3 shedding", labels=["model"])
        score = GaugeMetricFamily("sluice_gateway_degradation_score", "Load score (1.0 = at capacity)", labels=["model"])
        share = GaugeMetricFamily("sluice_gateway_version_share", "Traffic share of a version", labels=["model", "version"])
        for model in self._pool.models:
            level.add_metric([model], float(int(self._degradation.level(model))))
            pressure = getattr(self._degradation, "pressure", None)
            if pressure is not None:
                score.add_metric([model], pressure(model).score)
            for v in self._pool.versions(model):
                share.add_metric([model, v.name], v.share)
        yield from (level, score, share)
        if self.autoscaler is not None:
            replicas = GaugeMetricFamily("sluice_gateway_autoscale_replicas", "Replicas of the autoscaled version", labels=["model"])
            for model in self.autoscaler.models:
                replicas.add_metric([model], float(self.autoscaler.num_replicas(model)))
            yield replicas


class GatewayMetrics:
    def __init__(self, pool: ReplicaPool, *, clock: Callable[[], float] = time.monotonic):
        self._pool = pool
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
        self.degradation_changes = Counter(
            "sluice_gateway_degradation_changes", "Degradation level changes", ["model", "direction"], registry=r
        )
        self.degraded = Counter(
            "sluice_gateway_degraded_requests",
            "Requests degraded: max_tokens capped, sent to the fallback version, or shed",
            ["model", "action", "priority"],
            registry=r,
        )
        self.rollbacks = Counter(
            "sluice_gateway_rollbacks", "Canary versions rolled back automatically", ["model", "version"], registry=r
        )
        self.autoscale_decisions = Counter(
            "sluice_gateway_autoscale_decisions", "Autoscaler replica count changes", ["model", "direction"], registry=r
        )
        r.register(_PoolCollector(pool, clock))
        self.ops: _OpsCollector | None = None

    def watch_operations(self, degradation: DegradationPolicy) -> _OpsCollector:
        """Export degradation levels and version shares (and, once set, the autoscaler)."""
        self.ops = _OpsCollector(self._pool, degradation)
        self.registry.register(self.ops)
        return self.ops

    def render(self) -> bytes:
        return generate_latest(self.registry)
