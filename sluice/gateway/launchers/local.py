"""Local launcher: ``sluice serve`` processes on this machine, one set of cores each.

Each replica is its own process group (API process + engine core), started
through ``pin.py`` so both run on the cores assigned to it.  Cores come from the
NUMA nodes the gateway may use (``numa_nodes``); ``assign_cores`` (pure) keeps a
replica inside one node when it fits and spreads replicas over nodes.

A supervisor task per replica restarts a crashed one on the same port, after
``restart_backoff_s`` doubling up to ``max_restart_backoff_s`` (reset once it
has stayed up ``stable_after_s``); the gateway's health checks take it out of
and back into rotation.  ``stop`` sends SIGTERM, which makes ``sluice serve``
finish its in-flight requests, and SIGKILLs the group after ``stop_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.gateway.config import LauncherConfig, LauncherName
from sluice.gateway.launchers.base import (
    LaunchedReplica,
    Launcher,
    ReplicaSpec,
    serve_argv,
    wait_healthy,
)
from sluice.gateway.launchers.pin import parse_cores

__all__ = ["LocalLauncher", "numa_nodes", "assign_cores"]

log = logging.getLogger("sluice.gateway.launchers")


def numa_nodes(sys_root: str = "/sys/devices/system/node") -> list[list[int]]:
    """Cores this process may use, grouped by NUMA node (one group when unknown)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    nodes = []
    for path in sorted(Path(sys_root).glob("node[0-9]*/cpulist")):
        cores = sorted(parse_cores(path.read_text()) & allowed)
        if cores:
            nodes.append(cores)
    return nodes or [sorted(allowed)]


def assign_cores(nodes: Sequence[Sequence[int]], in_use: Sequence[Sequence[int]], num_cores: int) -> tuple[int, ...]:
    """Cores for a new replica (pure).

    Free cores of the node with the most of them first (a replica stays inside
    one node when it fits); when fewer than ``num_cores`` are free anywhere, the
    least shared cores are reused, so an oversubscribed machine still starts it.
    """
    use = Counter(c for cores in in_use for c in cores)
    all_cores = [c for node in nodes for c in node]
    num_cores = max(1, min(num_cores, len(all_cores)))
    free_by_node = [[c for c in node if use[c] == 0] for node in nodes]
    best = max(free_by_node, key=len)
    if len(best) >= num_cores:
        return tuple(best[:num_cores])
    chosen = [c for free in sorted(free_by_node, key=len, reverse=True) for c in free][:num_cores]
    rest = sorted((c for c in all_cores if c not in chosen), key=lambda c: (use[c], c))
    return tuple(sorted(chosen + rest[: num_cores - len(chosen)]))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(eq=False)
class _Proc:
    replica: LaunchedReplica
    host: str
    port: int
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    supervisor: asyncio.Task[None] | None = None
    spawned_at: float = 0.0
    is_stopping: bool = False

    def is_alive(self) -> bool:
        return self.process is not None and self.process.returncode is None


class LocalLauncher(Launcher):
    name = LauncherName.LOCAL

    def __init__(
        self,
        config: LauncherConfig,
        *,
        nodes: list[list[int]] | None = None,
        log_dir: str | None = None,
        command: Callable[[ReplicaSpec, str, int], list[str]] = serve_argv,
    ):
        self.config = config
        self.command = command  # argv of one replica; tests run fake replicas through it
        self.nodes = nodes if nodes is not None else numa_nodes()
        self.log_dir = Path(log_dir or tempfile.gettempdir()) / "sluice-replicas"
        self._procs: dict[str, _Proc] = {}

    def replicas(self) -> list[LaunchedReplica]:
        return [p.replica for p in self._procs.values()]

    def pid(self, replica: LaunchedReplica) -> int | None:
        """The replica's current process id (tests kill it to check restarts)."""
        p = self._procs.get(replica.id)
        return p.process.pid if p is not None and p.process is not None else None

    async def launch(self, spec: ReplicaSpec) -> LaunchedReplica:
        host = self.config.host or "127.0.0.1"
        port = _free_port(host)
        cores = assign_cores(self.nodes, [p.replica.cores for p in self._procs.values()], int(self.config.cpus_per_replica))
        replica = LaunchedReplica(id=f"local-{port}", url=f"http://{host}:{port}", spec=spec, cores=cores)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        proc = _Proc(replica, host, port, self.log_dir / f"{replica.id}.log")
        self._procs[replica.id] = proc
        try:
            await self._spawn(proc)
            await wait_healthy(replica.url, self.config.ready_timeout_s, is_alive=proc.is_alive)
        except BaseException as e:
            self._procs.pop(replica.id, None)
            await self._terminate(proc, grace_s=0.0)
            if isinstance(e, Exception):
                raise RuntimeError(f"{e}; last log lines: {self._log_tail(proc)}") from e
            raise
        proc.supervisor = asyncio.create_task(self._supervise(proc), name=f"supervise {replica.id}")
        log.info("launched %s for %s/%s on cores %s", replica.url, spec.model, spec.version, cores)
        return replica

    async def stop(self, replica: LaunchedReplica) -> None:
        proc = self._procs.pop(replica.id, None)
        if proc is None:
            return
        proc.is_stopping = True
        if proc.supervisor is not None:
            proc.supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await proc.supervisor
        await self._terminate(proc, grace_s=self.config.stop_timeout_s)
        log.info("stopped %s", replica.url)

    # ---- processes -------------------------------------------------------------------

    async def _spawn(self, proc: _Proc) -> None:
        spec = proc.replica.spec
        cores = ",".join(map(str, proc.replica.cores))
        argv = [sys.executable, "-m", "sluice.gateway.launchers.pin", cores, "--", *self.command(spec, proc.host, proc.port)]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, len(proc.replica.cores))), **dict(spec.env)}
        with open(proc.log_path, "ab") as log_file:
            proc.process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                env=env,
                start_new_session=True,  # its own process group: the engine core goes with it
            )
        proc.spawned_at = time.monotonic()

    async def _supervise(self, proc: _Proc) -> None:
        backoff = self.config.restart_backoff_s
        while not proc.is_stopping:
            assert proc.process is not None
            rc = await proc.process.wait()
            if proc.is_stopping:
                return
            self._killpg(proc, signal.SIGKILL)  # an orphaned engine core must not hold the port
            if time.monotonic() - proc.spawned_at >= self.config.stable_after_s:
                backoff = self.config.restart_backoff_s
            log.warning("replica %s exited with %s; restarting in %.1fs", proc.replica.url, rc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(self.config.max_restart_backoff_s, backoff * 2)
            if proc.is_stopping:
                return
            await self._spawn(proc)
            proc.replica.num_restarts += 1

    def _killpg(self, proc: _Proc, sig: int) -> None:
        if proc.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.process.pid, sig)

    async def _terminate(self, proc: _Proc, grace_s: float) -> None:
        if proc.process is None:
            return
        if proc.process.returncode is None and grace_s > 0:
            # NOTE(drain): SIGTERM to the API process only; it drains its requests
            # and then stops its own engine core (the whole group would kill the
            # engine core under the requests still finishing).
            with contextlib.suppress(ProcessLookupError):
                proc.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.process.wait(), grace_s)
        self._killpg(proc, signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.process.wait(), 10)

    @staticmethod
    def _log_tail(proc: _Proc, num_lines: int = 5) -> str:
        try:
            lines = proc.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-num_lines:]) or "(empty log)"
