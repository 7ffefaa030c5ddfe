"""What machine are we on: CPU / NUMA topology, memory (for ``sluice doctor``).

Pure readers of ``/proc``, ``/sys`` and psutil, torch-free (the GPUs torch
sees are the engine's part of the report: ``sluice.engine.doctor``).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import psutil

__all__ = ["cpu_info", "numa_nodes", "memory_info", "parse_cpulist"]


def parse_cpulist(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def cpu_info() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma") if f in flags]
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {
        "model": model,
        "arch": platform.machine(),
        "logical_cpus": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cpus": len(affinity) or psutil.cpu_count(logical=True),
        "simd": simd,
    }


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> list[dict[str, Any]]:
    nodes = []
    for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpulist((d / "cpulist").read_text())
        except OSError:
            continue
        mem_kb = 0
        try:
            for line in (d / "meminfo").read_text().splitlines():
                if "MemTotal" in line:
                    mem_kb = int(line.split()[-2])
        except (OSError, ValueError):
            pass
        nodes.append({"node": int(d.name[4:]), "cpus": cpus, "memory_gib": round(mem_kb / 2**20, 1)})
    return nodes


def memory_info() -> dict[str, float]:
    vm = psutil.virtual_memory()
    return {"total_gib": round(vm.total / 2**30, 1), "available_gib": round(vm.available / 2**30, 1)}
