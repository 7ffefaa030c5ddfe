"""Replica launchers: start, supervise and stop ``sluice serve`` replicas for the autoscaler.

    base.py   the ``Launcher`` interface, ``ReplicaSpec`` / ``LaunchedReplica``, config
    local.py  processes on this machine, pinned to their own cores, restarted on crash
    ray.py    Ray actors on a Ray cluster (``pip install 'sluice-llm[ray]'``)
    pin.py    tiny exec wrapper: ``python -m sluice.gateway.launchers.pin 0,1 -- cmd...``

``make_launcher(config)`` builds one from ``LauncherConfig.kind``.
"""

from __future__ import annotations

from sluice.gateway.config import LauncherConfig, LauncherName
from sluice.gateway.launchers.base import LaunchedReplica, Launcher, ReplicaSpec

__all__ = ["LaunchedReplica", "Launcher", "LauncherConfig", "LauncherName", "ReplicaSpec", "make_launcher"]


def make_launcher(config: LauncherConfig) -> Launcher:
    if config.kind is LauncherName.RAY:
        from sluice.gateway.launchers.ray import RayLauncher  # ray is an optional extra

        return RayLauncher(config)
    from sluice.gateway.launchers.local import LocalLauncher

    return LocalLauncher(config)
