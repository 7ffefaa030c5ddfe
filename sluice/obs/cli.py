"""``sluice doctor``: what sluice sees on this machine (registered by ``sluice.cli``).

Python / torch versions, CPU and NUMA topology, memory, GPUs, and the
attention backend the engine would choose.  ``--json`` prints one JSON document.
"""

from __future__ import annotations

import json
import platform
import sys
from typing import Any

import typer

__all__ = ["register", "doctor", "collect_report"]


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)


def _attention(device: str) -> dict[str, Any]:
    try:
        from sluice.engine.attention import available_backends
    except Exception as e:  # noqa: BLE001 -- torch missing or broken: say so, do not crash
        return {"device": device, "available": [], "chosen": None, "error": f"{type(e).__name__}: {e}"}
    names = available_backends(device)
    # NOTE(backend-choice): mirrors EngineCore's default (make_attention_backend(None, ...)).
    chosen = "cpu_paged" if device == "cpu" and "cpu_paged" in names else names[0] if names else None
    return {"device": device, "available": names, "chosen": chosen}


def collect_report() -> dict[str, Any]:
    from sluice import __version__
    from sluice.obs import hardware

    report: dict[str, Any] = {
        "sluice": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import torch

        report["torch"] = torch.__version__
        report["torch_threads"] = torch.get_num_threads()
    except ImportError:
        report["torch"] = None
    report["cpu"] = hardware.cpu_info()
    report["numa"] = hardware.numa_nodes()
    report["memory"] = hardware.memory_info()
    report["gpus"] = hardware.accelerators()
    device = "cuda" if report["gpus"] else "cpu"
    report["attention"] = _attention(device)
    return report


def doctor(as_json: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
    """Show the machine as sluice sees it: versions, CPU/NUMA, memory, GPUs, attention backend."""
    r = collect_report()
    if as_json:
        print(json.dumps(r))
        return
    cpu, mem, att = r["cpu"], r["memory"], r["attention"]
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
    if att.get("error"):
        lines.append(f"attention  unavailable: {att['error']}")
    else:
        lines.append(f"attention  {att['chosen']} on {att['device']} (available: {', '.join(att['available'])})")
    sys.stdout.write("\n".join(lines) + "\n")
