"""Launchers: core assignment (pure), NUMA discovery, the pin wrapper, and the
local launcher's process life cycle (launch, pinning, crash restart with
backoff, stop) on fake replica processes (``python -m sluice.bench.fake_server``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sluice.gateway.config import LauncherConfig, LauncherName
from sluice.gateway.launchers import ReplicaSpec, make_launcher
from sluice.gateway.launchers.base import serve_argv
from sluice.gateway.launchers.local import LocalLauncher, assign_cores, numa_nodes
from sluice.gateway.launchers.pin import parse_cores


def test_assign_cores_keeps_a_replica_inside_one_numa_node_and_spreads_replicas() -> None:
    nodes = [[0, 1, 2, 3], [4, 5, 6, 7]]
    a = assign_cores(nodes, [], 2)
    b = assign_cores(nodes, [a], 2)
    assert a == (0, 1) and b == (4, 5), f"the second replica must go to the emptier node: {a} {b}"
    c = assign_cores(nodes, [a, b], 2)
    d = assign_cores(nodes, [a, b, c], 2)
    assert set(c).isdisjoint(a + b) and set(d).isdisjoint(a + b + c), "free cores first"
    assert len({x // 4 for x in c}) == 1, "two free cores fit in one node: do not straddle nodes"
    e = assign_cores(nodes, [a, b, c, d], 2)
    assert len(e) == 2, "an oversubscribed machine still starts the replica, on shared cores"
    assert assign_cores([[0, 1]], [], 8) == (0, 1), "never more cores than exist"
    assert assign_cores([[0], [1]], [(0,)], 1) == (1,)


def test_numa_nodes_reads_sysfs_and_respects_affinity(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "cpulist").write_text(f"{allowed[0]}\n")
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "cpulist").write_text("900-901\n")  # cores we may not use
    assert numa_nodes(str(tmp_path)) == [[allowed[0]]], "nodes are intersected with the allowed cores"
    assert numa_nodes(str(tmp_path / "missing")) == [allowed], "no sysfs: one node of all allowed cores"
    assert parse_cores("0,2-4,7") == {0, 2, 3, 4, 7}


def test_pin_wrapper_sets_affinity_before_exec() -> None:
    core = sorted(os.sched_getaffinity(0))[-1]
    out = subprocess.run(
        [sys.executable, "-m", "sluice.gateway.launchers.pin", str(core), "--",
         sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == f"[{core}]", f"the command must run on the pinned core only: {out.stdout}"
    bad = subprocess.run([sys.executable, "-m", "sluice.gateway.launchers.pin", "0"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_serve_argv_and_factory() -> None:
    spec = ReplicaSpec("m", "v1", "/models/x", served_model_name="x", extra_args=("--kv-cache-memory", "64MiB"))
    argv = serve_argv(spec, "127.0.0.1", 8123)
    assert argv[1:4] == ["-m", "sluice.cli", "serve"] and argv[argv.index("--port") + 1] == "8123"
    assert argv[-2:] == ["--kv-cache-memory", "64MiB"] and "--served-model-name" in argv
    assert make_launcher(LauncherConfig()).name is LauncherName.LOCAL


def _fake_argv(spec: ReplicaSpec, host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "sluice.bench.fake_server", "--host", host, "--port", str(port)]


def _affinity(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


async def test_local_launcher_pins_restarts_a_killed_replica_with_backoff_and_stops(tmp_path: Path) -> None:
    cfg = LauncherConfig(cpus_per_replica=1, ready_timeout_s=30, restart_backoff_s=0.2, stop_timeout_s=2)
    launcher = LocalLauncher(cfg, log_dir=str(tmp_path), command=_fake_argv)
    spec = ReplicaSpec("m", "v1", "unused")
    try:
        a, b = await asyncio.gather(launcher.launch(spec), launcher.launch(spec))
        async with httpx.AsyncClient(timeout=5) as http:
            for r in (a, b):
                assert (await http.get(r.url + "/health")).status_code == 200, "launch returns a healthy replica"
            pid_a = launcher.pid(a)
            assert pid_a is not None and _affinity(pid_a) == set(a.cores), "the replica runs on its own cores"
            if len(os.sched_getaffinity(0)) >= 2:
                assert set(a.cores).isdisjoint(b.cores), "two replicas on a 2+ core machine get different cores"
            os.kill(pid_a, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                pid = launcher.pid(a)
                if pid is not None and pid != pid_a:
                    try:
                        if (await http.get(a.url + "/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                await asyncio.sleep(0.1)
            assert launcher.pid(a) != pid_a and a.num_restarts == 1, "a killed replica must be restarted"
            assert (await http.get(a.url + "/health")).status_code == 200, "restarted on the same url"
            await launcher.stop(b)
            with pytest.raises(httpx.TransportError):
                await http.get(b.url + "/health")
            assert [r.id for r in launcher.replicas()] == [a.id]
    finally:
        await launcher.close()
    assert launcher.replicas() == []


async def test_a_replica_that_cannot_start_fails_launch_with_its_log(tmp_path: Path) -> None:
    def broken(spec: ReplicaSpec, host: str, port: int) -> list[str]:
        return [sys.executable, "-c", "import sys; print('boom: no model', file=sys.stderr); sys.exit(3)"]

    launcher = LocalLauncher(LauncherConfig(ready_timeout_s=20), log_dir=str(tmp_path), command=broken)
    with pytest.raises(RuntimeError, match="boom: no model"):
        await launcher.launch(ReplicaSpec("m", "v1", "x"))
    assert launcher.replicas() == [], "a failed launch leaves nothing behind"
