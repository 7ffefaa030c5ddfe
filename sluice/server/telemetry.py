"""The server's telemetry bridge: engine stats and timings -> Prometheus metrics and trace spans.

The engine knows no exporter: it emits ``EngineStats`` (per step) and
``RequestTimings`` (per finished request).  ``ServerMetrics`` turns them into
prometheus-client metrics with the DESIGN.md names, on a registry owned by
the app (no global registry, so tests can build many apps); ``record_stages``
turns a request's timings into its queue / prefill / decode spans::

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
    sluice_kv_tier_hits_total{tier} / _hit_tokens_total{tier}      counters: prompt blocks / tokens found
                                                                    per tier (memory, disk)
    sluice_kv_tier_blocks{tier} / _bytes{tier} / _capacity_bytes{tier}   gauges: what each tier holds
    sluice_kv_tier_enabled{tier}                                    gauge: 0 once a failing disk turned it off
    sluice_kv_tier_load_seconds{tier}                               histogram: a request's wait for its blocks
    sluice_kv_tier_load_bytes_total / _store_bytes_total / _store_seconds_total / _stored_blocks_total /
    _dropped_blocks_total / _evicted_blocks_total / _corrupt_total / _load_failures_total   {tier} counters

Structured outputs (issue 54; docs/structured_outputs.md)::

    sluice_structured_requests_total / _compiles_total / _compile_errors_total / _cache_hits_total   counters
    sluice_structured_requests_waiting_for_compile / _cache_entries / _cache_bytes                  gauges
    sluice_structured_compile_seconds / _mask_seconds (per step)                                      histograms
    sluice_structured_mask_wait_seconds_total / _tokens_total, sluice_jump_forward_tokens_total      counters

Speculative decoding (issue 55; docs/speculative.md), while it is configured::

    sluice_spec_drafted_tokens_total / _accepted_tokens_total / _emitted_tokens_total / _verify_runs_total{method}
    sluice_spec_k_chosen_total{k}                      counters: how often the policy chose each k

SLO admission (issue 11; ``sluice.server.admission``)::

    sluice_predicted_ttft_seconds{priority}            gauge: predicted TTFT of a new request now (mean prompt)
    sluice_slo_ttft_target_seconds{priority}           gauge: its class's TTFT target (mean prompt)
    sluice_admission_predicted_ttft_seconds{priority}  histogram: the prediction each admitted request got
    sluice_ttft_prediction_error_seconds{priority}     histogram: measured - predicted TTFT (signed)
    sluice_admission_rejected_total{priority,reason}   counter: 429s; reason = one of REJECT_REASONS
    sluice_slo_requests_total{priority}                counter: finished HTTP requests (served, shed, failed)
    sluice_slo_attained_total{priority}                counter: ... of them served within the class's target
    sluice_engine_step_time_base_seconds               gauge: fitted fixed cost of an engine step
    sluice_engine_step_time_per_token_seconds          gauge: fitted cost per batched token
    sluice_engine_step_time_per_seq_seconds            gauge: fitted cost per scheduled sequence
    sluice_engine_prefill_tokens_pending{priority}     gauge: tokens still to prefill in the engine

LoRA adapters (issue 13; ``sluice.server.lora_routes``)::

    sluice_lora_adapter_loaded{adapter}              gauge: 1 in memory, 0 registered only (gateway routing)
    sluice_lora_loaded_adapters / _active_adapters   gauges: in memory / used by running requests
    sluice_lora_max_active_adapters                  gauge: --max-loras
    sluice_lora_requests_waiting_for_load            gauge
    sluice_lora_loads_total / _load_failures_total / _evictions_total   counters
    sluice_lora_load_seconds                         histogram, one sample per finished load

``record_lora_loads`` turns the engine's ``LoRALoadRecord`` s into the load
histogram and ``lora_load`` spans, children of the span that caused each load
(its ``traceparent``: a request's, or the load endpoint's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from sluice.engine.protocol import (
    STEP_KINDS,
    STRUCTURED_COMPILE_BUCKETS,
    STRUCTURED_MASK_BUCKETS,
    EngineStats,
    LoRALoadRecord,
    RequestTimings,
)
from sluice.obs.host import HostCollector
from sluice.obs.tracing import Tracing

__all__ = ["ServerMetrics", "EngineStatsCollector", "CONTENT_TYPE_LATEST", "record_stages", "record_lora_loads"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_KV_LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
PRIORITIES = ("p0", "p1", "p2")
# the codes of admission's 429s (sluice.server.admission, the sheds of sluice.server.serving): a class's target
# unattainable, a wait past --max-queue-wait, a hard queue bound, shed for a higher class, overdue
REJECT_REASONS = ("slo_unattainable", "wait_too_long", "queue_full", "shed", "expired")
_ERROR_BUCKETS = (-5.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


class ServerMetrics:
    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        lab = ["priority"]
        self.ttft = Histogram("sluice_time_to_first_token_seconds", "Time to first token (arrival at the API process to first token).", lab, registry=r, buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("sluice_time_per_output_token_seconds", "Mean time per output token after the first, per request.", lab, registry=r, buckets=_TPOT_BUCKETS)
        self.e2e = Histogram("sluice_e2e_request_latency_seconds", "End-to-end request latency.", lab, registry=r, buckets=_LATENCY_BUCKETS)
        self.queue = Histogram("sluice_queue_time_seconds", "Time from arrival to first scheduling.", lab, registry=r, buckets=_LATENCY_BUCKETS)
        self.kv_load = Histogram("sluice_kv_tier_load_seconds", "Wait of a request for its KV blocks from a tier (admission to all blocks in memory).", ["tier"], registry=r, buckets=_KV_LOAD_BUCKETS)
        # engine gauges / cumulative counters: read from the latest EngineStats at
        # scrape time (see EngineStatsCollector), so a step costs one assignment.
        self.engine = EngineStatsCollector()
        r.register(self.engine)
        self.queued = Gauge("sluice_num_requests_queued", "Requests admitted by the API process, not started yet.", registry=r)
        self.requests = Counter("sluice_requests", "Finished HTTP requests by status code and class.", ["status", "priority"], registry=r)
        self.prompt_tokens = Counter("sluice_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("sluice_generation_tokens", "Tokens generated.", registry=r)
        self.info = Gauge("sluice_model_info", "The served model (value 1).", ["model"], registry=r)
        self.lora_load_time = Histogram("sluice_lora_load_seconds", "LoRA adapter load time (read, check, pack).", registry=r, buckets=_LOAD_BUCKETS)
        if model_name:
            self.info.labels(model=model_name).set(1)
        self.predicted = Histogram("sluice_admission_predicted_ttft_seconds", "Predicted TTFT of each admitted request.", lab, registry=r, buckets=_LATENCY_BUCKETS)
        self.prediction_error = Histogram("sluice_ttft_prediction_error_seconds", "Measured minus predicted TTFT (signed).", lab, registry=r, buckets=_ERROR_BUCKETS)
        self.rejected = Counter("sluice_admission_rejected", "Requests answered 429 by admission control.", ["priority", "reason"], registry=r)
        self.slo_requests = Counter("sluice_slo_requests", "Finished HTTP requests judged against their class's TTFT target.", lab, registry=r)
        self.slo_attained = Counter("sluice_slo_attained", "Requests served within their class's TTFT target.", lab, registry=r)
        self.signal = SloSignalCollector()
        r.register(self.signal)
        # NOTE(zero-series): every series whose label values are known exports 0 from the start (as
        # Prometheus advises), so dashboards and alerts see each class and 429 reason before its first event
        for p in PRIORITIES:
            for h in (self.ttft, self.tpot, self.e2e, self.queue, self.predicted, self.prediction_error):
                h.labels(priority=p)
            self.slo_requests.labels(priority=p)
            self.slo_attained.labels(priority=p)
            for reason in REJECT_REASONS:
                self.rejected.labels(priority=p, reason=reason)
        r.register(HostCollector())

    def observe_stats(self, s: EngineStats) -> None:
        self.engine.latest = s
        for t in s.kv_tiers:  # each wait is in exactly one snapshot
            for seconds in t.recent_load_seconds:
                self.kv_load.labels(tier=t.name).observe(seconds)

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

    def observe_prediction(self, priority: str, predicted: float) -> None:
        self.predicted.labels(priority=priority).observe(max(0.0, predicted))

    def observe_prediction_error(self, priority: str, error: float) -> None:
        self.prediction_error.labels(priority=priority).observe(error)

    def observe_rejected(self, priority: str, reason: str) -> None:
        self.rejected.labels(priority=priority, reason=reason).inc()

    def observe_slo(self, priority: str, attained: bool) -> None:
        self.slo_requests.labels(priority=priority).inc()
        if attained:
            self.slo_attained.labels(priority=priority).inc()

    def count_request(self, status: int, priority: str) -> None:
        self.requests.labels(status=str(status), priority=priority).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineStatsCollector(Collector):
    """Engine gauges and counters from the latest ``EngineStats`` snapshot.

    ``source``, when set, gives the snapshot at scrape time instead: with several engine cores
    (NOTE(data-parallel) in sluice.server.lanes) the app sets it to their merged stats, so a step
    still costs one assignment and the merge runs once a scrape.
    """

    def __init__(self) -> None:
        self.latest = EngineStats()
        self.source: Callable[[], EngineStats] | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.latest if self.source is None else self.source()
        yield GaugeMetricFamily("sluice_num_requests_running", "Requests running in the engine.", value=s.num_running)
        yield GaugeMetricFamily("sluice_num_requests_waiting", "Requests waiting in the engine.", value=s.num_waiting)
        for name, values, doc in (
            ("sluice_num_requests_running_by_priority", s.num_running_by_priority, "Running requests by class."),
            ("sluice_num_requests_waiting_by_priority", s.num_waiting_by_priority, "Waiting requests by class."),
        ):
            g = GaugeMetricFamily(name, doc, labels=["priority"])
            for p, v in zip(PRIORITIES, values):
                g.add_metric([p], v)
            yield g
        yield GaugeMetricFamily("sluice_kv_cache_usage_ratio", "Fraction of KV blocks held by requests.", value=s.kv_cache_usage)
        yield GaugeMetricFamily("sluice_kv_cache_blocks", "Total KV cache blocks.", value=s.num_total_blocks)
        yield GaugeMetricFamily("sluice_engine_step_seconds", "Duration of the last engine step.", value=s.step_time)
        yield GaugeMetricFamily("sluice_engine_batched_tokens", "Tokens in the last engine step.", value=s.num_batched_tokens)
        yield CounterMetricFamily("sluice_prefix_cache_hits", "Prompt tokens served from the prefix cache.", value=s.prefix_cache_hits)
        yield CounterMetricFamily("sluice_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", value=s.prefix_cache_queries)
        yield CounterMetricFamily("sluice_preemptions", "Requests preempted (freed and recomputed later).", value=s.num_preemptions)
        yield CounterMetricFamily("sluice_engine_steps", "Engine steps.", value=s.num_steps)
        yield from _step_kind_metrics(s)
        yield CounterMetricFamily("sluice_engine_pool_wait_seconds", "Time the engine's kernel loops waited for "
                                  "chunks other threads held (NOTE(pool-waits)).", value=s.pool_wait_seconds)
        yield CounterMetricFamily("sluice_engine_pool_stalls", "Waits of 0.5 ms or more for a chunk another thread "
                                  "held: a worker taken off its core mid-chunk.", value=s.pool_stalls)
        yield CounterMetricFamily("sluice_engine_pool_stall_seconds", "Time of those stalls.",
                                  value=s.pool_stall_seconds)
        yield GaugeMetricFamily("sluice_engine_step_time_base_seconds", "Fitted fixed cost of an engine step.", value=s.step_time_base)
        yield GaugeMetricFamily("sluice_engine_step_time_per_token_seconds", "Fitted cost of one batched token in a step.", value=s.step_time_per_token)
        yield GaugeMetricFamily("sluice_engine_step_time_per_seq_seconds", "Fitted cost of one scheduled sequence in a step.", value=s.step_time_per_seq)
        g = GaugeMetricFamily("sluice_engine_prefill_tokens_pending", "Tokens still to prefill in the engine, by class.", labels=["priority"])
        for p, v in zip(PRIORITIES, s.num_prefill_tokens_by_priority):
            g.add_metric([p], v)
        yield g
        yield from _kv_tier_metrics(s)
        yield from _structured_metrics(s)
        if s.spec_method:
            yield from _spec_metrics(s)

        if s.lora is not None:
            yield from _lora_metrics(s)


def _step_kind_metrics(s: EngineStats) -> Iterator[Metric]:
    """The engine's time, tokens and steps by kind of step (NOTE(step-kinds) in sluice.engine.core)."""
    for name, doc, values in (
        ("sluice_engine_busy_seconds", "Engine time in steps of each kind (a normal step's without the express steps "
         "nested in it).", s.busy_seconds_by_kind),
        ("sluice_engine_batched_tokens_by_kind", "Tokens batched in steps of each kind.", s.batched_tokens_by_kind),
        ("sluice_engine_steps_by_kind", "Engine steps of each kind.", s.steps_by_kind),
    ):  # fmt: skip
        c = CounterMetricFamily(name, doc, labels=["kind"])
        for kind, v in zip(STEP_KINDS, values):
            c.add_metric([kind], v)
        yield c


def _structured_metrics(s: EngineStats) -> Iterator[Metric]:
    """Structured outputs (docs/structured_outputs.md): the engine's grammar compiles, cache, masks, jump-forward."""

    def histogram(name: str, doc: str, bounds: tuple[float, ...], counts: list[int], total: float) -> Metric:
        counts = counts or [0] * (len(bounds) + 1)
        cum, buckets = 0, []
        for bound, n in zip((*[repr(b) for b in bounds], "+Inf"), counts):
            cum += n
            buckets.append((bound, cum))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)

    yield CounterMetricFamily("sluice_structured_requests", "Constrained requests (structured outputs, tools) the engine took.", value=s.structured_requests)
    yield GaugeMetricFamily("sluice_structured_requests_waiting_for_compile", "Requests waiting for their grammar to compile.", value=s.structured_waiting_for_compile)
    yield CounterMetricFamily("sluice_structured_compiles", "Grammars compiled (cache misses).", value=s.structured_compiles)
    yield CounterMetricFamily("sluice_structured_compile_errors", "Requests ended by a grammar error or a compile timeout.", value=s.structured_compile_errors)
    yield CounterMetricFamily("sluice_structured_cache_hits", "Constrained requests whose grammar was compiled already.", value=s.structured_cache_hits)
    yield GaugeMetricFamily("sluice_structured_cache_entries", "Compiled grammars held.", value=s.structured_cache_entries)
    yield GaugeMetricFamily("sluice_structured_cache_bytes", "Estimated memory of the compiled grammars held.", value=s.structured_cache_bytes)
    yield histogram("sluice_structured_compile_seconds", "Grammar compile time.", STRUCTURED_COMPILE_BUCKETS,
                    s.structured_compile_buckets, s.structured_compile_seconds)  # fmt: skip
    yield histogram("sluice_structured_mask_seconds", "Time to compute one step's token masks (while the model runs).",
                    STRUCTURED_MASK_BUCKETS, s.structured_mask_buckets, s.structured_mask_seconds)  # fmt: skip
    yield CounterMetricFamily("sluice_structured_mask_wait_seconds", "Time the sampler waited for token masks the "
                              "forward pass did not hide.", value=s.structured_mask_wait_seconds)  # fmt: skip
    yield CounterMetricFamily("sluice_structured_tokens", "Output tokens of constrained requests.", value=s.structured_tokens)
    yield CounterMetricFamily("sluice_jump_forward_tokens", "Output tokens a grammar forced, appended without a decode step each.", value=s.jump_forward_tokens)


def _spec_metrics(s: EngineStats) -> Iterator[Metric]:
    """Speculative decoding (docs/speculative.md), by proposer (``method``)."""
    for name, doc, value in (
        ("sluice_spec_drafted_tokens", "Draft tokens the target verified.", s.spec_drafted_tokens),
        ("sluice_spec_accepted_tokens", "Draft tokens the target kept (acceptance: accepted / drafted).", s.spec_accepted_tokens),
        ("sluice_spec_emitted_tokens", "Tokens emitted by verifying rows: kept drafts and the target's own token.", s.spec_emitted_tokens),
        ("sluice_spec_verify_runs", "Request steps that verified drafts (mean kept run: accepted / runs).", s.spec_verify_runs),
    ):
        c = CounterMetricFamily(name, doc, labels=["method"])
        c.add_metric([s.spec_method], value)
        yield c
    k = CounterMetricFamily("sluice_spec_k_chosen", "Times the speculation policy chose k drafts for a request.", labels=["k"])
    for i, n in enumerate(s.spec_k_counts):
        k.add_metric([str(i)], n)
    yield k


def _lora_metrics(s: EngineStats) -> Iterator[Metric]:
    lo = s.lora
    assert lo is not None
    loaded = set(lo.loaded)
    g = GaugeMetricFamily("sluice_lora_adapter_loaded", "Registered LoRA adapters: 1 in memory, 0 loaded on first use.", labels=["adapter"])
    for name in lo.adapters:
        g.add_metric([name], 1.0 if name in loaded else 0.0)
    yield g
    yield GaugeMetricFamily("sluice_lora_loaded_adapters", "LoRA adapters in memory.", value=len(lo.loaded))
    yield GaugeMetricFamily("sluice_lora_active_adapters", "LoRA adapters used by running requests.", value=len(lo.active))
    yield GaugeMetricFamily("sluice_lora_max_active_adapters", "LoRA adapters one engine step may hold (--max-loras).", value=lo.max_loras)
    yield GaugeMetricFamily("sluice_lora_requests_waiting_for_load", "Requests waiting for their LoRA adapter to load.", value=lo.num_waiting_for_load)
    yield CounterMetricFamily("sluice_lora_loads", "LoRA adapter loads that succeeded.", value=lo.num_loads)
    yield CounterMetricFamily("sluice_lora_load_failures", "LoRA adapter loads that failed.", value=lo.num_load_failures)
    yield CounterMetricFamily("sluice_lora_evictions", "LoRA adapters evicted from memory (least recently used).", value=lo.num_evictions)


class SloSignalCollector(Collector):
    """The predicted-wait signal, computed at scrape time: (predicted TTFT, target) per class.

    ``source`` is set by the app once admission control exists (``AdmissionController.signal``).
    """

    def __init__(self) -> None:
        self.source: Callable[[], list[tuple[float, float]]] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        values = self.source()
        pred = GaugeMetricFamily("sluice_predicted_ttft_seconds", "Predicted TTFT of a new request now (mean prompt length).", labels=["priority"])
        target = GaugeMetricFamily("sluice_slo_ttft_target_seconds", "TTFT target of the class (mean prompt length; 0: no target).", labels=["priority"])
        for p, (v, t) in zip(PRIORITIES, values):
            pred.add_metric([p], v)
            target.add_metric([p], t)
        yield pred
        yield target



def _kv_tier_metrics(s: EngineStats) -> Iterator[Metric]:
    """Per-tier KV metrics: the in-memory cache is tier 'memory', then each tier below it."""

    def family(kind: type, name: str, doc: str, memory: float | None, attr: str) -> Metric:
        m = kind(name, doc, labels=["tier"])
        if memory is not None:
            m.add_metric(["memory"], memory)
        for t in s.kv_tiers:
            m.add_metric([t.name], float(getattr(t, attr)))
        return m

    bs = 16  # tokens per block (DESIGN.md)
    per_block = s.kv_cache_bytes // s.num_total_blocks if s.num_total_blocks else 0
    yield family(CounterMetricFamily, "sluice_kv_tier_hits", "Prompt KV blocks found, per tier.", s.prefix_cache_hits // bs, "hit_blocks")
    yield family(CounterMetricFamily, "sluice_kv_tier_hit_tokens", "Prompt tokens whose KV was found, per tier.", s.prefix_cache_hits, "hit_tokens")
    yield family(GaugeMetricFamily, "sluice_kv_tier_blocks", "KV blocks holding a prefix, per tier.", s.num_cached_blocks, "num_blocks")
    yield family(GaugeMetricFamily, "sluice_kv_tier_bytes", "Bytes of the KV blocks held, per tier.", s.num_cached_blocks * per_block, "num_bytes")
    yield family(GaugeMetricFamily, "sluice_kv_tier_capacity_bytes", "Capacity of each KV tier in bytes.", s.kv_cache_bytes, "capacity_bytes")
    yield family(GaugeMetricFamily, "sluice_kv_tier_enabled", "1 while a KV tier is in use; 0 once a failing device turned it off.", 1.0, "is_enabled")
    for name, doc, attr in (
        ("sluice_kv_tier_load_bytes", "Bytes loaded from a KV tier.", "load_bytes"),
        ("sluice_kv_tier_store_bytes", "Bytes written to a KV tier.", "store_bytes"),
        ("sluice_kv_tier_store_seconds", "Busy time of a KV tier's writer.", "store_seconds"),
        ("sluice_kv_tier_stored_blocks", "KV blocks written to a tier.", "num_stored_blocks"),
        ("sluice_kv_tier_dropped_blocks", "KV blocks a tier did not take (writer behind, tier off).", "num_dropped_blocks"),
        ("sluice_kv_tier_evicted_blocks", "KV blocks removed by a tier's size cap.", "num_evicted_blocks"),
        ("sluice_kv_tier_corrupt", "Files or blocks found truncated, corrupt or foreign, and removed.", "num_corrupt"),
        ("sluice_kv_tier_load_failures", "Requests that recomputed because a block failed to load.", "num_load_failures"),
    ):
        yield family(CounterMetricFamily, name, doc, None, attr)


def record_stages(tracing: Tracing, parent: Span, t: RequestTimings | None, attributes: dict[str, str | int]) -> None:
    """The engine stages of one finished request as child spans of ``parent``::

        grammar  arrival -> its constraint compiled or found in the cache (constrained requests)
        queue    arrival -> first scheduled
        prefill  first scheduled -> first token
        decode   first token -> finished
    """
    if t is None:
        return
    stages = (
        ("grammar", t.arrival, t.grammar_ready),
        ("queue", t.arrival, t.first_scheduled),
        ("prefill", t.first_scheduled, t.first_token),
        ("decode", t.first_token, t.finished),
    )
    for name, start, end in stages:
        if start is not None and end is not None:
            tracing.record_span(parent, name, start, end, attributes)


def record_lora_loads(tracing: Tracing, metrics: ServerMetrics, records: list[LoRALoadRecord]) -> None:
    """Finished adapter loads: the load-time histogram, and one ``lora_load`` span each, child of the
    span that caused it (its ``traceparent``)."""
    from opentelemetry.trace import Status, StatusCode

    for rec in records:
        if rec.error is None:
            metrics.lora_load_time.observe(max(0.0, rec.end - rec.start))
        if not rec.traceparent:
            continue  # start-up loads belong to no request
        attributes: dict[str, str | int | float] = {
            "sluice.lora.adapter": rec.adapter,
            "sluice.lora.path": rec.path,
            "sluice.lora.bytes": rec.num_bytes,
            "sluice.lora.duration_s": max(0.0, rec.end - rec.start),
            "sluice.lora.cause": rec.cause,
        }
        if rec.request_id:
            attributes["sluice.engine_request_id"] = rec.request_id
        span = tracing.tracer.start_span("lora_load", context=tracing.extract({"traceparent": rec.traceparent}),
                                         start_time=tracing.to_ns(rec.start), attributes=attributes)  # fmt: skip
        if rec.error is not None:
            span.set_attribute("sluice.lora.error", rec.error)
            span.set_status(Status(StatusCode.ERROR, rec.error))
        span.end(end_time=tracing.to_ns(max(rec.start, rec.end)))
