"""Canary rollouts on the request path, with fake replicas: a canary answering
5xx is rolled back within one window and no client request is lost (its
failures happen before the first byte and are retried on the stable version);
``POST /admin/rollout`` changes shares live, without dropping requests."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx

from sluice.auth import KeyStore
from tests.gateway.conftest import FakeClock, fake_backends, gateway_config, serve_gateway

ADMIN = {"authorization": "Bearer sk-admin"}
USER = {"authorization": "Bearer sk-user"}


def _keys(tmp_path: Path) -> KeyStore:
    f = tmp_path / "keys.yaml"
    f.write_text("keys:\n  sk-user: {tier: p0}\nadmin_keys: [sk-admin]\n")
    return KeyStore.build((), str(f))


def _two_versions(stable: str, canary: str, **overrides: object) -> object:
    return gateway_config(
        [],
        models={"m": {"versions": [
            {"name": "stable", "share": 70, "replicas": [stable]},
            {"name": "canary", "share": 30, "replicas": [canary]},
        ]}},
        rollout={"window_s": 10.0, "min_requests": 5},
        retry={"max_attempts": 3, "min_retries_per_s": 50.0},
        # keep the breaker out of it: the rollback, not the breaker, must stop the canary
        breaker={"min_requests": 1000},
        **overrides,
    )  # fmt: skip


async def test_a_5xx_canary_is_rolled_back_within_a_window_and_no_request_is_lost(
    tmp_path: Path, clock: FakeClock
) -> None:
    async with fake_backends(2) as (stable, canary):
        canary.config.fault, canary.config.status = "status", 503
        cfg = _two_versions(stable.url, canary.url)
        async with serve_gateway(cfg, keys=_keys(tmp_path), clock=clock) as (url, app), \
                httpx.AsyncClient(timeout=10) as http:  # fmt: skip
            t0 = clock()
            body = {"model": "m", "prompt": "hello", "max_tokens": 8}

            async def one(i: int) -> tuple[int, str]:
                stream = i % 2 == 0
                if not stream:
                    r = await http.post(url + "/v1/completions", json=body, headers=USER)
                    return r.status_code, r.headers.get("x-sluice-replica", "")
                async with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=USER) as r:
                    lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
                return (r.status_code if lines and lines[-1] == "data: [DONE]" else -1), r.headers.get("x-sluice-replica", "")

            results = []
            for batch in range(8):
                results += await asyncio.gather(*(one(batch * 10 + i) for i in range(10)))
                clock.advance(0.1)  # a batch every 100 ms of gateway time
            elapsed = clock() - t0
            assert Counter(s for s, _ in results) == {200: 80}, f"no request may be lost to the canary: {results}"
            assert {rep for _, rep in results} == {stable.url}, "every answer must come from the stable version"
            gw = app.state.gateway
            assert gw.pool.version("m", "canary").share == 0, "a canary answering 503 must be rolled back"
            assert elapsed < cfg.rollout.window_s, "the whole episode fits in one window"
            [event] = [e for e in gw.rollout.events if e.action == "rollback"]
            assert event.canary.num_requests <= cfg.rollout.min_requests + 10, (
                "the rollback must come as soon as the canary has min_requests attempts (plus one batch in flight)"
            )
            received = canary.num_requests
            for _ in range(10):
                await one(1)
            assert canary.num_requests == received, "a rolled back canary must get no new request"

            view = (await http.get(url + "/admin/rollout", headers=ADMIN)).json()
            ev = view["events"][0]
            assert ev["action"] == "rollback" and ev["version"] == "canary" and ev["time"] > 1e9
            assert any("5xx" in r for r in ev["reasons"]) and ev["canary"]["rate_5xx"] == 1.0
            assert ev["shares_after"] == {"stable": 70.0, "canary": 0.0}
            assert view["models"]["m"]["versions"]["canary"]["share"] == 0
            metrics = (await http.get(url + "/metrics")).text
            assert 'sluice_gateway_rollbacks_total{model="m",version="canary"} 1.0' in metrics
            assert 'sluice_gateway_version_share{model="m",version="canary"} 0.0' in metrics


async def test_post_admin_rollout_changes_shares_live_without_dropping_requests(tmp_path: Path) -> None:
    async with fake_backends(2, tokens_per_s=50) as (stable, canary):
        cfg = _two_versions(stable.url, canary.url)
        async with serve_gateway(cfg, keys=_keys(tmp_path)) as (url, app), httpx.AsyncClient(timeout=10) as http:
            pool = app.state.gateway.pool

            async def post(payload: object, headers: dict[str, str] = ADMIN) -> httpx.Response:
                return await http.post(url + "/admin/rollout", json=payload, headers=headers)

            assert (await post({"model": "m", "shares": {"canary": 100}}, USER)).status_code == 403
            bad = await post({"model": "m", "shares": {"nope": 5}})
            assert bad.status_code == 400 and "no version 'nope'" in bad.json()["error"]["message"]
            assert (await post({"model": "m", "shares": {"canary": -1}})).status_code == 400
            assert (await post({"model": "zzz", "shares": {"canary": 1}})).status_code == 404
            assert (await post({"model": "m"})).status_code == 400
            assert (await http.post(url + "/admin/rollout", content=b"{", headers=ADMIN)).status_code == 400
            assert (pool.version("m", "stable").share, pool.version("m", "canary").share) == (70, 30), (
                "rejected updates must change nothing"
            )

            body = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True}
            stop = asyncio.Event()
            results: Counter[str] = Counter()

            async def client() -> None:
                while not stop.is_set():
                    async with http.stream("POST", url + "/v1/completions", json=body, headers=USER) as r:
                        lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
                    ok = r.status_code == 200 and lines[-1] == "data: [DONE]"
                    results["ok" if ok else "failed"] += 1

            clients = [asyncio.create_task(client()) for _ in range(4)]
            await asyncio.sleep(0.3)
            r = await post({"model": "m", "shares": {"stable": 0, "canary": 100}})
            assert r.status_code == 200 and r.json()["models"]["m"]["versions"]["canary"]["share"] == 100
            before = canary.num_requests, stable.num_requests
            await asyncio.sleep(0.5)
            assert stable.num_requests - before[1] <= 4, "after the change only requests already routed hit stable"
            assert canary.num_requests > before[0]
            await post({"model": "m", "shares": {"stable": 100, "canary": 0}})
            await asyncio.sleep(0.3)
            stop.set()
            await asyncio.gather(*clients)
            assert results["failed"] == 0 and results["ok"] > 10, f"share changes must drop nothing: {results}"
            events = (await http.get(url + "/admin/rollout", headers=ADMIN)).json()["events"]
            assert [e["action"] for e in events] == ["set_shares", "set_shares"]
