"""Degradation driven by the replicas' predicted-wait signal (issue 11).

Fake replicas export ``sluice_predicted_ttft_seconds`` / ``sluice_slo_ttft_target_seconds``
per class; the gateway scrapes them (``scraper.step()`` on a fake clock) and its
level and per-class plan follow the predictions, before any TTFT is measured.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from sluice.auth import KeyStore
from sluice.gateway.config import DegradationConfig
from sluice.gateway.degradation import (
    DegradationLevel,
    GradedDegradation,
    LevelState,
    pressure,
    should_shed,
    step_level,
)
from sluice.gateway.pool import ModelLoad
from sluice.gateway.prom import parse_replica_load
from sluice.types import Priority
from tests.gateway.conftest import fake_backends, gateway_config, serve_gateway

L = DegradationLevel
TARGETS = (0.5, 2.0, 5.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def signal(ratios: Sequence[float], targets: Sequence[float] = TARGETS) -> dict[str, float]:
    out = {}
    for c, (r, t) in enumerate(zip(ratios, targets, strict=True)):
        out[f'sluice_predicted_ttft_seconds{{priority="p{c}"}}'] = r * t
        out[f'sluice_slo_ttft_target_seconds{{priority="p{c}"}}'] = t
    return out


def _load(slo: tuple[tuple[float, float], ...] | None) -> ModelLoad:
    return ModelLoad(num_replicas=1, num_routable=1, num_waiting=99, num_running=0, num_inflight=0,
                     inflight_tokens=10**6, p95_ttft_s=60.0, slo_by_priority=slo)  # fmt: skip


def test_replica_signal_is_parsed_per_class() -> None:
    text = "".join(f"{k} {v}\n" for k, v in signal((0.2, 0.5, 1.5)).items())
    load = parse_replica_load(text)
    assert load.predicted_ttft == pytest.approx((0.1, 1.0, 7.5)) and load.ttft_target == TARGETS


def test_predicted_signal_replaces_the_measured_ratios() -> None:
    p = pressure(_load(((0.1, 0.5), (1.0, 2.0), (3.0, 5.0))), DegradationConfig())
    assert p.predicted == pytest.approx((0.2, 0.5, 0.6)) and p.score == pytest.approx(0.6), (
        "with a prediction, a long queue or slow past TTFTs within target do not count"
    )
    assert p.excess_s == (0.0, 0.0, 0.0)
    legacy = pressure(_load(None), DegradationConfig())
    assert legacy.predicted is None and legacy.score > 1, "without it the measured ratios drive the level"


def test_levels_use_the_slo_thresholds_for_predictions() -> None:
    cfg = DegradationConfig(rise_s=(0, 0, 0))
    state = LevelState()
    for score, level in ((0.4, L.NORMAL), (0.55, L.CAP_TOKENS), (0.85, L.FALLBACK), (1.0, L.SHED)):
        state = step_level(state, score, 0.0, cfg, is_predicted=True)
        assert state.level is level, f"a predicted ratio of {score} must give level {level.name}"


def test_p0_is_never_shed_while_a_lower_class_is_admitted() -> None:
    cfg = DegradationConfig()
    grid = [0.0, 0.9, 1.0, 3.0]
    for ratios in itertools.product(grid, repeat=3):
        shed = [should_shed(L.SHED, Priority(c), max(ratios), {}, cfg, ratios) for c in range(3)]  # type: ignore[arg-type]
        if shed[0]:
            assert shed[1] and shed[2], f"p0 shed while p1/p2 admitted at ratios {ratios}"
        if shed[1]:
            assert shed[2], f"p1 shed while p2 admitted at ratios {ratios}"
        assert shed[2] == (ratios[2] >= 1.0), "p2 is shed exactly when its predicted TTFT is over target"


def test_shed_retry_after_is_the_predicted_excess_with_jitter() -> None:
    clock = FakeClock()
    d = GradedDegradation(DegradationConfig(rise_s=(0, 0, 0), retry_after_s=1.0), clock=clock, rng=random.Random(3))
    load = _load(((0.1, 0.5), (1.0, 2.0), (9.0, 5.0)))  # p2: 4 s over its target
    for _ in range(3):
        d.observe("m", load, None)
        clock.now += 1
    assert d.level("m") is L.SHED
    waits = [d.plan("m", Priority.P2, 16, False).retry_after_s for _ in range(40)]
    assert all(4.0 <= w <= 4.0 * 1.5 + 1.0 for w in waits), waits
    assert len({round(w) for w in waits}) >= 3, "a shed wave must not be told one instant"


def _keys(tmp_path: Path) -> KeyStore:
    f = tmp_path / "keys.yaml"
    f.write_text("keys:\n  sk-user: {tier: p0}\n")
    return KeyStore.build((), str(f))


async def test_gateway_level_follows_scraped_predictions_before_any_ttft_is_measured(tmp_path: Path) -> None:
    clock = FakeClock()
    async with fake_backends(2) as fakes:
        cfg = gateway_config([f.url for f in fakes], degradation={"rise_s": [1, 1, 1], "fall_s": 5, "eval_interval_s": 0.1})
        async with serve_gateway(cfg, keys=_keys(tmp_path), clock=clock, run_scraper=False) as (url, app), \
                httpx.AsyncClient(timeout=10) as http:  # fmt: skip
            gw, scraper = app.state.gateway, app.state.scraper

            async def tick(ratios_a: Sequence[float], ratios_b: Sequence[float] | None = None) -> None:
                fakes[0].config.metrics = signal(ratios_a)
                fakes[1].config.metrics = signal(ratios_b or ratios_a)
                clock.now += 1.1
                await scraper.step()

            async def send(p: str, max_tokens: int = 100) -> httpx.Response:
                body = {"model": "m", "prompt": "hello", "max_tokens": max_tokens}
                return await http.post(url + "/v1/completions", json=body,
                                       headers={"authorization": "Bearer sk-user", "x-priority": p})  # fmt: skip

            async def settle(ratios_a: Sequence[float], ratios_b: Sequence[float] | None = None) -> L:
                for _ in range(2):  # once to start the dwell, once past rise_s
                    await tick(ratios_a, ratios_b)
                    await send("p0", 1)
                return gw.degradation.level("m")

            assert await settle((0.1, 0.2, 0.3)) is L.NORMAL
            r = await send("p2")
            assert r.status_code == 200 and "x-sluice-degraded" not in r.headers
            # one replica is near its p2 target, the other is not: the gateway goes where a new request would
            assert await settle((0.1, 0.3, 0.9), (0.1, 0.2, 0.3)) is L.NORMAL
            # p2 at 60% of its target on both: level 1 trims p2's max_tokens, not p1's or p0's
            assert await settle((0.1, 0.2, 0.6)) is L.CAP_TOKENS
            assert (await send("p2")).headers.get("x-sluice-degraded", "").startswith("max_tokens=")
            assert "x-sluice-degraded" not in (await send("p1")).headers, "p1 within 50% of target: not trimmed"
            assert "x-sluice-degraded" not in (await send("p0")).headers, "p0 is never trimmed"
            # p1 also nearing its target: level 2, p1 trimmed too
            assert await settle((0.2, 0.6, 0.9)) is L.FALLBACK
            assert (await send("p1")).headers.get("x-sluice-degraded", "").startswith("max_tokens=")
            # the replicas would refuse p2 (and p1) now: level 3 sheds them at the gateway, p0 still served
            assert await settle((0.4, 1.2, 1.5)) is L.SHED
            for p in ("p2", "p1"):
                r = await send(p)
                assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, f"{p} must be shed"
            assert (await send("p0")).status_code == 200, "p0 is served while p1/p2 are shed"
            # p0 far over its target but p2 within it: p0 must not be shed while p2 is admitted
            await tick((3.0, 1.2, 0.95))
            assert gw.degradation.level("m") is L.SHED
            assert (await send("p2")).status_code == 200
            assert (await send("p0")).status_code == 200, "p0 is never shed while a lower class is admitted"
            # load gone: levels come back down
            for _ in range(20):  # fall_s 5 per level, one level at a time
                await tick((0.05, 0.05, 0.05))
                await send("p0", 1)
            assert gw.degradation.level("m") is L.NORMAL


async def test_gateway_never_retries_a_replica_429(tmp_path: Path) -> None:
    async with fake_backends(2, fault="status", status=429) as fakes:
        cfg = gateway_config([f.url for f in fakes], degradation={"policy": "off"})
        async with serve_gateway(cfg, keys=_keys(tmp_path)) as (url, app), httpx.AsyncClient(timeout=10) as http:
            r = await http.post(url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 4},
                                headers={"authorization": "Bearer sk-user"})  # fmt: skip
            assert r.status_code == 429
            assert sum(f.num_requests for f in fakes) == 1, "a 429 goes back to the client, never to another replica"
