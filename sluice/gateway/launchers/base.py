"""The launcher interface: what the autoscaler needs from "somewhere to run replicas".

Every launcher has the same async signatures:

    launch(spec)        start one ``sluice serve`` replica; returns once its /health is 200
    stop(replica)       SIGTERM (the server drains its own in-flight requests), then kill
    replicas()          the replicas it runs now
    close()             stop them all

Draining *gateway* traffic before ``stop`` is the autoscaler's job (it takes the
replica out of routing and waits for its in-flight requests); a launcher only
runs processes.
"""

from __future__ import annotations

import abc
import asyncio
import sys
import time
from dataclasses import dataclass, field

import httpx

from sluice.gateway.config import LauncherName

__all__ = [
    "ReplicaSpec",
    "LaunchedReplica",
    "Launcher",
    "serve_argv",
    "wait_healthy",
]


@dataclass(frozen=True)
class ReplicaSpec:
    """What to run: one ``sluice serve`` for one version of a model."""

    model: str  # gateway-facing model name
    version: str
    model_path: str  # ``sluice serve --model``
    served_model_name: str | None = None  # ``--served-model-name``
    extra_args: tuple[str, ...] = ()  # more ``sluice serve`` flags (e.g. --kv-cache-memory 64MiB)
    env: tuple[tuple[str, str], ...] = ()  # extra environment


@dataclass(eq=False)
class LaunchedReplica:
    id: str  # launcher-unique
    url: str  # http://host:port
    spec: ReplicaSpec
    cores: tuple[int, ...] = ()  # pinned cores (local), empty when not pinned
    num_restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)


def serve_argv(spec: ReplicaSpec, host: str, port: int) -> list[str]:
    argv = [
        sys.executable, "-m", "sluice.cli", "serve", "--model", spec.model_path,
        "--host", host, "--port", str(port),
    ]  # fmt: skip
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    return argv + list(spec.extra_args)


async def wait_healthy(url: str, timeout_s: float, is_alive: object = None) -> None:
    """Poll ``url/health`` until 200; ``is_alive`` (a callable) aborts early when it says False."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if callable(is_alive) and not is_alive():
                raise RuntimeError(f"replica {url} exited during start-up")
            try:
                if (await http.get(url + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"replica {url} not healthy after {timeout_s:.0f}s")


class Launcher(abc.ABC):
    name: LauncherName

    @abc.abstractmethod
    async def launch(self, spec: ReplicaSpec) -> LaunchedReplica: ...

    @abc.abstractmethod
    async def stop(self, replica: LaunchedReplica) -> None: ...

    @abc.abstractmethod
    def replicas(self) -> list[LaunchedReplica]: ...

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(r) for r in self.replicas()), return_exceptions=True)
