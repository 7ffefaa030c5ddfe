"""sluice.obs: host gauges, JSON logs, hardware readers, doctor."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from prometheus_client import CollectorRegistry, generate_latest

from sluice.obs.hardware import numa_nodes, parse_cpulist
from sluice.obs.host import HostCollector
from sluice.obs.logging import JsonFormatter


def test_host_gauges_are_ratios() -> None:
    registry = CollectorRegistry()
    registry.register(HostCollector())
    text = generate_latest(registry).decode()
    for name in ("sluice_host_cpu_utilization_ratio", "sluice_host_memory_used_ratio"):
        v = registry.get_sample_value(name)
        assert v is not None and 0.0 <= v <= 1.0, f"{name} must be a 0..1 ratio, got {v}"
        assert name in text


def test_json_formatter_writes_one_object_with_fields() -> None:
    rec = logging.LogRecord("sluice.request", logging.INFO, __file__, 1, "request", None, None)
    rec.fields = {"request_id": "abc", "prompt_tokens": 3}
    line = JsonFormatter().format(rec)
    doc = json.loads(line)
    assert "\n" not in line and doc["request_id"] == "abc" and doc["event"] == "request"


def test_parse_cpulist_and_numa_reader(tmp_path) -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    node = tmp_path / "node1"
    node.mkdir()
    (node / "cpulist").write_text("4-5\n")
    (node / "meminfo").write_text("Node 1 MemTotal:       2097152 kB\n")
    assert numa_nodes(tmp_path) == [{"node": 1, "cpus": [4, 5], "memory_gib": 2.0}]


def test_doctor_reports_versions_topology_and_attention_backend() -> None:
    r = subprocess.run([sys.executable, "-m", "sluice.cli", "doctor", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["python"] and doc["cpu"]["logical_cpus"] >= 1
    assert doc["attention"]["chosen"] in doc["attention"]["available"], "doctor must name the chosen backend"


def test_doctor_without_probes_reports_the_machine_only() -> None:
    from sluice.obs.cli import collect_report

    r = collect_report()
    assert r["torch"] is None and r["gpus"] == [] and "attention" not in r, "obs knows no engine by itself"
    assert collect_report([lambda: {"attention": {"chosen": "x"}}])["attention"] == {"chosen": "x"}


def test_without_an_exporter_spans_are_not_recorded_but_the_trace_id_goes_on() -> None:
    from sluice.obs.tracing import Tracing, build_tracer_provider

    tracing = Tracing(build_tracer_provider(None))  # NOTE(unrecorded-spans)
    parent = tracing.extract({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    span = tracing.start_request_span("POST /v1/completions", parent, {"sluice.priority": "p0"})
    assert not span.is_recording()
    assert format(span.get_span_context().trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    tp = tracing.traceparent(span)
    assert tp is not None and tp.startswith("00-0af7651916cd43dd8448eb211c80319c-"), "the engine gets the client's trace"
    fresh = tracing.start_request_span("POST /v1/completions", tracing.extract({}), {})
    assert fresh.get_span_context().trace_id != 0, "no traceparent: a new trace id all the same"
    tracing.record_span(span, "queue", 1.0, 2.0, {})  # nothing to record into: no error, no span
