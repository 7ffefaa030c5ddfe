"""OpenTelemetry tracing: provider setup, request spans, and spans built after the fact.

Spans per server request (the engine stages come from ``server.telemetry.record_stages``)::

    POST /v1/chat/completions        (SERVER, parent from the client's traceparent)
     ├── tokenize
     ├── queue      arrival -> first scheduled      \
     ├── prefill    first scheduled -> first token   } built after the fact from
     └── decode     first token -> finished         /  the engine's RequestTimings

The exporter is off unless ``--otlp-endpoint`` is given; tests pass a provider
with an in-memory exporter.  The provider belongs to the app (never set
globally), so several apps can live in one test process.

NOTE(unrecorded-spans): with no exporter the provider samples nothing: spans
are not recorded (building a recorded span, its attributes and the stage
spans cost ~15% of the API process's CPU under load, for nothing), yet each
request still gets its trace id, from the client's ``traceparent`` or a new
one, and passes it on to the engine.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["build_tracer_provider", "Tracing"]


def build_tracer_provider(otlp_endpoint: str | None, service_name: str = "sluice-serve") -> TracerProvider:
    if not otlp_endpoint:  # NOTE(unrecorded-spans)
        return TracerProvider(resource=Resource.create({"service.name": service_name}), sampler=ALWAYS_OFF)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    endpoint = otlp_endpoint.rstrip("/")
    if not endpoint.endswith("/v1/traces"):
        endpoint += "/v1/traces"
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class Tracing:
    """Starts request spans and converts engine monotonic stamps to span times."""

    def __init__(self, provider: TracerProvider):
        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("sluice.server")
        self.propagator = TraceContextTextMapPropagator()
        # NOTE(clock-offset): engine timings are time.monotonic(); spans need epoch ns.
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def extract(self, headers: Mapping[str, str]) -> Context:
        return self.propagator.extract(carrier=dict(headers))

    def start_request_span(self, name: str, parent: Context, attributes: dict[str, str]) -> Span:
        return self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)

    def traceparent(self, span: Span) -> str | None:
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get("traceparent")

    def to_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def record_span(
        self, parent: Span, name: str, start_s: float, end_s: float, attributes: dict[str, str | int]
    ) -> None:
        """A finished child span of ``parent`` from two ``time.monotonic()`` stamps (none if it is not recorded)."""
        if not parent.is_recording():
            return
        ctx = trace.set_span_in_context(parent)
        span = self.tracer.start_span(name, context=ctx, start_time=self.to_ns(start_s), attributes=attributes)
        span.end(end_time=self.to_ns(max(start_s, end_s)))

    def shutdown(self) -> None:
        self.provider.shutdown()
