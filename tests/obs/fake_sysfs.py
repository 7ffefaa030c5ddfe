"""Fake ``/sys`` trees for topology and doctor tests: NUMA nodes, GPUs, NICs."""

from __future__ import annotations

from pathlib import Path

from sluice.obs.topology import Gpu, NumaNode, PciLink, Topology


class FakeSys:
    """Builds a sysfs-shaped directory under ``root``."""

    def __init__(self, root: Path):
        self.root = root

    def node(self, node: int, cpus: str, mem_kb: int = 64 * 2**20) -> FakeSys:
        d = self.root / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {node} MemTotal:       {mem_kb} kB\n")
        return self

    def pci(self, address: str, cls: str, vendor: str, numa_node: int, *, speed: str = "16.0 GT/s PCIe",
            width: int = 16, max_speed: str = "16.0 GT/s PCIe", max_width: int = 16) -> Path:  # fmt: skip
        d = self.root / "devices/pci0000:00" / address
        d.mkdir(parents=True)
        for name, value in (("class", cls), ("vendor", vendor), ("device", "0x2335"), ("numa_node", str(numa_node)),
                            ("current_link_speed", speed), ("current_link_width", str(width)),
                            ("max_link_speed", max_speed), ("max_link_width", str(max_width))):  # fmt: skip
            (d / name).write_text(value + "\n")
        bus = self.root / "bus/pci/devices"
        bus.mkdir(parents=True, exist_ok=True)
        (bus / address).symlink_to(d)
        return d

    def gpu(self, address: str, numa_node: int, **link: object) -> FakeSys:
        self.pci(address, "0x030200", "0x10de", numa_node, **link)  # type: ignore[arg-type]
        return self

    def nic(self, name: str, address: str, numa_node: int, speed_mbps: int = 100000) -> FakeSys:
        pci = self.pci(address, "0x020000", "0x15b3", numa_node)
        virt = pci / "net_dev"  # the netdev sits below its PCI function, as virtio does
        virt.mkdir()
        d = self.root / "class/net" / name
        d.mkdir(parents=True)
        (d / "device").symlink_to(virt)
        (d / "speed").write_text(f"{speed_mbps}\n")
        return self

    def virtual_nic(self, name: str) -> FakeSys:
        (self.root / "class/net" / name).mkdir(parents=True)
        return self


def two_socket(tmp_path: Path) -> FakeSys:
    """2 nodes x 8 cpus, a GPU and a NIC on each node, GPU 1 on a degraded link."""
    return (
        FakeSys(tmp_path)
        .node(0, "0-7").node(1, "8-15")
        .gpu("0000:17:00.0", 0)
        .gpu("0000:b1:00.0", 1, speed="8.0 GT/s PCIe", width=8)
        .nic("eth0", "0000:18:00.0", 0)
        .nic("eth1", "0000:b2:00.0", 1)
        .virtual_nic("lo")
    )


def topology(nodes: dict[int, range], allowed: range | list[int] | None = None,
             gpu_nodes: tuple[int, ...] = ()) -> Topology:  # fmt: skip
    """A ``Topology`` without a sysfs tree (placement tests)."""
    nn = tuple(NumaNode(i, tuple(cpus), 64.0) for i, cpus in nodes.items())
    gpus = tuple(Gpu(f"0000:{17 + i:02x}:00.0", "NVIDIA", "H100", node, PciLink(5, 16, 5, 16))
                 for i, node in enumerate(gpu_nodes))  # fmt: skip
    every = [c for n in nn for c in n.cpus]
    return Topology(nn, gpus, (), tuple(allowed if allowed is not None else every))
