"""Autoscaler: the pure decision honours thresholds, cooldowns and bounds; the
controller launches through a launcher, adds to the pool, and drains before it
stops (fake launcher over in-process fake replicas)."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
from pydantic import ValidationError

from sluice.bench.fake_server import FakeConfig, FakeServer
from sluice.gateway.autoscale import Autoscaler, ScaleState, decide
from sluice.gateway.config import AutoscaleConfig, LauncherName
from sluice.gateway.launchers.base import LaunchedReplica, Launcher, ReplicaSpec
from tests.gateway.conftest import gateway_config, serve_gateway

CFG = AutoscaleConfig(model_path="m", min_replicas=1, max_replicas=4)


def _run(n: int, script: list[tuple[float, float]], cfg: AutoscaleConfig = CFG, dt: float = 5.0) -> list[tuple[float, int, str]]:
    """Apply every decision at once; returns (time, replicas, reason) at each change."""
    state, t, out = ScaleState(), 0.0, []
    for duration, score_per_replica_at_1 in script:
        end = t + duration
        while t < end:
            # the offered load is fixed: spreading it over more replicas lowers the per-replica score
            d = decide(n, score_per_replica_at_1 / max(n, 1), t, state, cfg)
            state = d.state
            if d.desired != n:
                out.append((t, d.desired, d.reason))
                n = d.desired
            t += dt
    return out


def test_scale_up_above_high_water_with_the_up_cooldown_between_steps() -> None:
    changes = _run(1, [(1000, 3.0)])
    counts = [c[1] for c in changes]
    assert counts == [2, 3, 4], f"an offered load of 3 replicas at 0.85 high water needs 4, step by step: {changes}"
    gaps = [b[0] - a[0] for a, b in zip(changes, changes[1:], strict=False)]
    assert all(g >= CFG.up_cooldown_s for g in gaps), f"scale-ups must be >= 3 min apart: {gaps}"
    assert all(c[2].startswith("up") for c in changes)


def test_scale_down_waits_ten_minutes_of_low_load_and_stops_at_min() -> None:
    changes = _run(3, [(3000, 0.3)])
    assert [c[1] for c in changes] == [2, 1], f"low load must scale down to min_replicas, one at a time: {changes}"
    assert changes[0][0] >= CFG.down_cooldown_s, "no scale-down before 10 min of low load"
    assert changes[1][0] - changes[0][0] >= CFG.down_cooldown_s, "10 min between two scale-downs"


def test_a_load_blip_resets_the_scale_down_timer() -> None:
    changes = _run(2, [(500, 0.2), (10, 1.0), (500, 0.2)])
    assert changes == [], f"a blip above low water inside 10 min must restart the wait: {changes}"


def test_no_scale_down_into_an_overloaded_count() -> None:
    cfg = AutoscaleConfig(model_path="m", low_water=0.5, high_water=0.85, down_cooldown_s=0)
    d = decide(2, 0.45, 0.0, ScaleState(), cfg)
    assert d.desired == 2 and "high_water" in d.reason, "0.45 x 2 on one replica is 0.9 > high water: hold"


def test_bounds_win_over_cooldowns() -> None:
    recent = ScaleState(last_up_at=100.0, last_change_at=100.0)
    assert decide(0, 0.0, 101.0, recent, CFG).desired == 1, "below min_replicas: launch now, cooldown or not"
    assert decide(6, 5.0, 101.0, recent, CFG).desired == 4, "above max_replicas: shrink to max"
    hold = decide(4, 5.0, 10_000.0, ScaleState(), CFG)
    assert hold.desired == 4 and "max_replicas" in hold.reason, "never above max_replicas"
    big = AutoscaleConfig(model_path="m", max_replicas=10, max_step=3)
    assert decide(2, 3.0, 0.0, ScaleState(), big).desired == 5, "a big overload may add up to max_step at once"


def test_config_rejects_inverted_bounds_and_water_marks() -> None:
    with pytest.raises(ValidationError, match="min_replicas"):
        AutoscaleConfig(model_path="m", min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError, match="low_water"):
        AutoscaleConfig(model_path="m", low_water=0.9, high_water=0.85)


class FakeLauncher(Launcher):
    """Launches in-process fake replicas; records stops and what was in flight then."""

    name = LauncherName.LOCAL

    def __init__(self, config: FakeConfig | None = None):
        self.config = config or FakeConfig(output_tokens=4)
        self.fakes: dict[str, FakeServer] = {}
        self.running: dict[str, LaunchedReplica] = {}
        self.in_flight_at_stop: list[int] = []

    async def launch(self, spec: ReplicaSpec) -> LaunchedReplica:
        fake = FakeServer(dataclasses.replace(self.config, name=f"auto{len(self.fakes)}"))
        url = await fake.start()
        self.fakes[url] = fake
        lr = LaunchedReplica(id=url, url=url, spec=spec)
        self.running[lr.id] = lr
        return lr

    async def stop(self, replica: LaunchedReplica) -> None:
        self.running.pop(replica.id, None)
        fake = self.fakes[replica.url]
        self.in_flight_at_stop.append(fake.num_in_flight)
        await fake.stop()

    def replicas(self) -> list[LaunchedReplica]:
        return list(self.running.values())


async def test_controller_scales_up_and_drains_a_replica_before_stopping_it() -> None:
    static = FakeServer(FakeConfig(name="static", output_tokens=4))
    await static.start()
    launcher = FakeLauncher(FakeConfig(output_tokens=6, tokens_per_s=10))
    cfg = gateway_config([static.url], policy="round_robin")
    auto_cfg = AutoscaleConfig(model_path="m", min_replicas=1, max_replicas=3, up_cooldown_s=0, down_cooldown_s=0)
    try:
        async with serve_gateway(cfg, run_scraper=False) as (url, app), httpx.AsyncClient(timeout=10) as http:
            gw = app.state.gateway
            scaler = Autoscaler(gw.pool, {"m": auto_cfg}, {"m": launcher}, clock=gw.clock)
            added = await scaler.scale_up("m", 1)
            assert scaler.num_replicas("m") == 2 and added[0].url in launcher.fakes
            body = {"model": "m", "prompt": "hi", "max_tokens": 8, "stream": True}

            async def stream_one() -> tuple[int, str, bool]:
                async with http.stream("POST", url + "/v1/completions", json=body) as r:
                    lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
                return r.status_code, r.headers["x-sluice-replica"], lines[-1] == "data: [DONE]"

            tasks = [asyncio.create_task(stream_one()) for _ in range(6)]
            while added[0].num_inflight < 2:
                await asyncio.sleep(0.01)
            victims = scaler.scale_down("m", 1)
            assert victims == added, "only a replica the autoscaler launched may be scaled down"
            assert scaler.num_replicas("m") == 1
            after = [await stream_one() for _ in range(3)]
            assert all(rep == static.url for _, rep, _ in after), "a draining replica must get no new request"
            results = await asyncio.gather(*tasks)
            await scaler.wait_drained()
            assert all(status == 200 and done for status, _, done in results), (
                f"requests in flight on a draining replica must finish: {results}"
            )
            assert launcher.in_flight_at_stop == [0], "the replica must be stopped only after it drained"
            assert launcher.replicas() == []
            view = scaler.describe()["m"]
            assert view["num_replicas"] == 1 and view["draining"] == []  # type: ignore[index]
    finally:
        await static.stop()
        for f in launcher.fakes.values():
            await f.stop()


async def test_controller_tick_launches_up_to_min_replicas_and_logs_the_decision() -> None:
    static = FakeServer(FakeConfig(name="static", output_tokens=4))
    await static.start()
    launcher = FakeLauncher()
    cfg = gateway_config([static.url])
    try:
        async with serve_gateway(cfg, run_scraper=False) as (_url, app):
            gw = app.state.gateway
            scaler = Autoscaler(gw.pool, {"m": AutoscaleConfig(model_path="m", min_replicas=2)}, {"m": launcher}, clock=gw.clock)
            [(model, d)] = await scaler.tick()
            assert model == "m" and d.desired == 2 and d.reason.startswith("min")
            assert scaler.num_replicas("m") == 2 and len(launcher.replicas()) == 1
            assert scaler.describe()["m"]["decisions"][0]["to"] == 2  # type: ignore[index]
            [(_, d2)] = await scaler.tick()
            assert d2.desired == 2, "an idle model at min_replicas holds"
            await scaler.close()
            assert launcher.replicas() == [], "closing the autoscaler stops what it launched"
    finally:
        await static.stop()


async def test_gateway_config_autoscale_launches_min_replicas_and_reports(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sluice.auth import KeyStore

    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("keys:\n  sk-user: {tier: p0}\nadmin_keys: [sk-admin]\n")
    launcher = FakeLauncher()
    cfg = gateway_config(
        [],
        models={"m": {"versions": [{"name": "v1", "replicas": []}],
                      "autoscale": {"model_path": "unused", "min_replicas": 2, "max_replicas": 3, "interval_s": 0.05}}},
    )  # fmt: skip
    try:
        async with serve_gateway(cfg, keys=KeyStore.build((), str(keys_file)), launchers={"m": launcher}) as (url, app), \
                httpx.AsyncClient(timeout=10) as http:  # fmt: skip
            for _ in range(200):
                if len(launcher.replicas()) == 2 and app.state.autoscaler.num_replicas("m") == 2:
                    break
                await asyncio.sleep(0.05)
            assert app.state.autoscaler.num_replicas("m") == 2, "the gateway must launch min_replicas at start"
            r = await http.post(url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 4},
                                headers={"authorization": "Bearer sk-user"})  # fmt: skip
            assert r.status_code == 200 and r.headers["x-sluice-replica"] in launcher.fakes
            view = (await http.get(url + "/admin/autoscale", headers={"authorization": "Bearer sk-admin"})).json()
            assert view["models"]["m"]["num_replicas"] == 2 and len(view["models"]["m"]["launched"]) == 2
            metrics = (await http.get(url + "/metrics")).text
            assert 'sluice_gateway_autoscale_replicas{model="m"} 2.0' in metrics
            assert 'sluice_gateway_autoscale_decisions_total{direction="up",model="m"} 1.0' in metrics
        assert launcher.replicas() == [], "gateway shutdown must stop the replicas it launched"
    finally:
        for f in launcher.fakes.values():
            await f.stop()


def test_a_version_without_replicas_needs_autoscale() -> None:
    from sluice.errors import ConfigError

    with pytest.raises(ConfigError, match="at least one replica"):
        gateway_config([], models={"m": {"versions": [{"name": "v1", "replicas": []}]}})
    with pytest.raises(ConfigError, match="autoscale.version"):
        gateway_config([], models={"m": {"versions": [{"name": "v1", "replicas": []}],
                                         "autoscale": {"model_path": "x", "version": "v9"}}})  # fmt: skip
