"""``sluice doctor`` and ``sluice profile`` (registered by ``sluice.cli``).

``doctor``: Python version, CPU, NUMA nodes with their CPUs and memory, which
node each GPU and NIC sits on and its PCIe link (``sluice.obs.topology``),
memory, and what the probes that ``sluice.cli`` passes in add (the engine's:
torch, GPUs as torch sees them, the attention backend and the kernel paths,
``sluice.engine.doctor``); then warnings, each with its fix
(``sluice.obs.advice``).  ``--json`` prints one JSON document.

``profile``: ``sluice.obs.profile_cli``.
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import typer

__all__ = ["register", "doctor", "collect_report", "render", "Probe"]

# A probe adds keys to the report (the engine's: torch, gpus, attention, kernels).
Probe = Callable[[], dict[str, Any]]


def register(app: typer.Typer, probes: Sequence[Probe] = ()) -> None:
    from sluice.obs import profile_cli

    def doctor_command(
        as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
        sys_root: str = typer.Option("/sys", "--sys-root", hidden=True, help="sysfs root (tests)."),
    ) -> None:
        """Show the machine as sluice sees it (CPU, NUMA, GPUs, NICs, PCIe, kernels) and what to fix."""
        doctor(as_json, probes, sys_root=sys_root)

    app.command("doctor")(doctor_command)
    profile_cli.register(app)


def collect_report(probes: Sequence[Probe] = (), sys_root: str | Path = "/sys") -> dict[str, Any]:
    from sluice import __version__
    from sluice.obs import hardware
    from sluice.obs.advice import advise
    from sluice.obs.topology import read_topology

    report: dict[str, Any] = {
        "sluice": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": None,
        "gpus": [],
    }
    report["cpu"] = hardware.cpu_info()
    topo = read_topology(sys_root)
    report["topology"] = topo.to_json()
    report["numa"] = report["topology"]["nodes"]
    report["memory"] = hardware.memory_info()
    for probe in probes:
        report.update(probe())
    _join_gpus(report)
    report["warnings"] = [a.to_json() for a in advise(report)]
    return report


def _join_gpus(report: dict[str, Any]) -> None:
    """Give each torch GPU its NUMA node and link, by PCI address."""
    by_address = {g["address"]: g for g in report["topology"]["gpus"]}
    for g in report["gpus"]:
        pci = by_address.get(g.get("pci_address") or "")
        if pci is not None:
            g["numa_node"] = pci["numa_node"]
            g["link"] = pci["link"]


def doctor(as_json: bool, probes: Sequence[Probe] = (), sys_root: str | Path = "/sys") -> None:
    r = collect_report(probes, sys_root)
    if as_json:
        print(json.dumps(r))
        return
    sys.stdout.write(render(r))


def _span(cpus: Sequence[int]) -> str:
    from sluice.obs.topology import format_cpulist

    return format_cpulist(cpus) or "-"


def _node(n: int | None) -> str:
    return "node ?" if n is None else f"node {n}"


def render(r: dict[str, Any]) -> str:
    """The report as aligned lines for a terminal."""
    cpu, mem, att, topo = r["cpu"], r["memory"], r.get("attention"), r["topology"]
    lines = [
        f"sluice     {r['sluice']}  (Python {r['python']}, torch {r['torch'] or 'not installed'})",
        f"platform   {r['platform']}",
        f"cpu        {cpu['model']} ({cpu['arch']}): {cpu['physical_cores']} cores, "
        f"{cpu['logical_cpus']} threads, {cpu['usable_cpus']} usable ({_span(topo['allowed_cpus'])}); "
        f"SIMD: {', '.join(cpu['simd']) or 'none'}",
    ]
    if r.get("torch_threads"):
        lines.append(f"torch      {r['torch_threads']} intra-op threads")
    for n in topo["nodes"]:
        lines.append(f"numa       node {n['node']}: cpus {_span(n['cpus'])}, {n['memory_gib']} GiB")
    lines.append(f"memory     {mem['total_gib']} GiB total, {mem['available_gib']} GiB available")
    for g in topo["gpus"]:
        link = g["link"]
        state = "DEGRADED" if link["is_degraded"] else "ok"
        lines.append(f"pci gpu    {g['address']} {g['name']}: {_node(g['numa_node'])}, PCIe gen{link['gen']} "
                     f"x{link['width']} (max gen{link['max_gen']} x{link['max_width']}, {link['source']}) {state}")  # fmt: skip
    for g in r["gpus"]:
        where = f", {_node(g['numa_node'])}" if "numa_node" in g else ""
        lines.append(f"gpu        {g['device']}: {g['name']}, {g['memory_gib']} GiB, sm {g['capability']}{where}")
    if not r["gpus"] and not topo["gpus"]:
        lines.append("gpu        none (CPU serving)")
    for n in topo["nics"]:
        speed = f"{n['speed_mbps'] / 1000:g} Gb/s" if n["speed_mbps"] else "speed unknown"
        lines.append(f"nic        {n['name']} ({n['address'] or 'not PCI'}): {_node(n['numa_node'])}, {speed}")
    if att is not None and att.get("error"):
        lines.append(f"attention  unavailable: {att['error']}")
    elif att is not None:
        lines.append(f"attention  {att['chosen']} on {att['device']} (available: {', '.join(att['available'])})")
    k = r.get("kernels")
    if k is not None and k.get("error"):
        lines.append(f"kernels    unavailable: {k['error']}")
    elif k is not None:
        exts = ", ".join(f"{name} {info.get('how')}" for name, info in k.get("extensions", {}).items())
        lines.append(f"kernels    {exts or 'none'}; quantized GEMM paths: {', '.join(k.get('qlinear_paths', []))} "
                     f"(would pick {k.get('would_pick')}; measured per shape at start-up)")  # fmt: skip
    m = r.get("model")
    if m is not None and m.get("error"):
        lines.append(f"model      {m['name']}: unavailable: {m['error']}")
    elif m is not None:
        lines.append(f"model      {m['name']}: {_model_line(m)}")
    warnings = r.get("warnings", [])
    if warnings:
        lines.append("")
        for w in warnings:
            lines.append(f"warning    [{w['topic']}] {w['problem']}")
            lines.append(f"   fix     {w['fix']}")
    else:
        lines.append("advice     nothing to fix")
    return "\n".join(lines) + "\n"


def _model_line(m: dict[str, Any]) -> str:
    """``llama, 134.5M parameters, 98.4 MB of weights`` (MoE: ``30.5B parameters, 3.3B active per token``)."""
    total, active = m["num_parameters"], m["num_active_parameters"]
    moe = f", {_count(active)} active per token ({m['num_experts_per_token']} of {m['num_experts']} experts)" if active != total else ""
    return f"{m['architecture']}, {_count(total)} parameters{moe}, {m['weight_file_bytes'] / 1e6:.1f} MB of weight files"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
