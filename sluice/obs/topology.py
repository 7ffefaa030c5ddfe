"""Where things sit on this machine: NUMA nodes, and the node and PCIe link of each GPU and NIC.

Pure readers of a sysfs tree (``sys_root``, ``/sys`` by default; tests build a
fake one in a temporary directory), plus NVML through ``pynvml`` when it is
installed (its PCIe figures are preferred: sysfs reports a link that is
throttled down while the GPU idles the same as a degraded one)::

    /sys/devices/system/node/node<N>/{cpulist,meminfo}      NUMA nodes
    /sys/bus/pci/devices/<addr>/{class,vendor,numa_node,     GPUs: display (0x0300) or 3D
        current_link_speed,current_link_width,               controllers (0x0302) of NVIDIA,
        max_link_speed,max_link_width}                       AMD
    /sys/class/net/<if>/device -> .../<pci addr>/...          NICs (virtual ones have no device)

Torch-free; ``sluice doctor`` and ``--cpu-affinity auto`` (``sluice.obs.placement``)
read it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sluice.obs.hardware import parse_cpulist

__all__ = [
    "NumaNode",
    "PciLink",
    "Gpu",
    "Nic",
    "Topology",
    "read_topology",
    "pcie_generation",
    "gpu_of_device",
    "node_of_cpus",
    "format_cpulist",
]

GPU_VENDORS = {"0x10de": "NVIDIA", "0x1002": "AMD"}
# GT/s per lane -> PCIe generation
_GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


@dataclass(frozen=True)
class NumaNode:
    node: int
    cpus: tuple[int, ...]
    memory_gib: float


@dataclass(frozen=True)
class PciLink:
    gen: int | None = None  # current PCIe generation (None: unknown)
    width: int | None = None  # current lanes
    max_gen: int | None = None
    max_width: int | None = None
    source: str = "sysfs"  # sysfs | nvml

    @property
    def is_degraded(self) -> bool:
        """Running below what the device and slot support (a known, lower gen or width)."""
        lower_gen = None not in (self.gen, self.max_gen) and self.gen < self.max_gen  # type: ignore[operator]
        lower_width = None not in (self.width, self.max_width) and self.width < self.max_width  # type: ignore[operator]
        return bool(lower_gen or lower_width)

    def describe(self) -> str:
        def part(gen: int | None, width: int | None) -> str:
            return f"gen{gen if gen is not None else '?'} x{width if width is not None else '?'}"

        return f"{part(self.gen, self.width)} (max {part(self.max_gen, self.max_width)}, {self.source})"


@dataclass(frozen=True)
class Gpu:
    address: str  # PCI address, 0000:17:00.0
    vendor: str  # NVIDIA | AMD
    name: str  # NVML's name, else the PCI device id
    numa_node: int | None  # None: the firmware does not say (single node, or a VM)
    link: PciLink = field(default_factory=PciLink)


@dataclass(frozen=True)
class Nic:
    name: str  # eth0
    address: str  # PCI address of the function behind it ('' when not on PCI)
    numa_node: int | None
    speed_mbps: int | None  # None: link down or unknown


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NumaNode, ...]
    gpus: tuple[Gpu, ...]
    nics: tuple[Nic, ...]
    allowed_cpus: tuple[int, ...]  # this process's affinity (what a launcher assigned)

    def node(self, node_id: int) -> NumaNode | None:
        return next((n for n in self.nodes if n.node == node_id), None)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (lists, not tuples), with each link's ``is_degraded``."""
        doc: dict[str, Any] = json.loads(json.dumps(asdict(self)))
        for g, gd in zip(self.gpus, doc["gpus"]):
            gd["link"]["is_degraded"] = g.link.is_degraded
        return doc


def pcie_generation(speed: str) -> int | None:
    """``'16.0 GT/s PCIe'`` -> 4; ``'Unknown'`` -> None."""
    m = re.match(r"\s*([0-9.]+)\s*GT/s", speed)
    if not m:
        return None
    return _GEN_BY_GTS.get(float(m.group(1)))


def format_cpulist(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8, 10, 11] -> ``0-3,8,10-11`` (the kernel's cpulist format)."""
    out: list[str] = []
    s = sorted(set(cpus))
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)


def node_of_cpus(nodes: Sequence[NumaNode], cpus: Sequence[int]) -> int | None:
    """The node holding all of ``cpus`` (None when they span nodes or nothing is known)."""
    wanted = set(cpus)
    for n in nodes:
        if wanted and wanted <= set(n.cpus):
            return n.node
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _numa(text: str | None) -> int | None:
    n = _int(text)
    return n if n is not None and n >= 0 else None  # -1: unknown


def _read_nodes(sys_root: Path) -> list[NumaNode]:
    nodes = []
    root = sys_root / "devices/system/node"
    for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        text = _read(d / "cpulist")
        if text is None:
            continue
        mem_kb = 0
        for line in (_read(d / "meminfo") or "").splitlines():
            if "MemTotal" in line:
                mem_kb = _int(line.split()[-2]) or 0
        nodes.append(NumaNode(int(d.name[4:]), tuple(parse_cpulist(text)), round(mem_kb / 2**20, 1)))
    return nodes


def _sysfs_link(d: Path) -> PciLink:
    return PciLink(
        gen=pcie_generation(_read(d / "current_link_speed") or ""),
        width=_int(_read(d / "current_link_width")),
        max_gen=pcie_generation(_read(d / "max_link_speed") or ""),
        max_width=_int(_read(d / "max_link_width")),
    )


def _read_gpus(sys_root: Path, nvml: Mapping[str, dict[str, Any]]) -> list[Gpu]:
    gpus = []
    for d in sorted((sys_root / "bus/pci/devices").glob("*")):
        cls = _read(d / "class") or ""
        vendor = GPU_VENDORS.get(_read(d / "vendor") or "")
        if vendor is None or not cls.startswith(("0x0300", "0x0302")):
            continue
        info = nvml.get(d.name.lower(), {})
        link = info.get("link") or _sysfs_link(d)
        name = info.get("name") or f"{vendor} {_read(d / 'device') or 'GPU'}"
        gpus.append(Gpu(d.name, vendor, name, _numa(_read(d / "numa_node")), link))
    return gpus


def _pci_ancestor(path: Path) -> Path | None:
    """The nearest directory up from ``path`` that is a PCI function (has numa_node)."""
    for p in (path, *path.parents):
        if re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", p.name) and (p / "numa_node").exists():
            return p
    return None


def _read_nics(sys_root: Path) -> list[Nic]:
    nics = []
    for d in sorted((sys_root / "class/net").glob("*")):
        dev = d / "device"
        if not dev.exists():
            continue  # lo, bridges, veths, ifb: no hardware behind them
        pci = _pci_ancestor(dev.resolve())
        speed = _int(_read(d / "speed"))
        nics.append(Nic(d.name, pci.name if pci else "", _numa(_read(pci / "numa_node")) if pci else None,
                        speed if speed is not None and speed > 0 else None))  # fmt: skip
    return nics


def _nvml_devices() -> dict[str, dict[str, Any]]:
    """PCI address -> {name, link} from NVML; empty without pynvml or a driver."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 -- no driver: sysfs only
        return {}
    out: dict[str, dict[str, Any]] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            bus = bus.decode() if isinstance(bus, bytes) else str(bus)
            name = pynvml.nvmlDeviceGetName(h)

            def q(fn: str, h: Any = h) -> int | None:
                try:
                    return int(getattr(pynvml, fn)(h))
                except Exception:  # noqa: BLE001 -- not supported on this device
                    return None

            link = PciLink(q("nvmlDeviceGetCurrPcieLinkGeneration"), q("nvmlDeviceGetCurrPcieLinkWidth"),
                           q("nvmlDeviceGetMaxPcieLinkGeneration"), q("nvmlDeviceGetMaxPcieLinkWidth"), "nvml")  # fmt: skip
            out[_short_bus_id(bus)] = {"name": name.decode() if isinstance(name, bytes) else str(name), "link": link}
    finally:
        pynvml.nvmlShutdown()
    return out


def _short_bus_id(bus: str) -> str:
    """NVML's ``00000000:17:00.0`` -> sysfs's ``0000:17:00.0``."""
    dom, _, rest = bus.lower().partition(":")
    return f"{int(dom, 16):04x}:{rest}" if rest else bus.lower()


def read_topology(
    sys_root: str | Path = "/sys",
    *,
    allowed_cpus: Sequence[int] | None = None,
    use_nvml: bool = True,
) -> Topology:
    root = Path(sys_root)
    if allowed_cpus is None:
        allowed_cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    nodes = _read_nodes(root)
    if not nodes:  # no NUMA information: one node with every allowed cpu
        nodes = [NumaNode(0, tuple(sorted(allowed_cpus)), 0.0)]
    nvml = _nvml_devices() if use_nvml else {}
    return Topology(tuple(nodes), tuple(_read_gpus(root, nvml)), tuple(_read_nics(root)), tuple(sorted(allowed_cpus)))


def gpu_of_device(topology: Topology, device: str, environ: Mapping[str, str] | None = None) -> Gpu | None:
    """The GPU behind a torch device name (``cuda:1``), or None (cpu, or unknown).

    NOTE(device-order): CUDA numbers the visible GPUs fastest first, ties in PCI
    bus order; on a serving machine (identical GPUs) that is PCI bus order,
    which is what this assumes (set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` to make it
    exact).  ``CUDA_VISIBLE_DEVICES`` indices are honoured; UUIDs are not
    resolved (None).
    """
    m = re.fullmatch(r"cuda(?::(\d+))?", device.strip())
    if m is None:
        return None
    index = int(m.group(1) or 0)
    nvidia = [g for g in topology.gpus if g.vendor == "NVIDIA"]
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if index >= len(entries) or not entries[index].isdigit():
            return None
        index = int(entries[index])
    return nvidia[index] if index < len(nvidia) else None
