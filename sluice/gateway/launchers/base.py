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
import enum
import sys
import time
from dataclasses import dataclass, field

import httpx
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "LauncherName",
    "LauncherConfig",
    "ReplicaSpec",
    "LaunchedReplica",
    "Launcher",
    "serve_argv",
    "wait_healthy",
    "make_launcher",
]


class LauncherName(str, enum.Enum):
    """Values match the config's ``autoscale.launcher.kind``."""

    LOCAL = "local"
    RAY = "ray"


class LauncherConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: LauncherName = LauncherName.LOCAL
    host: str | None = None  # replicas' bind address; None: 127.0.0.1 (local), the Ray node's IP (ray)
    cpus_per_replica: float = Field(default=1, gt=0)  # cores pinned (local) / Ray num_cpus (ray)
    ready_timeout_s: float = Field(default=180.0, gt=0)  # launch -> /health 200
    stop_timeout_s: float = Field(default=30.0, gt=0)  # SIGTERM -> SIGKILL
    restart_backoff_s: float = Field(default=1.0, gt=0)  # first restart delay after a crash (local)
    max_restart_backoff_s: float = Field(default=30.0, gt=0)  # the delay doubles up to this
    stable_after_s: float = Field(default=60.0, gt=0)  # up this long: the backoff resets
    ray_address: str | None = None  # None: the running Ray, or a local one (ray.init())
    ray_namespace: str = "sluice"


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


def make_launcher(config: LauncherConfig) -> Launcher:
    if config.kind is LauncherName.RAY:
        from sluice.gateway.launchers.ray import RayLauncher  # ray is an optional extra

        return RayLauncher(config)
    from sluice.gateway.launchers.local import LocalLauncher

    return LocalLauncher(config)
