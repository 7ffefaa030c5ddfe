"""Replica load as read from its ``/metrics`` page: one pure parsing function.

``parse_replica_load(text)`` turns Prometheus exposition text into a
``ReplicaLoad``.  Unknown or missing series are simply absent (``None``): the
gateway also fronts plain OpenAI-compatible servers that export nothing.
vLLM's names (``vllm:num_requests_running`` ...) are understood as well, so a
vLLM replica gets the same load-aware routing.  LoRA adapters come from
``sluice_lora_adapter_loaded{adapter}`` (and vLLM's ``vllm:lora_requests_info``,
whose running/waiting adapters count as loaded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ReplicaLoad", "parse_replica_load"]


@dataclass(frozen=True)
class ReplicaLoad:
    num_running: float | None = None  # requests the replica is decoding/prefilling
    num_waiting: float | None = None  # requests queued inside the replica
    kv_cache_usage: float | None = None  # 0..1
    cpu_utilization: float | None = None  # host CPU, 0..1
    memory_used: float | None = None  # host memory, 0..1
    # the predicted-wait signal (sluice replicas): per class p0, p1, p2; None when not exported
    predicted_ttft: tuple[float, float, float] | None = None  # seconds, a new request's predicted TTFT
    ttft_target: tuple[float, float, float] | None = None  # seconds, its class's target (0: none)
    lora_adapters: Mapping[str, bool] = dataclasses.field(default_factory=dict)  # LoRA adapter -> in memory (False: loads on use)


# series name (as the parser reports it, without _total) -> ReplicaLoad field
_FIELDS: dict[str, str] = {
    "sluice_num_requests_running": "num_running",
    "sluice_num_requests_waiting": "num_waiting",
    "sluice_kv_cache_usage_ratio": "kv_cache_usage",
    "sluice_host_cpu_utilization_ratio": "cpu_utilization",
    "sluice_host_memory_used_ratio": "memory_used",
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
}
_RATIOS = {"kv_cache_usage", "cpu_utilization", "memory_used"}
# per-class series (label ``priority`` = p0 / p1 / p2) -> ReplicaLoad field
_BY_CLASS: dict[str, str] = {
    "sluice_predicted_ttft_seconds": "predicted_ttft",
    "sluice_slo_ttft_target_seconds": "ttft_target",
}
_CLASSES = ("p0", "p1", "p2")


def parse_replica_load(text: str) -> ReplicaLoad:
    """Parse a ``/metrics`` page.  Series with several label sets are summed
    (counts) or averaged (ratios).  Raises ``ValueError`` on malformed text
    (a line of another series only needs to end in a number, NOTE(scrape-filter))."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    by_class: dict[str, list[float]] = {}
    adapters: dict[str, bool] = {}
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for sample in family.samples:
            if sample.name in _ADAPTER_SERIES:
                _read_adapters(sample.name, sample.labels, sample.value, adapters)
                continue
            per_class = _BY_CLASS.get(sample.name)
            label = sample.labels.get("priority")
            if per_class is not None and label in _CLASSES and sample.value == sample.value:
                by_class.setdefault(per_class, [0.0, 0.0, 0.0])[_CLASSES.index(label)] = max(0.0, float(sample.value))
                continue
            field = _FIELDS.get(sample.name)
            if field is None or sample.value != sample.value:  # NaN
                continue
            sums[field] = sums.get(field, 0.0) + float(sample.value)
            counts[field] = counts.get(field, 0) + 1
    values: dict[str, object] = {}
    for field, total in sums.items():
        v = total / counts[field] if field in _RATIOS else total
        values[field] = min(1.0, max(0.0, v)) if field in _RATIOS else max(0.0, v)
    for field, per in by_class.items():
        values[field] = (per[0], per[1], per[2])
    return ReplicaLoad(**values, lora_adapters=adapters)  # type: ignore[arg-type]


_ADAPTER_SERIES = ("sluice_lora_adapter_loaded", "vllm:lora_requests_info")
_WANTED = frozenset((*_FIELDS, *_BY_CLASS, *_ADAPTER_SERIES))


def _wanted_lines(text: str) -> str:
    """The page's lines of the series read here (samples, and their ``# TYPE``/``# HELP``).

    NOTE(scrape-filter): the gateway parses each replica's page on its event loop,
    every ``scrape_interval``.  A sluice page is hundreds of lines, nearly all
    histogram buckets the gateway never reads; parsing it whole stalled the loop
    for tens of milliseconds a scrape, and a request arriving in a stall waited
    it out (it was the tail of the gateway's 429 latency).  Only the few gauges
    read here go to the parser; any other line is checked to end in a number,
    so a page that is not Prometheus text still raises ``ValueError``.
    """
    keep = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line[0] == "#":
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("TYPE", "HELP") and parts[2] in _WANTED:
                keep.append(line)
            continue
        name = line.split("{", 1)[0].split(None, 1)
        if name and name[0] in _WANTED:
            keep.append(line)
            continue
        try:
            float(line.rsplit(None, 1)[-1])
        except ValueError:
            raise ValueError(f"not Prometheus text: {line[:80]!r}") from None
    return "\n".join(keep) + "\n" if keep else ""


def _read_adapters(name: str, labels: Mapping[str, str], value: float, out: dict[str, bool]) -> None:
    if name == "sluice_lora_adapter_loaded":
        adapter = labels.get("adapter")
        if adapter:
            out[adapter] = out.get(adapter, False) or value >= 1.0
        return
    # vLLM: one sample per change, labels running_lora_adapters / waiting_lora_adapters = "a,b"
    for key in ("running_lora_adapters", "waiting_lora_adapters"):
        for adapter in filter(None, (labels.get(key) or "").split(",")):
            out[adapter.strip()] = True
