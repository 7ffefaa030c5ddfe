"""Host gauges read at scrape time (psutil): CPU and memory use, 0..1.

The gateway reads ``sluice_host_cpu_utilization_ratio`` and
``sluice_host_memory_used_ratio`` from every replica's ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator

import psutil
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["HostCollector"]


class HostCollector(Collector):
    def __init__(self) -> None:
        # NOTE(cpu-percent): psutil measures CPU use since the previous call; the
        # first call primes it, later scrapes report the interval in between.
        psutil.cpu_percent(interval=None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "sluice_host_cpu_utilization_ratio",
            "Host CPU utilisation since the previous scrape, 0..1.",
            value=psutil.cpu_percent(interval=None) / 100.0,
        )
        yield GaugeMetricFamily(
            "sluice_host_memory_used_ratio",
            "Host memory in use, 0..1.",
            value=psutil.virtual_memory().percent / 100.0,
        )
