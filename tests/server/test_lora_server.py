"""LoRA adapters over HTTP on the real engine (tiny random Llama): /v1/models, adapter requests,
load/unload under load, admin keys, metrics, and one trace from the gateway to the adapter load."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice.server.app import build_app
from sluice.server.config import load_settings
from tests.server.conftest import ServerThread, scrape

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lora_factory import make_lora_dir  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from sluice.models.config import ModelConfig
    from tests.model_factory import make_tiny_model_dir

    root = tmp_path_factory.mktemp("lora-server")
    model = make_tiny_model_dir(root / "tiny-llama")
    cfg = ModelConfig.from_hf(json.loads((model / "config.json").read_text()))
    other = ModelConfig(**{**cfg.__dict__, "hidden_size": 2 * cfg.hidden_size, "head_dim": 2 * cfg.head_dim})
    return {
        "model": model,
        "a": make_lora_dir(root / "a", cfg, rank=4, seed=1),
        "b": make_lora_dir(root / "b", cfg, targets=("q_proj", "o_proj", "down_proj"), rank=8, seed=2),
        "c": make_lora_dir(root / "c", cfg, rank=2, seed=3),
        "big": make_lora_dir(root / "big", cfg, rank=64, seed=4),
        "other": make_lora_dir(root / "other", other, rank=4, seed=5),
    }


def start(tiny: dict[str, Path], provider: TracerProvider | None = None, **settings: Any) -> ServerThread:
    s = load_settings(model=str(tiny["model"]), kv_cache_memory="32MiB", max_model_len=512, max_lora_rank=16,
                      enable_runtime_lora=True, lora_dir=[str(tiny["model"].parent)], **settings)  # fmt: skip
    return ServerThread(build_app(s, tracer_provider=provider)).start(timeout=120)


@pytest.fixture(scope="module")
def server(tiny: dict[str, Path]) -> Iterator[ServerThread]:
    srv = start(tiny, lora_modules=[f"a={tiny['a']}"], max_loras=2, max_cpu_loras=2)
    yield srv
    srv.stop()


def complete(url: str, model: str, **kw: Any) -> httpx.Response:
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True, **kw}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_models_lists_adapters_with_their_parent_and_requests_pick_them(server: ServerThread) -> None:
    data = httpx.get(server.url + "/v1/models").json()["data"]
    base = data[0]["id"]
    assert {"id": "a", "parent": base, "root": str(Path(server.state.settings.engine.lora_module_paths["a"]))}.items() <= data[1].items()
    r_base, r_a = complete(server.url, base), complete(server.url, "a")
    assert r_base.status_code == r_a.status_code == 200
    assert r_a.json()["model"] == "a" and r_base.json()["model"] == base, "the response names the model asked for"
    assert r_a.json()["choices"][0]["text"] != r_base.json()["choices"][0]["text"], "the adapter changes the output"
    assert complete(server.url, "a").json()["choices"][0]["text"] == r_a.json()["choices"][0]["text"]
    r = complete(server.url, "nope")
    assert r.status_code == 404 and "'a'" in r.json()["error"]["message"], "404 lists the adapters"


def test_bad_loads_are_400_naming_the_problem_and_leave_nothing(server: ServerThread, tiny: dict[str, Path]) -> None:
    url = server.url + "/v1/load_lora_adapter"
    cases = {
        str(tiny["model"] / "missing"): "not a directory",
        str(tiny["other"]): "does not fit this base model",
        str(tiny["big"]): "above --max-lora-rank 16",
        str(tiny["model"]): "adapter_config.json",
    }
    before = httpx.get(server.url + "/v1/models").json()["data"]
    for path, words in cases.items():
        r = httpx.post(url, json={"lora_name": "bad", "lora_path": path}, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (path, r.text)
    r = httpx.post(url, json={"lora_name": "a", "lora_path": str(tiny["b"])}, timeout=60)
    assert r.status_code == 400 and "already loaded" in r.text
    assert httpx.get(server.url + "/v1/models").json()["data"] == before, "a refused adapter was registered"
    assert complete(server.url, "bad").status_code == 404
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "bad"}).status_code == 404


async def test_load_and_unload_under_load_fail_no_request(server: ServerThread, tiny: dict[str, Path]) -> None:
    url = server.url
    base = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    statuses: list[tuple[str, int]] = []
    stop = asyncio.Event()

    async with httpx.AsyncClient(timeout=60) as http:

        async def post(model: str, **kw: Any) -> httpx.Response:
            body = {"model": model, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True, **kw}
            return await http.post(url + "/v1/completions", json=body)

        async def worker(models: list[str]) -> None:
            while not stop.is_set():
                for m in list(models):
                    statuses.append((m, (await post(m)).status_code))

        models = [base]
        workers = [asyncio.create_task(worker(models)) for _ in range(4)]
        long_a = asyncio.create_task(post("a", max_tokens=120))  # in flight across the unload
        await asyncio.sleep(0.2)
        r = await http.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(tiny["b"])})
        assert r.status_code == 200 and "added successfully" in r.text, r.text
        models.append("b")  # the workers use it from now on
        r = await http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 200, r.text
        assert (await post("a")).status_code == 404, "an unloaded adapter is unknown to new requests"
        for _ in range(600):  # the workers use the new adapter for a while
            if sum(m == "b" for m, _ in statuses) >= 4:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*workers)
        done = await long_a
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 120, "the in-flight request finished"
    assert statuses and all(code == 200 for _, code in statuses), f"failed: {[s for s in statuses if s[1] != 200][:5]}"
    assert sum(m == "b" for m, _ in statuses) >= 4
    names = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert "b" in names and "a" not in names
    metrics = scrape(url)
    assert metrics['sluice_lora_adapter_loaded{adapter="b"}'] == 1.0
    assert metrics["sluice_lora_loads_total"] >= 2 and metrics["sluice_lora_load_seconds_count"] >= 1


def test_load_endpoints_need_an_admin_key_when_keys_are_configured(tiny: dict[str, Path], tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  sk-user: {tier: p1}\nadmin_keys: [sk-admin]\n")
    srv = start(tiny, keys_file=str(keys))
    try:
        body = {"lora_name": "c", "lora_path": str(tiny["c"])}
        for headers, status in (({}, 401), ({"authorization": "Bearer sk-user"}, 403)):
            r = httpx.post(srv.url + "/v1/load_lora_adapter", json=body, headers=headers, timeout=60)
            assert r.status_code == status, r.text
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json=body, headers={"authorization": "Bearer sk-admin"}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/v1/completions", headers={"authorization": "Bearer sk-user"}, timeout=60,
                       json={"model": "c", "prompt": "x", "max_tokens": 2})  # fmt: skip
        assert r.status_code == 200, "any key may use a loaded adapter"
    finally:
        srv.stop()


async def test_one_trace_from_the_gateway_span_to_the_adapter_load(tiny: dict[str, Path]) -> None:
    from tests.gateway.conftest import gateway_config, serve_gateway

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # two adapters, one slot: "a" is evicted at start-up, so a request for it loads it
    srv = start(tiny, provider, lora_modules=[f"a={tiny['a']}", f"c={tiny['c']}"], max_loras=1, max_cpu_loras=1)
    try:
        cfg = gateway_config([srv.url], model="tiny", scrape_interval=0.1)
        async with serve_gateway(cfg, tracer_provider=provider) as (gw, app), httpx.AsyncClient(timeout=60) as http:
            for _ in range(200):  # the gateway learns the replica's adapters from its /metrics
                if any("a" in r.load.lora_adapters for r in app.state.gateway.pool.replicas()):
                    break
                await asyncio.sleep(0.05)
            r = await http.post(gw + "/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200, r.text
        for _ in range(100):  # the load record reaches the API process with the engine's next output
            if any(s.name == "lora_load" for s in exporter.get_finished_spans()):
                break
            await asyncio.sleep(0.05)
    finally:
        srv.stop()
    spans = exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    route, server_span, load = by_name["gateway.route"], by_name["POST /v1/completions"], by_name["lora_load"]
    trace_id = route.context.trace_id
    assert server_span.context.trace_id == trace_id == load.context.trace_id, "one trace from gateway to the load"
    assert server_span.parent is not None and load.parent is not None
    assert load.parent.span_id == server_span.context.span_id, "the load is a child of the request that caused it"
    assert load.attributes["sluice.lora.adapter"] == "a" and load.attributes["sluice.lora.bytes"] > 0
    assert load.attributes["sluice.lora.duration_s"] > 0 and load.attributes["sluice.lora.cause"] == "request"
    assert server_span.start_time <= load.start_time <= load.end_time <= server_span.end_time
