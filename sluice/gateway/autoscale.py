"""Autoscaling: a pure decision on the replica count, and the controller that acts on it.

``decide`` (pure) reads a model's load score (``degradation.Pressure``: the worst
of queue, in-flight tokens and p95 TTFT vs capacity; 1.0 = full) and returns the
desired number of replicas::

    score > high_water (0.85)  and  >= up_cooldown_s (3 min) since the last scale-up
        -> ceil(n * score / high_water), at most max_step more
    score < low_water (0.3) for down_cooldown_s (10 min)  and as long since any change
        -> n - 1, if the n - 1 left stay below high_water
    always within [min_replicas, max_replicas]

``Autoscaler`` is the edge: every ``interval_s`` it reads the pool's load, calls
``decide``, launches replicas through a ``Launcher`` and adds them to the pool,
or drains one (out of routing first, its in-flight requests finish, then it
stops).  Only replicas it launched are ever stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice.gateway.config import AutoscaleConfig, DegradationConfig, ReplicaConfig
from sluice.gateway.degradation import Pressure, pressure
from sluice.gateway.launchers.base import LaunchedReplica, Launcher, ReplicaSpec
from sluice.gateway.pool import ReplicaPool
from sluice.gateway.replica import Replica

__all__ = ["ScaleState", "ScaleDecision", "decide", "Autoscaler"]

log = logging.getLogger("sluice.gateway.autoscale")


@dataclass(frozen=True)
class ScaleState:
    last_up_at: float = -math.inf
    last_change_at: float = -math.inf  # last scale-up or scale-down
    low_since: float | None = None  # score < low_water continuously since


@dataclass(frozen=True)
class ScaleDecision:
    desired: int
    reason: str  # "hold", "up: ...", "down: ...", "min", "max", "cooldown: ..."
    state: ScaleState


def decide(num_replicas: int, score: float, now: float, state: ScaleState, config: AutoscaleConfig) -> ScaleDecision:
    """Desired replica count for one model (pure).  ``score`` is per replica (1.0 = full)."""
    n = num_replicas
    low_since = (state.low_since if state.low_since is not None else now) if score < config.low_water else None
    state = ScaleState(state.last_up_at, state.last_change_at, low_since)
    if n < config.min_replicas:
        return ScaleDecision(config.min_replicas, f"min: {n} < min_replicas {config.min_replicas}", _up(state, now))
    if n > config.max_replicas:
        return ScaleDecision(config.max_replicas, f"max: {n} > max_replicas {config.max_replicas}", _down(state, now))
    if score > config.high_water:
        if n >= config.max_replicas:
            return ScaleDecision(n, f"hold: score {score:.2f} > {config.high_water} but at max_replicas", state)
        wait = config.up_cooldown_s - (now - state.last_up_at)
        if wait > 0:
            return ScaleDecision(n, f"cooldown: score {score:.2f} > {config.high_water}, {wait:.0f}s to go", state)
        want = math.ceil(max(n, 1) * score / config.high_water)
        desired = min(config.max_replicas, max(n + 1, min(want, n + config.max_step)))
        return ScaleDecision(desired, f"up: score {score:.2f} > high_water {config.high_water}", _up(state, now))
    if low_since is not None and n > config.min_replicas:
        since = now - max(low_since, state.last_change_at)
        # NOTE(no-bounce): never scale down into a count that would at once be above the high-water mark.
        if n > 1 and score * n / (n - 1) >= config.high_water:
            return ScaleDecision(n, f"hold: {n - 1} replicas would be above high_water", state)
        if since >= config.down_cooldown_s:
            return ScaleDecision(n - 1, f"down: score {score:.2f} < low_water {config.low_water} for {since:.0f}s", _down(state, now))
        return ScaleDecision(n, f"cooldown: score {score:.2f} < {config.low_water} for {since:.0f}s", state)
    return ScaleDecision(n, f"hold: score {score:.2f}", state)


def _up(state: ScaleState, now: float) -> ScaleState:
    return ScaleState(last_up_at=now, last_change_at=now, low_since=None)


def _down(state: ScaleState, now: float) -> ScaleState:
    return ScaleState(last_up_at=state.last_up_at, last_change_at=now, low_since=None)


@dataclass
class _Managed:
    """The autoscaler's record of one model."""

    config: AutoscaleConfig
    version: str
    state: ScaleState = field(default_factory=ScaleState)
    launched: dict[str, tuple[LaunchedReplica, Replica]] = field(default_factory=dict)  # url -> ...
    draining: dict[str, Replica] = field(default_factory=dict)  # url -> replica being drained
    decisions: deque[dict[str, object]] = field(default_factory=lambda: deque(maxlen=50))
    last_pressure: Pressure | None = None


class Autoscaler:
    """Runs ``decide`` for every autoscaled model and applies it through a launcher."""

    def __init__(
        self,
        pool: ReplicaPool,
        configs: dict[str, AutoscaleConfig],
        launchers: dict[str, Launcher],
        *,
        load_config: DegradationConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_decision: Callable[[str, int, int, str], None] | None = None,  # (model, from, to, reason)
    ):
        self.pool = pool
        self.on_decision = on_decision
        self.launchers = launchers  # model -> launcher
        self.load_config = load_config or DegradationConfig()
        self.clock = clock
        self._models: dict[str, _Managed] = {}
        for model, cfg in configs.items():
            version = cfg.version or pool.versions(model)[0].name
            pool.version(model, version)  # unknown version: fail at start-up
            self._models[model] = _Managed(cfg, version)
        self._drains: set[asyncio.Task[None]] = set()

    @property
    def models(self) -> list[str]:
        return list(self._models)

    def num_replicas(self, model: str) -> int:
        m = self._models[model]
        return len(self.pool.version(model, m.version).replicas)

    def score(self, model: str) -> Pressure:
        # NOTE(measured-load): capacity is sized on the measured ratios (queue, tokens,
        # TTFT); the replicas' predicted-wait signal drives degradation, not scaling,
        # since admission control keeps it near 1.0 under any overload.
        load = dataclasses.replace(self.pool.model_load(model), slo_by_priority=None)
        return pressure(load, self.load_config)

    async def run(self) -> None:
        """The controller loop (owned by the gateway's lifespan)."""
        try:
            await self.adopt_running()
            while True:
                await self.tick()
                await asyncio.sleep(min(m.config.interval_s for m in self._models.values()) if self._models else 5.0)
        finally:
            await self.close()

    async def tick(self) -> list[tuple[str, ScaleDecision]]:
        out = []
        for model, m in self._models.items():
            p = self.score(model)
            m.last_pressure = p
            n = self.num_replicas(model)
            d = decide(n, p.score, self.clock(), m.state, m.config)
            m.state = d.state
            if d.desired != n:
                m.decisions.append({"at": self.clock(), "from": n, "to": d.desired, "reason": d.reason})
                log.warning("autoscale %s: %d -> %d replicas (%s; %s)", model, n, d.desired, d.reason, p.describe())
                if self.on_decision is not None:
                    self.on_decision(model, n, d.desired, d.reason)
            try:
                if d.desired > n:
                    await self.scale_up(model, d.desired - n)
                elif d.desired < n:
                    self.scale_down(model, n - d.desired)
            except Exception as e:  # noqa: BLE001 - a failed launch is logged; the next tick retries
                log.error("autoscale %s failed: %s", model, e)
                m.decisions.append({"at": self.clock(), "from": n, "to": d.desired, "reason": f"failed: {e}"})
            out.append((model, d))
        return out

    async def scale_up(self, model: str, count: int) -> list[Replica]:
        m = self._models[model]
        c = m.config
        spec = ReplicaSpec(model, m.version, c.model_path, c.served_model_name, tuple(c.serve_args))
        launched = await asyncio.gather(*(self.launchers[model].launch(spec) for _ in range(count)), return_exceptions=True)
        added = []
        for lr in launched:
            if isinstance(lr, BaseException):
                log.error("launch for %s failed: %s", model, lr)
                continue
            replica = self.pool.add_replica(model, m.version, ReplicaConfig(url=lr.url, capacity=c.replica_capacity))
            m.launched[lr.url] = (lr, replica)
            added.append(replica)
        if not added and count:
            raise RuntimeError(f"no replica of {model} could be launched")
        return added

    async def adopt_running(self) -> int:
        """Adopt the replicas a launcher can discover (Ray actors left by a previous gateway)."""
        num = 0
        for model, m in self._models.items():
            discover = getattr(self.launchers[model], "discover", None)
            if discover is None:
                continue
            try:
                found = await discover()
            except Exception as e:  # noqa: BLE001 - discovery is best effort; scaling still works
                log.warning("autoscale %s: discovering running replicas failed: %s", model, e)
                continue
            for lr in found:
                if lr.spec.model == model and lr.spec.version == m.version and lr.url not in m.launched:
                    self.adopt(model, lr)
                    num += 1
        return num

    def adopt(self, model: str, launched: LaunchedReplica) -> Replica:
        """Manage a replica its launcher already runs (found by ``discover``, or
        started before the gateway); it joins the pool unless already there."""
        m = self._models[model]
        version = self.pool.version(model, m.version)
        replica = next((r for r in version.replicas if r.url == launched.url), None)
        if replica is None:
            replica = self.pool.add_replica(
                model, m.version, ReplicaConfig(url=launched.url, capacity=m.config.replica_capacity)
            )
        m.launched[launched.url] = (launched, replica)
        return replica

    def scale_down(self, model: str, count: int) -> list[Replica]:
        """Start draining ``count`` launched replicas (the least busy); returns them."""
        m = self._models[model]
        victims = sorted((r for _, r in m.launched.values()), key=lambda r: (r.num_inflight, r.url))[:count]
        for replica in victims:
            lr, _ = m.launched.pop(replica.url)
            # NOTE(drain): out of the version's list, the replica gets no new
            # request; requests already sent hold it and finish normally.
            self.pool.remove_replica(replica)
            m.draining[replica.url] = replica
            task = asyncio.create_task(self._drain(model, lr, replica), name=f"drain {replica.url}")
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
        return victims

    async def _drain(self, model: str, lr: LaunchedReplica, replica: Replica) -> None:
        m = self._models[model]
        deadline = time.monotonic() + m.config.drain_timeout_s  # real time: this waits on real requests
        while replica.num_inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if replica.num_inflight > 0:
            log.warning("drain of %s timed out with %d requests in flight", replica.url, replica.num_inflight)
        try:
            await self.launchers[model].stop(lr)
        finally:
            m.draining.pop(replica.url, None)

    async def wait_drained(self) -> None:
        if self._drains:
            await asyncio.gather(*list(self._drains), return_exceptions=True)

    async def close(self) -> None:
        """Stop every replica this autoscaler launched (gateway shutdown)."""
        for task in list(self._drains):
            task.cancel()
        await asyncio.gather(*list(self._drains), return_exceptions=True)
        for launcher in {id(v): v for v in self.launchers.values()}.values():
            with contextlib.suppress(Exception):
                await launcher.close()

    def describe(self) -> dict[str, object]:
        """JSON view for ``GET /admin/autoscale``."""
        out: dict[str, object] = {}
        for model, m in self._models.items():
            p = m.last_pressure
            out[model] = {
                "version": m.version,
                "num_replicas": self.num_replicas(model),
                "min_replicas": m.config.min_replicas,
                "max_replicas": m.config.max_replicas,
                "score": None if p is None else round(p.score, 4),
                "launched": [lr.url for lr, _ in m.launched.values()],
                "draining": list(m.draining),
                "restarts": {lr.url: lr.num_restarts for lr, _ in m.launched.values()},
                "decisions": list(m.decisions),
            }
        return out
