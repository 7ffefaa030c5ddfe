"""Ray launcher: each replica is a named Ray actor that runs one ``sluice serve``.

    gateway ──launch──> ray.remote actor "sluice-replica/<model>/<version>/<id>"
                          └── subprocess: sluice serve --host <node ip> --port <free>
            <──url────  actor.start() returns http://<node ip>:<port>

The actor reserves ``cpus_per_replica`` of Ray's CPUs, so Ray places replicas
where there is room; ``discover()`` finds the actors already running in the
namespace (a restarted gateway adopts them).  ``stop`` asks the actor to
SIGTERM its server (which drains), then kills the actor.

Ray is an optional extra (``pip install 'sluice-llm[ray]'``); it is imported
only when this launcher is built.  Blocking Ray calls run in a thread; actor
method results are awaited as asyncio futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from sluice.gateway.config import LauncherConfig, LauncherName
from sluice.gateway.launchers.base import (
    LaunchedReplica,
    Launcher,
    ReplicaSpec,
    serve_argv,
    wait_healthy,
)

__all__ = ["RayLauncher", "ReplicaActor"]

log = logging.getLogger("sluice.gateway.launchers")

_ACTOR_PREFIX = "sluice-replica/"


class ReplicaActor:
    """The body of the Ray actor (wrapped by ``ray.remote`` at launch time).

    Runs on a Ray worker: starts ``sluice serve`` bound to the node's address.
    """

    def __init__(self, spec: ReplicaSpec, host: str | None = None):
        self.spec = spec
        self.host = host
        self.process: Any = None
        self.url = ""

    def start(self) -> str:
        import os
        import socket
        import subprocess

        import ray

        host = self.host or ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        self.process = subprocess.Popen(
            serve_argv(self.spec, host, port),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1", **dict(self.spec.env)},
            start_new_session=True,
        )
        self.url = f"http://{host}:{port}"
        return self.url

    def describe(self) -> tuple[str, ReplicaSpec, bool]:
        return self.url, self.spec, self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float) -> int | None:
        import os
        import signal
        import subprocess

        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the server drains, then exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return int(self.process.wait(10))


class RayLauncher(Launcher):
    name = LauncherName.RAY

    def __init__(self, config: LauncherConfig):
        import ray  # optional extra: fail here, with ray's own message, when missing

        self._ray = ray
        self.config = config
        self._actors: dict[str, tuple[Any, LaunchedReplica]] = {}  # replica id -> (handle, replica)

    def _ensure_ray(self) -> None:
        if not self._ray.is_initialized():
            self._ray.init(
                address=self.config.ray_address,
                namespace=self.config.ray_namespace,
                include_dashboard=False,
                log_to_driver=False,
            )

    def replicas(self) -> list[LaunchedReplica]:
        return [rep for _, rep in self._actors.values()]

    async def launch(self, spec: ReplicaSpec) -> LaunchedReplica:
        await asyncio.to_thread(self._ensure_ray)
        rid = uuid.uuid4().hex[:8]
        name = f"{_ACTOR_PREFIX}{spec.model}/{spec.version}/{rid}"
        actor_cls: Any = self._ray.remote(num_cpus=self.config.cpus_per_replica)(ReplicaActor)
        handle: Any = actor_cls.options(
            name=name, namespace=self.config.ray_namespace, lifetime="detached", max_restarts=0
        ).remote(spec, self.config.host)
        try:
            url = await handle.start.remote()
            replica = LaunchedReplica(id=name, url=url, spec=spec)
            await wait_healthy(url, self.config.ready_timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(handle.stop.remote(0.0), 10)
            self._ray.kill(handle)
            raise
        self._actors[name] = (handle, replica)
        log.info("launched Ray actor %s at %s", name, url)
        return replica

    async def stop(self, replica: LaunchedReplica) -> None:
        entry = self._actors.pop(replica.id, None)
        if entry is None:
            return
        handle, _ = entry
        try:
            await asyncio.wait_for(handle.stop.remote(self.config.stop_timeout_s), self.config.stop_timeout_s + 15)
        except Exception as e:  # noqa: BLE001 - the actor is killed below either way
            log.warning("Ray actor %s did not stop cleanly: %s", replica.id, e)
        self._ray.kill(handle)
        log.info("stopped Ray actor %s", replica.id)

    async def discover(self) -> list[LaunchedReplica]:
        """Adopt the replica actors already running in the namespace."""
        await asyncio.to_thread(self._ensure_ray)
        names = await asyncio.to_thread(self._ray.util.list_named_actors, True)
        found = []
        for entry in names:
            name = entry["name"] if isinstance(entry, dict) else entry
            ns = entry.get("namespace") if isinstance(entry, dict) else self.config.ray_namespace
            if not name.startswith(_ACTOR_PREFIX) or ns != self.config.ray_namespace:
                continue
            if name in self._actors:
                found.append(self._actors[name][1])
                continue
            handle = await asyncio.to_thread(self._ray.get_actor, name, self.config.ray_namespace)
            url, spec, is_alive = await handle.describe.remote()
            if is_alive:
                replica = LaunchedReplica(id=name, url=url, spec=spec)
                self._actors[name] = (handle, replica)
                found.append(replica)
        return found
