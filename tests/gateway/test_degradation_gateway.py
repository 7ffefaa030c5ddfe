"""Degradation on the request path, with fake replicas: the max_tokens cap is
applied and reported, level 2 moves p1/p2 to the fallback version and keeps p0,
level 3 sheds by class with 429 + Retry-After; levels are exported and shown.

Levels are forced by feeding the policy a synthetic load (``observe``) with
zero dwell times and a long re-evaluation interval, so the real (idle) load
does not move them during the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.auth import KeyStore
from sluice.gateway.degradation import DegradationLevel
from sluice.gateway.pool import ModelLoad
from tests.gateway.conftest import fake_backends, gateway_config, serve_gateway

ADMIN = {"authorization": "Bearer sk-admin"}
USER = {"authorization": "Bearer sk-user"}
DEGRADE = {"rise_s": [0, 0, 0], "fall_s": 1000, "eval_interval_s": 1000, "tokens_per_replica": 1000}


def _keys(tmp_path: Path) -> KeyStore:
    f = tmp_path / "keys.yaml"
    f.write_text("keys:\n  sk-user: {tier: p0}\nadmin_keys: [sk-admin]\n")
    return KeyStore.build((), str(f))


def _force(app: Any, model: str, score: float, level: DegradationLevel) -> None:
    gw = app.state.gateway
    load = ModelLoad(num_replicas=1, num_routable=1, num_waiting=0, num_running=0, num_inflight=0,
                     inflight_tokens=int(score * 1000), p95_ttft_s=None)  # fmt: skip
    for _ in range(3):
        if gw.degradation.level(model) < level:
            gw.degradation.observe(model, load, None)
    gw.degradation.observe(model, load, None)  # refresh the score at that level
    assert gw.degradation.level(model) is level


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_level_1_caps_max_tokens_and_says_so(tmp_path: Path) -> None:
    async with fake_backends(1) as (fake,):
        cfg = gateway_config([fake.url], degradation=DEGRADE)
        async with serve_gateway(cfg, keys=_keys(tmp_path)) as (url, app), httpx.AsyncClient(timeout=10) as http:
            body = {"model": "m", "prompt": "hello", "max_tokens": 200}
            r = await http.post(url + "/v1/completions", json=body, headers=USER)
            assert r.status_code == 200 and "x-sluice-degraded" not in r.headers, "level 0 changes nothing"
            assert fake.bodies[-1]["max_tokens"] == 200
            _force(app, "m", 0.9, DegradationLevel.CAP_TOKENS)
            r = await http.post(url + "/v1/completions", json=body, headers=USER)
            cap = max(16, int(200 * (1 - 0.8)))
            assert r.status_code == 200
            assert r.headers["x-sluice-degraded"] == f"max_tokens={cap}", "the response must say it was capped"
            assert fake.bodies[-1]["max_tokens"] == cap, "the replica must get the capped max_tokens"
            assert r.json()["choices"][0]["finish_reason"] == "length"
            stream = {**body, "stream": True, "max_completion_tokens": 300}
            async with http.stream("POST", url + "/v1/chat/completions", headers=USER,
                                   json={**stream, "messages": [{"role": "user", "content": "hi"}]}) as sr:  # fmt: skip
                [ln async for ln in sr.aiter_lines()]
            assert sr.headers["x-sluice-degraded"].startswith("max_tokens=")
            assert fake.bodies[-1]["max_completion_tokens"] == fake.bodies[-1]["max_tokens"] < 300
            small = await http.post(url + "/v1/completions", json={**body, "max_tokens": 10}, headers=USER)
            assert "x-sluice-degraded" not in small.headers, "a request already under the cap is not degraded"
            metrics = (await http.get(url + "/metrics")).text
            assert _metric(metrics, "sluice_gateway_degradation_level", model="m") == 1.0
            assert _metric(metrics, "sluice_gateway_degraded_requests_total", action="cap", priority="p1") == 2.0
            assert _metric(metrics, "sluice_gateway_degradation_changes_total", direction="up") == 1.0
            view = (await http.get(url + "/admin/degradation", headers=ADMIN)).json()
            assert view["models"]["m"]["level"] == 1 and "score" in view["models"]["m"]["changes"][0]["reason"]
            assert (await http.get(url + "/admin/degradation", headers=USER)).status_code == 403


async def test_level_2_sends_p1_and_p2_to_the_fallback_and_keeps_p0(tmp_path: Path) -> None:
    async with fake_backends(2) as (primary, light):
        cfg = gateway_config(
            [],
            models={"m": {"fallback": "light", "versions": [
                {"name": "v1", "share": 100, "replicas": [primary.url]},
                {"name": "light", "share": 0, "replicas": [light.url]},
            ]}},
            degradation=DEGRADE,
        )  # fmt: skip
        async with serve_gateway(cfg, keys=_keys(tmp_path)) as (url, app), httpx.AsyncClient(timeout=10) as http:
            body = {"model": "m", "prompt": "hello", "max_tokens": 8}
            for p in ("p0", "p1", "p2"):
                r = await http.post(url + "/v1/completions", json=body, headers={**USER, "x-priority": p})
                assert r.headers["x-sluice-replica"] == primary.url, "level 0: everyone on the primary"
            _force(app, "m", 1.1, DegradationLevel.FALLBACK)
            got = {}
            for p in ("p0", "p1", "p2", "p1", "p2", "p0"):
                r = await http.post(url + "/v1/completions", json=body, headers={**USER, "x-priority": p})
                assert r.status_code == 200
                got.setdefault(p, set()).add(r.headers["x-sluice-replica"])
                if p != "p0":
                    assert "fallback=light" in r.headers["x-sluice-degraded"]
            assert got == {"p0": {primary.url}, "p1": {light.url}, "p2": {light.url}}, (
                f"level 2 must move p1/p2 to the fallback and keep p0 on the primary: {got}"
            )
            light.config.health_status = 503
            for r_ in app.state.gateway.pool.version("m", "light").replicas:
                for _ in range(3):
                    r_.health.record_probe(False, "down")
            r = await http.post(url + "/v1/completions", json=body, headers={**USER, "x-priority": "p2"})
            assert r.status_code == 200 and r.headers["x-sluice-replica"] == primary.url, (
                "with the fallback down, degraded traffic must stay on the primary, not fail"
            )


async def test_level_3_sheds_p2_then_p1_with_retry_after_and_p0_last(tmp_path: Path) -> None:
    async with fake_backends(1) as (fake,):
        cfg = gateway_config([fake.url], degradation={**DEGRADE, "retry_after_s": 3})
        async with serve_gateway(cfg, keys=_keys(tmp_path)) as (url, app), httpx.AsyncClient(timeout=10) as http:
            body = {"model": "m", "prompt": "hello", "max_tokens": 8}

            async def status(p: str) -> httpx.Response:
                return await http.post(url + "/v1/completions", json=body, headers={**USER, "x-priority": p})

            _force(app, "m", 1.3, DegradationLevel.SHED)
            r2 = await status("p2")
            assert r2.status_code == 429, "level 3 sheds p2 first"
            # retry_after_s 3 x U(1, 1.5) + U(0, 1) s of jitter, whole seconds rounded up
            assert 3 <= int(r2.headers["retry-after"]) <= 6 and r2.json()["error"]["code"] == "degraded_shed"
            assert (await status("p1")).status_code == 200, "p1 is kept while shedding p2 is enough"
            assert (await status("p0")).status_code == 200
            _force(app, "m", 1.6, DegradationLevel.SHED)
            assert (await status("p1")).status_code == 429, "past shed_p1_score p1 goes too"
            assert (await status("p0")).status_code == 200, "p0 is served while anything else can be shed"
            _force(app, "m", 2.5, DegradationLevel.SHED)
            assert (await status("p0")).status_code == 429, "p0 goes only when nothing else is left"
            metrics = (await http.get(url + "/metrics")).text
            assert _metric(metrics, "sluice_gateway_degraded_requests_total", action="shed", priority="p2") == 1.0
            assert _metric(metrics, "sluice_gateway_degradation_level", model="m") == 3.0
            received = fake.num_requests
            assert received == 3, f"shed requests must never reach the replica ({received} arrived)"


@pytest.mark.parametrize("degradation", [{"policy": "off"}, {"enter": [0.8, 0.7, 1.2]}])
def test_degradation_config_is_validated(degradation: dict[str, Any]) -> None:
    if degradation.get("policy") == "off":
        cfg = gateway_config(["http://127.0.0.1:1"], degradation=degradation)
        assert cfg.degradation.policy.value == "off"
        return
    from sluice.errors import ConfigError

    with pytest.raises(ConfigError, match="degradation"):
        gateway_config(["http://127.0.0.1:1"], degradation=degradation)


def test_fallback_must_name_a_version() -> None:
    from sluice.errors import ConfigError

    with pytest.raises(ConfigError, match="fallback"):
        gateway_config([], models={"m": {"fallback": "nope", "versions": [{"replicas": ["http://127.0.0.1:1"]}]}})
