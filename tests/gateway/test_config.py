"""Config loading and Prometheus parsing (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.errors import ConfigError
from sluice.gateway.config import PolicyName, load_config
from sluice.gateway.prom import ReplicaLoad, parse_replica_load

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gateway" / "gateway.yaml"


def test_example_config_loads() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.policy is PolicyName.PREFIX_AFFINITY
    versions = cfg.models["smollm2"].versions
    assert [v.share for v in versions] == [90, 10], "the example shows a 90/10 canary split"
    assert cfg.keys_file and Path(cfg.keys_file).exists(), "keys_file is resolved next to the config"


def test_flags_override_yaml_and_replicas_take_short_form(tmp_path: Path) -> None:
    p = tmp_path / "g.yaml"
    p.write_text("policy: round_robin\nmodels:\n  m:\n    versions:\n      - replicas: [http://a:1/v1/, {url: 'http://b:2', weight: 3}]\n")
    cfg = load_config(p, policy="least_load", port=1234)
    assert cfg.policy is PolicyName.LEAST_LOAD and cfg.port == 1234, "flags must override the file"
    reps = cfg.models["m"].versions[0].replicas
    assert [r.url for r in reps] == ["http://a:1", "http://b:2"], "urls are normalised (no /v1, no slash)"
    assert reps[1].weight == 3


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("models: {}\n", "no models configured"),
        ("models:\n  m:\n    versions: [{replicas: [ftp://x]}]\n", "must start with http"),
        ("policy: fastest\nmodels:\n  m:\n    versions: [{replicas: [http://x:1]}]\n", "policy"),
        ("models:\n  m:\n    versions: [{replicas: [http://x:1]}]\nbogus: 1\n", "bogus"),
        ("[1, 2", "not valid YAML"),
    ],
)
def test_bad_config_is_one_readable_error(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "g.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_config(p)
    with pytest.raises(ConfigError, match="cannot read gateway config"):
        load_config(tmp_path / "missing.yaml")


def test_parse_replica_load_reads_sluice_and_vllm_names() -> None:
    text = """# TYPE sluice_num_requests_running gauge
sluice_num_requests_running{model="a"} 3
sluice_num_requests_running{model="b"} 2
# TYPE sluice_num_requests_waiting gauge
sluice_num_requests_waiting 7
# TYPE sluice_kv_cache_usage_ratio gauge
sluice_kv_cache_usage_ratio 0.25
# TYPE sluice_host_cpu_utilization_ratio gauge
sluice_host_cpu_utilization_ratio 1.7
# TYPE sluice_time_to_first_token_seconds histogram
sluice_time_to_first_token_seconds_bucket{le="0.1"} 4
sluice_time_to_first_token_seconds_bucket{le="+Inf"} 5
sluice_time_to_first_token_seconds_sum 0.4
sluice_time_to_first_token_seconds_count 5
"""
    load = parse_replica_load(text)
    assert load == ReplicaLoad(num_running=5, num_waiting=7, kv_cache_usage=0.25, cpu_utilization=1.0), (
        f"counts are summed over label sets, ratios clamped to [0, 1]: {load}"
    )
    assert parse_replica_load("vllm:num_requests_waiting 4\n").num_waiting == 4
    assert parse_replica_load("") == ReplicaLoad(), "a server exporting nothing has unknown load"
    with pytest.raises(ValueError):
        parse_replica_load("this is { not prometheus")


def test_parse_replica_load_reads_only_its_series_and_still_rejects_non_prometheus_text() -> None:
    # NOTE(scrape-filter): only the gauges the gateway reads reach the parser; other lines are skipped
    buckets = "".join(f'sluice_e2e_request_latency_seconds_bucket{{priority="p1",le="{i}"}} {i}\n' for i in range(300))
    text = f"""# HELP sluice_e2e_request_latency_seconds End-to-end {{latency}}, a help text with braces
# TYPE sluice_e2e_request_latency_seconds histogram
{buckets}sluice_e2e_request_latency_seconds_count{{priority="p1"}} 300 1700000000000
# TYPE sluice_predicted_ttft_seconds gauge
sluice_predicted_ttft_seconds{{priority="p0"}} 0.05
sluice_predicted_ttft_seconds{{priority="p2"}} 4.5
sluice_stage_seconds_total{{stage="a b {{c}}"}} 2.5
{{no_name="x"}} 1
# TYPE sluice_slo_ttft_target_seconds gauge
sluice_slo_ttft_target_seconds{{priority="p0"}} 0.2
sluice_lora_adapter_loaded{{adapter="sql"}} 1
vllm:num_requests_running 2
sluice_num_requests_running 1
"""
    load = parse_replica_load(text)
    assert load.predicted_ttft == (0.05, 0.0, 4.5) and load.ttft_target == (0.2, 0.0, 0.0), load
    assert load.num_running == 3 and dict(load.lora_adapters) == {"sql": True}, load
    for bad in ("<html><body>502 Bad Gateway</body></html>", 'other_series{a="b"} not-a-number'):
        with pytest.raises(ValueError):
            parse_replica_load(text + bad + "\n")


def test_operations_example_config_loads() -> None:
    cfg = load_config(EXAMPLE.parents[1] / "operations" / "gateway.yaml")
    assert cfg.degradation.policy.value == "graded" and cfg.rollout.auto_rollback
    assert cfg.models["smollm2"].fallback == "v1"
    auto = cfg.models["autoscaled"].autoscale
    assert auto is not None and auto.launcher.kind.value == "local" and (auto.min_replicas, auto.max_replicas) == (1, 2)
    assert cfg.models["autoscaled"].versions[0].replicas == [], "an autoscaled version may start empty"
