"""``--cpu-affinity auto|LIST``: which cores and memory node the engine core gets,
and where the API process goes.

``plan_placement`` is pure (a ``Topology`` in, a ``Placement`` out), so fake
topologies test it; ``apply_placement`` is the I/O: it pins the calling
process (``sched_setaffinity``) and prefers its memory node
(``set_mempolicy(MPOL_PREFERRED)``).  The engine core process applies its part
first thing, before torch starts its threads, so every thread it makes
inherits the mask and the policy::

    auto   GPU device:  the cores of the GPU's NUMA node that this process may use
           CPU device:  the cores this process was given (a launcher's assignment),
                        or, when they span nodes, those of the node with most of them
    LIST   0-7,16-23:   exactly those cores (they must be allowed)

    API process: the allowed cores the engine does not use, when there are any;
    with ``auto`` and a node of >= 4 cores, one core of the engine's node is kept
    for it (HTTP, tokenization, detokenization); otherwise it shares.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from sluice.errors import ConfigError
from sluice.obs.hardware import parse_cpulist
from sluice.obs.topology import Topology, format_cpulist, gpu_of_device, node_of_cpus

__all__ = ["Placement", "parse_affinity", "plan_placement", "apply_placement", "MIN_CORES_TO_SPLIT"]

log = logging.getLogger("sluice.placement")

# With ``auto``, a node of at least this many cores keeps one for the API process.
MIN_CORES_TO_SPLIT = 4

_MPOL_PREFERRED = 1
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}


@dataclass(frozen=True)
class Placement:
    engine_cpus: tuple[int, ...]
    engine_node: int | None  # memory node preferred by the engine (None: leave the default)
    api_cpus: tuple[int, ...] | None  # None: the API process stays where it is
    reason: str  # one line, printed at start-up

    def describe(self) -> str:
        node = f" (NUMA node {self.engine_node})" if self.engine_node is not None else ""
        api = f"API process on cpus {format_cpulist(self.api_cpus)}" if self.api_cpus else "API process shares them"
        return f"engine core on cpus {format_cpulist(self.engine_cpus)}{node}; {api}: {self.reason}"


def parse_affinity(spec: str) -> str | tuple[int, ...]:
    """``auto`` or a cpulist (``0-3,8``) -> 'auto' or the cores; ``ConfigError`` otherwise."""
    text = spec.strip().lower()
    if text == "auto":
        return "auto"
    cpus = tuple(sorted(set(parse_cpulist(text)))) if re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text) else ()
    if not cpus:
        raise ConfigError(f"expected 'auto' or a cpu list such as 0-3,8, got {spec!r}",
                          setting="cpu_affinity")  # fmt: skip
    return cpus


def plan_placement(
    spec: str, topology: Topology, device: str = "cpu", environ: Mapping[str, str] | None = None
) -> Placement:
    allowed = set(topology.allowed_cpus)
    wanted = parse_affinity(spec)
    if wanted != "auto":
        assert isinstance(wanted, tuple)
        outside = sorted(set(wanted) - allowed)
        if outside:
            raise ConfigError(f"--cpu-affinity: cpus {format_cpulist(outside)} are not available to this process "
                              f"(allowed: {format_cpulist(sorted(allowed))})", setting="cpu_affinity")  # fmt: skip
        others = tuple(sorted(allowed - set(wanted)))
        return Placement(wanted, node_of_cpus(topology.nodes, wanted), others or None, "as given")
    gpu = gpu_of_device(topology, device, environ)
    engine: list[int]
    if gpu is not None and gpu.numa_node is not None:
        node = topology.node(gpu.numa_node)
        engine = sorted(set(node.cpus) & allowed) if node else []
        reason = f"the node of {device} ({gpu.address})"
        if not engine:
            engine, reason = sorted(allowed), f"no allowed core is on the node of {device}: kept the given cores"
    else:
        by_node = [(n, sorted(set(n.cpus) & allowed)) for n in topology.nodes]
        by_node = [(n, cpus) for n, cpus in by_node if cpus]
        if len(by_node) <= 1:
            engine = sorted(allowed)
            reason = "the cores this process was given" if len(allowed) < _num_cpus(topology) else "all cores"
        else:
            n, engine = max(by_node, key=lambda item: (len(item[1]), -item[0].node))
            reason = f"node {n.node}, the one with most of the given cores"
    rest = sorted(allowed - set(engine))
    if not rest and len(engine) >= MIN_CORES_TO_SPLIT:
        # NOTE(api-core): the API process tokenizes and streams for every request;
        # on a busy CPU engine it must not wait for a time slice on the engine's cores.
        rest = [engine.pop()]
    return Placement(tuple(engine), node_of_cpus(topology.nodes, engine), tuple(rest) or None, reason)


def _num_cpus(topology: Topology) -> int:
    return sum(len(n.cpus) for n in topology.nodes)


def apply_placement(cpus: tuple[int, ...], node: int | None = None) -> list[str]:
    """Pin this process to ``cpus`` and prefer memory of ``node``; returns what could not be done."""
    problems: list[str] = []
    if cpus and hasattr(os, "sched_setaffinity"):
        # every thread already running (ZeroMQ's I/O thread, ...), then this one:
        # threads made later inherit the calling thread's mask
        for tid in [*_other_threads(), 0]:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError as e:
                if tid == 0 or e.errno != errno.ESRCH:  # a thread that just exited is fine
                    problems.append(f"sched_setaffinity({format_cpulist(cpus)}): {e.strerror}")
                    break
    if node is not None:
        problem = _prefer_node(node)
        if problem:
            problems.append(problem)
    for p in problems:
        log.warning("placement: %s", p)
    return problems


def _other_threads() -> list[int]:
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []
    return [t for t in tids if t != threading.get_native_id()]


def _prefer_node(node: int) -> str | None:
    """``set_mempolicy(MPOL_PREFERRED, {node})``: allocate there, fall back elsewhere when full."""
    nr = _SYS_SET_MEMPOLICY.get(platform.machine())
    if not 0 <= node < 64:
        return f"set_mempolicy: node {node} is out of range"
    if nr is None:
        return f"set_mempolicy: unknown syscall number on {platform.machine()}"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_ulong(1 << node)
        if libc.syscall(nr, _MPOL_PREFERRED, ctypes.byref(mask), ctypes.sizeof(mask) * 8 + 1) != 0:
            return f"set_mempolicy(node {node}): {os.strerror(ctypes.get_errno())}"
    except (OSError, AttributeError) as e:
        return f"set_mempolicy(node {node}): {e}"
    return None
