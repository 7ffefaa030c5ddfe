"""Prometheus metrics for ``sluice serve``: the bridge from engine stats to exporters.

The engine knows no exporter: it emits ``EngineStats`` (per step) and
``RequestTimings`` (per finished request).  ``ServerMetrics`` turns them into
prometheus-client metrics with the DESIGN.md names, on a registry owned by
the app (no global registry, so tests can build many apps)::

    sluice_time_to_first_token_seconds{priority}     histogram
    sluice_time_per_output_token_seconds{priority}   histogram
    sluice_e2e_request_latency_seconds{priority}     histogram
    sluice_queue_time_seconds{priority}              histogram
    sluice_num_requests_running / _waiting           gauges (engine's view)
    sluice_kv_cache_usage_ratio                      gauge 0..1
    sluice_prefix_cache_hits_total                   counter (prompt tokens)
    sluice_prefix_cache_queries_total                counter (prompt tokens)
    sluice_preemptions_total                         counter
    sluice_requests_total{status,priority}           counter, status = HTTP code (499: client went away)
    sluice_prompt_tokens_total / _generation_tokens_total
    sluice_host_cpu_utilization_ratio / sluice_host_memory_used_ratio   (sluice.obs.host)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sluice.engine.protocol import EngineStats, RequestTimings
from sluice.obs.host import HostCollector

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
PRIORITIES = ("p0", "p1", "p2")


class ServerMetrics:
    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        lab = ["priority"]
        self.ttft = Histogram("sluice_time_to_first_token_seconds", "Time to first token (arrival at the API process to first token).", lab, registry=r, buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("sluice_time_per_output_token_seconds", "Mean time per output token after the first, per request.", lab, registry=r, buckets=_TPOT_BUCKETS)
        self.e2e = Histogram("sluice_e2e_request_latency_seconds", "End-to-end request latency.", lab, registry=r, buckets=_LATENCY_BUCKETS)
        self.queue = Histogram("sluice_queue_time_seconds", "Time from arrival to first scheduling.", lab, registry=r, buckets=_LATENCY_BUCKETS)
        self.running = Gauge("sluice_num_requests_running", "Requests running in the engine.", registry=r)
        self.waiting = Gauge("sluice_num_requests_waiting", "Requests waiting in the engine.", registry=r)
        self.running_by_p = Gauge("sluice_num_requests_running_by_priority", "Running requests by class.", lab, registry=r)
        self.waiting_by_p = Gauge("sluice_num_requests_waiting_by_priority", "Waiting requests by class.", lab, registry=r)
        self.queued = Gauge("sluice_num_requests_queued", "Requests admitted by the API process, not started yet.", registry=r)
        self.kv_usage = Gauge("sluice_kv_cache_usage_ratio", "Fraction of KV blocks held by requests.", registry=r)
        self.kv_blocks = Gauge("sluice_kv_cache_blocks", "Total KV cache blocks.", registry=r)
        self.prefix_hits = Counter("sluice_prefix_cache_hits", "Prompt tokens served from the prefix cache.", registry=r)
        self.prefix_queries = Counter("sluice_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r)
        self.preemptions = Counter("sluice_preemptions", "Requests preempted (freed and recomputed later).", registry=r)
        self.requests = Counter("sluice_requests", "Finished HTTP requests by status code and class.", ["status", "priority"], registry=r)
        self.prompt_tokens = Counter("sluice_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("sluice_generation_tokens", "Tokens generated.", registry=r)
        self.info = Gauge("sluice_model_info", "The served model (value 1).", ["model"], registry=r)
        if model_name:
            self.info.labels(model=model_name).set(1)
        for p in PRIORITIES:  # export zeros from the start: dashboards see every class
            for h in (self.ttft, self.tpot, self.e2e, self.queue):
                h.labels(priority=p)
        r.register(HostCollector())
        # cumulative engine counters last seen (they are exported as deltas)
        self._last = EngineStats()

    def observe_stats(self, s: EngineStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        for i, p in enumerate(PRIORITIES):
            self.running_by_p.labels(priority=p).set(s.num_running_by_priority[i] if i < len(s.num_running_by_priority) else 0)
            self.waiting_by_p.labels(priority=p).set(s.num_waiting_by_priority[i] if i < len(s.num_waiting_by_priority) else 0)
        self.kv_usage.set(s.kv_cache_usage)
        self.kv_blocks.set(s.num_total_blocks)
        last = self._last
        self.prefix_hits.inc(max(0, s.prefix_cache_hits - last.prefix_cache_hits))
        self.prefix_queries.inc(max(0, s.prefix_cache_queries - last.prefix_cache_queries))
        self.preemptions.inc(max(0, s.num_preemptions - last.num_preemptions))
        self._last = s

    def observe_finished(self, priority: str, t: RequestTimings | None, num_generated: int) -> None:
        """One finished engine request (one choice), timings from the engine."""
        self.generation_tokens.inc(num_generated)
        if t is None:
            return
        if t.queue_time is not None:
            self.queue.labels(priority=priority).observe(max(0.0, t.queue_time))
        if t.ttft is not None:
            self.ttft.labels(priority=priority).observe(max(0.0, t.ttft))
        if t.finished is not None:
            self.e2e.labels(priority=priority).observe(max(0.0, t.finished - t.arrival))
            if t.first_token is not None and num_generated > 1:
                self.tpot.labels(priority=priority).observe(
                    max(0.0, (t.finished - t.first_token) / (num_generated - 1))
                )

    def count_request(self, status: int, priority: str) -> None:
        self.requests.labels(status=str(status), priority=priority).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
