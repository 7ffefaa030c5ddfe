"""``sluice doctor``: what sluice sees on this machine (registered by ``sluice.cli``).

Python version, CPU and NUMA topology, memory, GPUs, and what the probes that
``sluice.cli`` passes in add (the engine's: torch and the attention backend it
would choose, ``sluice.engine.doctor``).  ``--json`` prints one JSON document.
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable, Sequence
from typing import Any

import typer

__all__ = ["register", "doctor", "collect_report", "Probe"]

# A probe adds keys to the report (the engine's: torch, gpus, attention).
Probe = Callable[[], dict[str, Any]]


def register(app: typer.Typer, probes: Sequence[Probe] = ()) -> None:
    def doctor_command(as_json: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
        """Show the machine as sluice sees it: versions, CPU/NUMA, memory, GPUs, attention backend."""
        doctor(as_json, probes)

    app.command("doctor")(doctor_command)


def collect_report(probes: Sequence[Probe] = ()) -> dict[str, Any]:
    from sluice import __version__
    from sluice.obs import hardware

    report: dict[str, Any] = {
        "sluice": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": None,
        "gpus": [],
    }
    report["cpu"] = hardware.cpu_info()
    report["numa"] = hardware.numa_nodes()
    report["memory"] = hardware.memory_info()
    for probe in probes:
        report.update(probe())
    return report


def doctor(as_json: bool, probes: Sequence[Probe] = ()) -> None:
    r = collect_report(probes)
    if as_json:
        print(json.dumps(r))
        return
    cpu, mem, att = r["cpu"], r["memory"], r.get("attention")
    lines = [
        f"sluice     {r['sluice']}  (Python {r['python']}, torch {r['torch'] or 'not installed'})",
        f"platform   {r['platform']}",
        f"cpu        {cpu['model']} ({cpu['arch']}): {cpu['physical_cores']} cores, "
        f"{cpu['logical_cpus']} threads, {cpu['usable_cpus']} usable; SIMD: {', '.join(cpu['simd']) or 'none'}",
    ]
    if r.get("torch_threads"):
        lines.append(f"torch      {r['torch_threads']} intra-op threads")
    for n in r["numa"]:
        cpus = n["cpus"]
        span = f"{cpus[0]}-{cpus[-1]}" if cpus and cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))
        lines.append(f"numa       node {n['node']}: cpus {span}, {n['memory_gib']} GiB")
    if not r["numa"]:
        lines.append("numa       no NUMA information (single node)")
    lines.append(f"memory     {mem['total_gib']} GiB total, {mem['available_gib']} GiB available")
    if r["gpus"]:
        for g in r["gpus"]:
            lines.append(f"gpu        {g['device']}: {g['name']}, {g['memory_gib']} GiB, sm {g['capability']}")
    else:
        lines.append("gpu        none (CPU serving)")
    if att is not None and att.get("error"):
        lines.append(f"attention  unavailable: {att['error']}")
    elif att is not None:
        lines.append(f"attention  {att['chosen']} on {att['device']} (available: {', '.join(att['available'])})")
    sys.stdout.write("\n".join(lines) + "\n")
