"""``--cpu-affinity`` on real processes: the engine core and every thread it made
run on the given cores with its memory preferred on their node; the API process
moved off them (read back with ``os.sched_getaffinity`` and ``/proc``)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from tests.server.test_process import spawn  # noqa: F401 -- fixture

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores"
)


def _engine_core(api: psutil.Process) -> psutil.Process:
    for child in api.children():
        if "spawn_main" in " ".join(child.cmdline()):
            return child
    raise AssertionError(f"no engine core process under {api.pid}")


def test_engine_core_threads_and_memory_on_the_given_cores_api_process_off_them(spawn) -> None:  # noqa: F811
    cores = sorted(os.sched_getaffinity(0))
    engine_core, rest = cores[0], set(cores[1:])
    proc, _url = spawn("--cpu-affinity", str(engine_core))
    api = psutil.Process(proc.pid)
    engine = _engine_core(api)
    assert os.sched_getaffinity(api.pid) == rest, "the API process must leave the engine's core to the engine"
    threads = [t.id for t in engine.threads()]
    assert threads, "the engine core has at least its main thread"
    for tid in threads:
        assert os.sched_getaffinity(tid) == {engine_core}, f"engine thread {tid} runs outside --cpu-affinity"
    numa_maps = Path(f"/proc/{engine.pid}/numa_maps")
    if numa_maps.exists() and Path("/sys/devices/system/node/node0").exists():
        assert "prefer:0" in numa_maps.read_text(), "the engine core's memory policy must prefer its node"


def test_without_the_flag_nothing_is_pinned(spawn) -> None:  # noqa: F811
    proc, _url = spawn()
    api = psutil.Process(proc.pid)
    mine = os.sched_getaffinity(0)
    assert os.sched_getaffinity(api.pid) == mine
    assert os.sched_getaffinity(_engine_core(api).pid) == mine
