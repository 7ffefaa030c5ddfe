"""Adapter-aware routing: adapters read from replica metrics, requests for an adapter go to a
replica that has it in memory, else one that lists it, else the usual policy."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from sluice.gateway.adapters import adapters_by_model, model_of_adapter, prefer_adapter
from sluice.gateway.pool import ReplicaPool
from sluice.gateway.prom import ReplicaLoad, parse_replica_load
from tests.gateway.conftest import fake_backends, gateway_config, serve_gateway

SLUICE_METRICS = """\
# TYPE sluice_lora_adapter_loaded gauge
sluice_lora_adapter_loaded{adapter="sql"} 1.0
sluice_lora_adapter_loaded{adapter="chat"} 0.0
# TYPE sluice_num_requests_running gauge
sluice_num_requests_running 3.0
"""

VLLM_METRICS = """\
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e9
"""


def test_adapters_are_parsed_from_sluice_and_vllm_metrics() -> None:
    load = parse_replica_load(SLUICE_METRICS)
    assert dict(load.lora_adapters) == {"sql": True, "chat": False} and load.num_running == 3
    assert dict(parse_replica_load(VLLM_METRICS).lora_adapters) == {"a": True, "b": True, "c": True}
    assert dict(parse_replica_load("sluice_num_requests_running 1\n").lora_adapters) == {}


def _pool(urls: list[str]) -> ReplicaPool:
    return ReplicaPool(gateway_config(urls, model="base"))


def test_prefer_loaded_then_registered_then_everyone() -> None:
    pool = _pool(["http://a", "http://b", "http://c"])
    a, b, c = pool.replicas()
    a.load = ReplicaLoad(lora_adapters={"sql": False})
    b.load = ReplicaLoad(lora_adapters={"sql": True, "chat": False})
    assert prefer_adapter([a, b, c], "sql") == ([b], "lora_loaded")
    assert prefer_adapter([a, c], "sql") == ([a], "lora_registered")
    assert prefer_adapter([a, b, c], "other") == ([a, b, c], "lora_fallback")
    assert model_of_adapter(pool.replicas(), "chat") == "base" and model_of_adapter(pool.replicas(), "x") is None
    assert adapters_by_model(pool.replicas()) == {"sql": "base", "chat": "base"}


async def test_adapter_requests_go_to_the_replica_that_has_it_loaded(http: httpx.AsyncClient) -> None:
    async with fake_backends(3) as fakes:
        cfg = gateway_config([f.url for f in fakes], model="base", scrape_interval=3600)
        async with serve_gateway(cfg) as (url, app):
            await _routes_by_adapter(http, url, app, fakes)


async def _routes_by_adapter(http: httpx.AsyncClient, url: str, app: Any, fakes: list[Any]) -> None:
    replicas = {r.url: r for r in app.state.gateway.pool.replicas()}
    for _ in range(500):  # the first scrape (at start) is done; the next is an hour away
        if all(r.scraped_at is not None for r in replicas.values()):
            break
        await asyncio.sleep(0.01)
    # as if scraped: b1 has "sql" in memory, b2 lists it (loads on use), b0 does not serve it
    replicas[fakes[1].url].load = ReplicaLoad(lora_adapters={"sql": True})
    replicas[fakes[2].url].load = ReplicaLoad(lora_adapters={"sql": False, "chat": False})
    served = []
    for _ in range(6):
        r = await http.post(url + "/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "sql", "the adapter name reaches the replica unchanged"
        served.append(r.headers["x-sluice-replica"])
    assert set(served) == {fakes[1].url}, "every request for a loaded adapter goes where it is loaded"
    r = await http.post(url + "/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 2})
    assert r.headers["x-sluice-replica"] == fakes[2].url, "an adapter loaded nowhere goes where it is registered"
    r = await http.post(url + "/v1/completions", json={"model": "base", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, "base requests route as usual"
    r = await http.post(url + "/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404, "a name no replica serves is unknown"
    models = (await http.get(url + "/v1/models")).json()["data"]
    assert {"id": "sql", "object": "model", "owned_by": "sluice", "parent": "base"} in models
    metrics = (await http.get(url + "/metrics")).text
    assert 'reason="lora_loaded"' in metrics and 'reason="lora_registered"' in metrics
