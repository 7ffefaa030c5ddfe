"""Topology readers on fake sysfs trees and the ``--cpu-affinity`` plan on fake topologies."""

from __future__ import annotations

import json

import pytest

from sluice.errors import ConfigError
from sluice.obs.placement import parse_affinity, plan_placement
from sluice.obs.topology import (
    PciLink,
    format_cpulist,
    gpu_of_device,
    pcie_generation,
    read_topology,
)
from tests.obs.fake_sysfs import FakeSys, topology, two_socket


def test_topology_reads_nodes_gpus_nics_and_links_from_sysfs(tmp_path) -> None:
    two_socket(tmp_path)
    topo = read_topology(tmp_path, allowed_cpus=range(16), use_nvml=False)
    assert [(n.node, n.cpus[0], n.cpus[-1], n.memory_gib) for n in topo.nodes] == [(0, 0, 7, 64.0), (1, 8, 15, 64.0)]
    assert [(g.address, g.vendor, g.numa_node) for g in topo.gpus] == [("0000:17:00.0", "NVIDIA", 0),
                                                                       ("0000:b1:00.0", "NVIDIA", 1)]
    assert not topo.gpus[0].link.is_degraded
    assert topo.gpus[1].link == PciLink(3, 8, 4, 16), "gen3 x8 in a gen4 x16 slot must be read as such"
    assert topo.gpus[1].link.is_degraded
    assert [(n.name, n.address, n.numa_node, n.speed_mbps) for n in topo.nics] == [
        ("eth0", "0000:18:00.0", 0, 100000), ("eth1", "0000:b2:00.0", 1, 100000)
    ], "virtual interfaces (lo) have no device and are not NICs"


def test_topology_without_numa_information_is_one_node_of_the_allowed_cpus(tmp_path) -> None:
    topo = read_topology(tmp_path, allowed_cpus=[0, 1], use_nvml=False)
    assert [(n.node, n.cpus) for n in topo.nodes] == [(0, (0, 1))]
    assert topo.gpus == () and topo.nics == ()


def test_unknown_numa_node_of_a_device_is_none(tmp_path) -> None:
    FakeSys(tmp_path).node(0, "0-3").gpu("0000:01:00.0", -1)
    assert read_topology(tmp_path, allowed_cpus=range(4), use_nvml=False).gpus[0].numa_node is None


def test_pcie_generation_and_cpulist_formatting() -> None:
    assert [pcie_generation(s) for s in ("2.5 GT/s PCIe", "8.0 GT/s PCIe", "32.0 GT/s PCIe", "Unknown")] == [1, 3, 5, None]
    assert format_cpulist([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


def test_cuda_device_maps_to_gpu_in_bus_order_through_cuda_visible_devices() -> None:
    topo = topology({0: range(8), 1: range(8, 16)}, gpu_nodes=(0, 1))
    assert gpu_of_device(topo, "cuda:1", {}).numa_node == 1
    assert gpu_of_device(topo, "cuda", {}).numa_node == 0
    assert gpu_of_device(topo, "cuda:0", {"CUDA_VISIBLE_DEVICES": "1"}).numa_node == 1
    assert gpu_of_device(topo, "cuda:0", {"CUDA_VISIBLE_DEVICES": "GPU-abc"}) is None
    assert gpu_of_device(topo, "cpu", {}) is None


def test_auto_puts_engine_on_its_gpus_node_and_keeps_one_core_there_for_the_api() -> None:
    topo = topology({0: range(8), 1: range(8, 16)}, gpu_nodes=(0, 1))
    p = plan_placement("auto", topo, "cuda:1", environ={})
    assert (p.engine_cpus, p.engine_node) == (tuple(range(8, 16)), 1)
    assert p.api_cpus == tuple(range(8)), "the API process goes to the cores the engine does not use"


def test_auto_on_cpu_uses_the_node_with_most_of_the_given_cores_and_reserves_an_api_core() -> None:
    topo = topology({0: range(8), 1: range(8, 16)}, allowed=[6, 7, 8, 9, 10, 11, 12])
    p = plan_placement("auto", topo, "cpu")
    assert (p.engine_cpus, p.engine_node, p.api_cpus) == ((8, 9, 10, 11, 12), 1, (6, 7))


def test_auto_within_one_node_takes_the_launchers_cores_minus_one_for_the_api() -> None:
    topo = topology({0: range(8), 1: range(8, 16)}, allowed=[8, 9, 10, 11])
    p = plan_placement("auto", topo, "cpu")
    assert (p.engine_cpus, p.engine_node, p.api_cpus) == ((8, 9, 10), 1, (11,))
    assert "given" in p.reason


def test_auto_with_few_cores_shares_them_with_the_api() -> None:
    p = plan_placement("auto", topology({0: range(2)}), "cpu")
    assert (p.engine_cpus, p.api_cpus) == ((0, 1), None), "2 cores are too few to split"


def test_auto_when_no_allowed_core_is_on_the_gpus_node_keeps_the_given_cores() -> None:
    topo = topology({0: range(8), 1: range(8, 16)}, allowed=range(4), gpu_nodes=(1,))
    p = plan_placement("auto", topo, "cuda:0", environ={})
    assert p.engine_cpus == (0, 1, 2) and "no allowed core" in p.reason


def test_a_list_is_taken_as_given_and_the_api_moves_to_the_rest() -> None:
    topo = topology({0: range(8), 1: range(8, 16)})
    p = plan_placement("0-3", topo, "cpu")
    assert (p.engine_cpus, p.engine_node, p.api_cpus) == ((0, 1, 2, 3), 0, tuple(range(4, 16)))
    spanning = plan_placement("6-9", topo, "cpu")
    assert spanning.engine_node is None, "cores on two nodes prefer no memory node"


def test_a_list_outside_the_allowed_cores_is_a_config_error_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--cpu-affinity: cpus 4-5 are not available .*allowed: 0-3"):
        plan_placement("2-5", topology({0: range(8)}, allowed=range(4)), "cpu")


@pytest.mark.parametrize("bad", ["", "x", "1-", "-3", "auto,1"])
def test_bad_affinity_specs_are_config_errors(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_affinity(bad)


# -- sluice doctor: topology, kernels and advice -------------------------------------------------


def _probe(threads: int = 2, paths: tuple[str, ...] = ("avx2", "scalar"), how: str = "prebuilt"):
    def probe() -> dict:
        return {"torch": "2.x", "torch_threads": threads, "gpus": [
            {"device": "cuda:1", "name": "H100", "memory_gib": 80.0, "capability": "9.0", "pci_address": "0000:b1:00.0"}],
            "kernels": {"extensions": {"quant": {"how": how, "why": "no build", "error": "no compiler"}},
                        "qlinear_paths": list(paths), "would_pick": paths[0]}}  # fmt: skip
    return probe


def test_doctor_reports_nodes_gpus_nics_links_and_joins_torch_gpus_by_pci_address(tmp_path) -> None:
    from sluice.obs.cli import collect_report, render

    two_socket(tmp_path)
    r = collect_report([_probe()], sys_root=tmp_path)
    assert [n["node"] for n in r["topology"]["nodes"]] == [0, 1]
    assert r["gpus"][0]["numa_node"] == 1 and r["gpus"][0]["link"]["is_degraded"], "torch GPU joined to its PCI node"
    text = render(r)
    for needle in ("node 1: cpus 8-15", "0000:b1:00.0", "DEGRADED", "eth1 (0000:b2:00.0): node 1, 100 Gb/s",
                   "would pick avx2"):  # fmt: skip
        assert needle in text, f"doctor output lacks {needle!r}:\n{text}"
    topics = {w["topic"] for w in r["warnings"]}
    assert "pcie" in topics, "a gen3 x8 GPU in a gen4 x16 slot must be flagged"
    assert json.loads(json.dumps(r)) == r, "--json must be plain JSON"


def test_advice_threads_over_cores_names_the_flag() -> None:
    from sluice.obs.advice import advise

    r = {"torch_threads": 16, "cpu": {"usable_cpus": 4, "physical_cores": 4}}
    (a,) = advise(r)
    assert a.topic == "threads" and "--num-threads 4" in a.fix
    smt = advise({"torch_threads": 16, "cpu": {"usable_cpus": 16, "physical_cores": 8}})
    assert smt and "--num-threads 8" in smt[0].fix
    assert advise({"torch_threads": 4, "cpu": {"usable_cpus": 4, "physical_cores": 4}}) == []


def test_advice_engine_not_on_its_gpus_node_and_spread_over_nodes() -> None:
    from sluice.obs.advice import advise

    topo = {"nodes": [{"node": 0, "cpus": list(range(8))}, {"node": 1, "cpus": list(range(8, 16))}],
            "allowed_cpus": list(range(16)),
            "gpus": [{"address": "0000:17:00.0", "name": "H100", "numa_node": 1, "link": {}}]}  # fmt: skip
    (a,) = advise({"topology": topo})
    assert a.topic == "placement" and "--cpu-affinity auto" in a.fix and "--cpunodebind=1" in a.fix
    pinned = {**topo, "allowed_cpus": list(range(8, 16))}
    assert advise({"topology": pinned}) == [], "an engine already on the GPU's node needs no advice"
    cpu_only = {**topo, "gpus": []}
    (b,) = advise({"topology": cpu_only})
    assert "nodes 0, 1" in b.problem and "--cpu-affinity auto" in b.fix


def test_advice_idle_link_generation_says_check_under_load_and_kernels_say_rebuild() -> None:
    from sluice.obs.advice import advise

    gpu = {"address": "0000:17:00.0", "name": "H100", "numa_node": None,
           "link": {"gen": 1, "width": 16, "max_gen": 5, "max_width": 16, "is_degraded": True}}  # fmt: skip
    (a,) = advise({"topology": {"gpus": [gpu], "nodes": [], "allowed_cpus": []}})
    assert "under load" in a.fix
    ks = advise({"kernels": {"extensions": {"quant": {"how": "jit", "why": "x"}}, "qlinear_paths": ["scalar"]}})
    assert [k.topic for k in ks] == ["kernels", "kernels"] and "make install" in ks[0].fix
