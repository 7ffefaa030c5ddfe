"""``sluice doctor``'s warnings: each a problem seen in the report and the fix for it.

``advise(report)`` is pure (the report dict in, ``Advice`` out), so tests feed
it fake machines.  What it checks:

- threads over cores: torch's intra-op threads against the usable cores and
  the physical ones (SMT siblings share one core's vector units);
- a GPU on a degraded PCIe link (generation or width below its maximum);
- placement: an engine started from this shell would not run on its GPU's
  NUMA node, or would spread over several nodes;
- kernels: a C++ extension that is missing or JIT-built, the scalar GEMM path;
- exposure: the ``sluice serve`` this environment configures (``SLUICE_HOST``,
  ``SLUICE_API_KEY``, ``SLUICE_CONFIG``, ...) would listen beyond loopback with
  no API keys (the ``serve`` probe, ``sluice.server.admin.doctor_report``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sluice.obs.topology import format_cpulist

__all__ = ["Advice", "advise"]


@dataclass(frozen=True)
class Advice:
    topic: str  # threads | pcie | placement | kernels | exposure
    problem: str
    fix: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def advise(report: dict[str, Any]) -> list[Advice]:
    return [*_threads(report), *_pcie(report), *_placement(report), *_kernels(report), *_exposure(report)]


def _threads(r: dict[str, Any]) -> list[Advice]:
    threads, cpu = r.get("torch_threads"), r.get("cpu") or {}
    usable, physical = cpu.get("usable_cpus"), cpu.get("physical_cores")
    if not threads:
        return []
    if usable and threads > usable:
        return [Advice("threads", f"torch would run {threads} threads on {usable} usable cores: they take turns "
                                  "and every engine step waits for the slowest",
                       f"sluice serve --num-threads {usable} (or --cpu-affinity auto, which sets it)")]  # fmt: skip
    if physical and usable and threads > physical and usable > physical:
        return [Advice("threads", f"{threads} torch threads on {physical} physical cores: SMT siblings share "
                                  "one core's vector units, so the extra threads add contention, not speed",
                       f"sluice serve --num-threads {physical}")]  # fmt: skip
    return []


def _pcie(r: dict[str, Any]) -> list[Advice]:
    out = []
    for g in (r.get("topology") or {}).get("gpus", []):
        link = g.get("link") or {}
        if not link.get("is_degraded"):
            continue
        now = f"gen{link.get('gen')} x{link.get('width')}"
        top = f"gen{link.get('max_gen')} x{link.get('max_width')}"
        fix = "move it to a x16 slot or reseat it, and check the BIOS PCIe settings"
        if link.get("width") == link.get("max_width"):
            # NOTE(idle-link): GPUs lower their link generation while idle to save power.
            fix = ("check again under load (nvidia-smi -q -d PCIE): an idle GPU lowers its link generation; "
                   "if it stays low, " + fix)
        out.append(Advice("pcie", f"GPU {g['address']} ({g.get('name', '')}) runs PCIe {now}, its maximum is {top}", fix))
    return out


def _placement(r: dict[str, Any]) -> list[Advice]:
    topo = r.get("topology") or {}
    nodes = {n["node"]: set(n["cpus"]) for n in topo.get("nodes", [])}
    allowed = set(topo.get("allowed_cpus", []))
    if len(nodes) < 2 or not allowed:
        return []
    out = []
    gpus = topo.get("gpus", [])
    for g in gpus:
        i = [x for x in gpus if x.get("vendor") == g.get("vendor")].index(g)  # cuda:i, PCI bus order
        node = g.get("numa_node")
        if node is None or node not in nodes or allowed <= nodes[node]:
            continue
        out.append(Advice(
            "placement",
            f"an engine for GPU {g['address']} (NUMA node {node}, cpus {format_cpulist(sorted(nodes[node]))}) "
            f"started from here may run on cpus {format_cpulist(sorted(allowed))}: its host memory and "
            "threads would sit across the interconnect from the GPU",
            f"sluice serve --device cuda:{i} --cpu-affinity auto  (or numactl --cpunodebind={node} --membind={node})",
        ))
    spanned = [n for n, cpus in nodes.items() if cpus & allowed]
    if not gpus and len(spanned) > 1:
        out.append(Advice(
            "placement",
            f"an engine started from here would spread over NUMA nodes {', '.join(map(str, spanned))}: "
            "its threads would read memory across nodes every step",
            "sluice serve --cpu-affinity auto (one node), or one replica per node: the gateway's local "
            "launcher pins each replica inside one node",
        ))
    return out


def _kernels(r: dict[str, Any]) -> list[Advice]:
    k = r.get("kernels") or {}
    out = []
    for name, info in (k.get("extensions") or {}).items():
        how = info.get("how")
        if how == "unavailable":
            out.append(Advice("kernels", f"C++ extension {name!r} is unavailable: {info.get('error', '')}",
                              "reinstall with a compiler and torch present: make install "
                              "(pip install --no-build-isolation -e .)"))  # fmt: skip
        elif how == "jit":
            out.append(Advice("kernels", f"C++ extension {name!r} was compiled on first use ({info.get('why', '')})",
                              "build it at install time: make install (pip install --no-build-isolation -e .)"))
    if k.get("qlinear_paths") == ["scalar"]:
        out.append(Advice("kernels", "this CPU has no AVX2: quantized GEMMs run the scalar path (several times slower)",
                          "serve on a CPU with AVX2 or AVX-512 VNNI, or serve --quantization none"))
    return out


def _exposure(r: dict[str, Any]) -> list[Advice]:
    serve = r.get("serve") or {}
    if not serve.get("host") or serve.get("is_loopback") or serve.get("has_api_keys"):
        return []
    if serve.get("has_admin_key"):
        admin = "the admin endpoints need the admin key"
    elif serve.get("allow_admin_without_key"):
        admin = "and --allow-admin-without-key opens the admin endpoints to them too"
    else:
        admin = "the admin endpoints stay closed: no admin key"
    return [Advice("exposure", f"sluice serve would listen on {serve['host']}, beyond this machine, with no API "
                               f"keys: anyone who reaches the port can use the model ({admin})",
                   "set API keys (--api-key / --keys-file, SLUICE_API_KEY) and an admin key (--admin-key, "
                   "SLUICE_ADMIN_KEY), or bind --host 127.0.0.1 behind a proxy that authenticates")]  # fmt: skip
