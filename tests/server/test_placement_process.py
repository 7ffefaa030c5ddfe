"""``--cpu-affinity`` and ``--pyroscope-server`` on real processes: the engine core and every thread it made
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


def test_pyroscope_agent_in_both_processes_and_an_unreachable_server_does_not_matter(spawn) -> None:  # noqa: F811
    pytest.importorskip("pyroscope")
    import httpx

    proc, url = spawn("--pyroscope-server", "http://127.0.0.1:1")  # nothing listens there
    for _ in range(5):
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 8}, timeout=10)
        assert r.status_code == 200, "serving must not depend on the Pyroscope server"
    api = psutil.Process(proc.pid)
    for p in (api, _engine_core(api)):
        maps = Path(f"/proc/{p.pid}/maps").read_text()
        assert "pyroscope" in maps, f"the Pyroscope agent must run in process {p.pid} ({p.cmdline()[-1][:40]})"


def test_pyroscope_flag_without_the_package_is_a_clear_config_error(monkeypatch) -> None:
    import importlib.util

    from sluice.errors import ConfigError
    from sluice.server.config import load_settings
    from sluice.server.runner import _check_pyroscope

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyroscope" else real(name, *a))
    with pytest.raises(ConfigError, match=r"--pyroscope-server needs the pyroscope-io package: pip install"):
        _check_pyroscope(load_settings(model="fake", pyroscope_server="http://127.0.0.1:4040", environ={}))
