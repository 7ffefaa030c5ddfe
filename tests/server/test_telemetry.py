"""The server's telemetry bridge: engine stats and timings -> Prometheus metrics and stage spans."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice.engine.protocol import EngineStats, RequestTimings
from sluice.obs.tracing import Tracing
from sluice.server.telemetry import ServerMetrics, record_stages


def _sample(m: ServerMetrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels)
    assert v is not None, f"{name}{labels} must be exported"
    return v


def test_stats_become_gauges_and_cumulative_counts_become_deltas() -> None:
    m = ServerMetrics("m")
    m.observe_stats(EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.5, prefix_cache_hits=10,
                                prefix_cache_queries=40, num_preemptions=1, num_running_by_priority=[1, 2, 0]))
    m.observe_stats(EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_hits=25,
                                prefix_cache_queries=90, num_preemptions=1))
    assert _sample(m, "sluice_num_requests_running") == 0 and _sample(m, "sluice_kv_cache_usage_ratio") == 0
    assert _sample(m, "sluice_prefix_cache_hits_total") == 25, "cumulative engine counters must not double count"
    assert _sample(m, "sluice_prefix_cache_queries_total") == 90
    assert _sample(m, "sluice_preemptions_total") == 1


def test_the_engine_time_tokens_and_steps_by_kind_of_step_are_counters_by_kind() -> None:
    m = ServerMetrics("m")
    m.observe_stats(EngineStats(busy_seconds_by_kind=[1.5, 0.25, 0.5], batched_tokens_by_kind=[100, 20, 30],
                                steps_by_kind=[3, 1, 2]))  # fmt: skip
    assert [_sample(m, "sluice_engine_busy_seconds_total", kind=k) for k in ("normal", "express", "nested")] == [
        1.5, 0.25, 0.5]  # fmt: skip
    assert _sample(m, "sluice_engine_batched_tokens_by_kind_total", kind="nested") == 30
    assert _sample(m, "sluice_engine_steps_by_kind_total", kind="express") == 1


def test_the_work_pools_waits_are_counters() -> None:
    m = ServerMetrics("m")
    m.observe_stats(EngineStats(pool_wait_seconds=2.5, pool_stalls=7, pool_stall_seconds=1.25))
    assert _sample(m, "sluice_engine_pool_wait_seconds_total") == 2.5
    assert _sample(m, "sluice_engine_pool_stalls_total") == 7
    assert _sample(m, "sluice_engine_pool_stall_seconds_total") == 1.25


def test_finished_request_feeds_the_priority_histograms() -> None:
    m = ServerMetrics("m")
    t = RequestTimings(arrival=10.0, first_scheduled=10.5, first_token=11.0, finished=13.0)
    m.observe_finished("p0", t, num_generated=5)
    assert _sample(m, "sluice_time_to_first_token_seconds_sum", priority="p0") == 1.0
    assert _sample(m, "sluice_queue_time_seconds_sum", priority="p0") == 0.5
    assert _sample(m, "sluice_e2e_request_latency_seconds_sum", priority="p0") == 3.0
    assert _sample(m, "sluice_time_per_output_token_seconds_sum", priority="p0") == 0.5, "2 s over 4 later tokens"
    assert _sample(m, "sluice_time_to_first_token_seconds_count", priority="p2") == 0, "every class exported"


def test_host_gauges_are_served_with_the_engine_metrics() -> None:
    m = ServerMetrics()
    assert "sluice_host_cpu_utilization_ratio" in m.render().decode(), "the gateway reads host gauges from /metrics"


def test_record_stages_makes_queue_prefill_decode_spans_in_order() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    parent = tracing.tracer.start_span("request")
    record_stages(tracing, parent, RequestTimings(arrival=1.0, first_scheduled=1.5, first_token=2.0, finished=4.0), {})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert list(spans) == ["queue", "prefill", "decode"]
    assert (spans["decode"].end_time - spans["decode"].start_time) == 2_000_000_000, "2 s of decode"
    assert all(s.parent.span_id == parent.get_span_context().span_id for s in spans.values())


def test_record_stages_adds_a_grammar_span_for_a_constrained_request() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    parent = tracing.tracer.start_span("request")
    t = RequestTimings(arrival=1.0, grammar_ready=1.25, first_scheduled=1.5, first_token=2.0, finished=4.0)
    record_stages(tracing, parent, t, {})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert list(spans) == ["grammar", "queue", "prefill", "decode"]
    assert spans["grammar"].end_time - spans["grammar"].start_time == 250_000_000, "arrival -> compiled: 0.25 s"
