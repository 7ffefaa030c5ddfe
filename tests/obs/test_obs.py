"""sluice.obs: the metrics bridge, host gauges, JSON logs, hardware readers, doctor."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from sluice.engine.protocol import EngineStats, RequestTimings
from sluice.obs.hardware import numa_nodes, parse_cpulist
from sluice.obs.logging import JsonFormatter
from sluice.obs.metrics import ServerMetrics


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


def test_finished_request_feeds_the_priority_histograms() -> None:
    m = ServerMetrics("m")
    t = RequestTimings(arrival=10.0, first_scheduled=10.5, first_token=11.0, finished=13.0)
    m.observe_finished("p0", t, num_generated=5)
    assert _sample(m, "sluice_time_to_first_token_seconds_sum", priority="p0") == 1.0
    assert _sample(m, "sluice_queue_time_seconds_sum", priority="p0") == 0.5
    assert _sample(m, "sluice_e2e_request_latency_seconds_sum", priority="p0") == 3.0
    assert _sample(m, "sluice_time_per_output_token_seconds_sum", priority="p0") == 0.5, "2 s over 4 later tokens"
    assert _sample(m, "sluice_time_to_first_token_seconds_count", priority="p2") == 0, "every class exported"


def test_host_gauges_are_ratios() -> None:
    m = ServerMetrics()
    text = m.render().decode()
    for name in ("sluice_host_cpu_utilization_ratio", "sluice_host_memory_used_ratio"):
        v = _sample(m, name)
        assert 0.0 <= v <= 1.0, f"{name} must be a 0..1 ratio, got {v}"
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
