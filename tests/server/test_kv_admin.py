"""``/admin/kv`` and ``/admin/kv/checkpoint``: the admin key, the report, the engine round trip, the metrics."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from sluice.engine.config import EngineConfig
from sluice.engine.protocol import EngineControl, EngineStats, KVTierStats
from sluice.server.admin import kv_report
from sluice.server.engine_proc import _control
from sluice.server.engine_setup import StepProfiler
from sluice.server.testing import FakeEngineCore
from tests.server.conftest import ServerThread, scrape, start_fake_server


@pytest.fixture(scope="module")
def open_server() -> Iterator[ServerThread]:
    srv = start_fake_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text("keys:\n  sk-user: {tier: p1}\nadmin_keys: [sk-ops]\n")
    srv = start_fake_server(keys_file=str(keys))
    yield srv
    srv.stop()


def _get(srv: ServerThread, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(srv.url + "/admin/kv", headers=headers, timeout=10)


def _checkpoint(srv: ServerThread, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + "/admin/kv/checkpoint", headers=headers, timeout=30)


def test_without_keys_the_admin_routes_are_open_to_loopback_clients(open_server: ServerThread) -> None:
    doc = _get(open_server).json()
    assert doc["tiers"][0]["name"] == "memory" and doc["tiers"][0]["num_blocks"] > 0
    r = _checkpoint(open_server)
    assert r.status_code == 200 and r.json()["reason"] == "fake engine", "the engine's report comes back"


def test_with_keys_the_admin_routes_need_an_admin_key(keyed_server: ServerThread) -> None:
    for call in (_get, _checkpoint):
        assert call(keyed_server).status_code == 401, "no key"
        r = call(keyed_server, "sk-user")
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", "a user key is not enough"
        assert call(keyed_server, "sk-ops").status_code == 200


def test_with_keys_but_no_admin_key_the_admin_routes_are_off() -> None:
    srv = start_fake_server(api_key=["sk-only-user"])
    try:
        r = _get(srv, "sk-only-user")
        assert r.status_code == 403 and "no admin key" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_the_report_splits_hits_by_tier() -> None:
    disk = KVTierStats(name="disk", num_blocks=40, num_bytes=4 << 20, capacity_bytes=1 << 30, hit_blocks=30,
                       hit_tokens=480, num_request_loads=3, load_seconds=0.3, num_stored_blocks=50)
    s = EngineStats(num_total_blocks=100, kv_cache_bytes=100 * 4096, num_cached_blocks=20, prefix_cache_queries=1000,
                    prefix_cache_hits=320, kv_cache_dtype="fp8", kv_tiers=[disk])
    doc = kv_report(s)
    mem, d = doc["tiers"]
    assert (mem["hit_rate"], d["hit_rate"], doc["hit_rate"]) == (0.32, 0.48, 0.8)
    assert mem["cached_bytes"] == 20 * 4096 and mem["kv_cache_dtype"] == "fp8"
    assert d["loads"]["requests"] == 3 and d["stores"]["blocks"] == 50


def test_engine_commands_report_errors_instead_of_crashing_the_engine() -> None:
    engine = FakeEngineCore(EngineConfig(model="fake"))
    ok = _control(engine, StepProfiler(), EngineControl(id=1, command="kv_checkpoint"), {})
    bad = _control(engine, StepProfiler(), EngineControl(id=2, command="format_disk"), {})
    assert ok is not None and bad is not None
    assert ok.id == 1 and ok.error is None and ok.result["reason"] == "fake engine"
    assert bad.id == 2 and bad.error is not None and "unknown engine command" in bad.error.message


def test_tier_metrics_are_exported(open_server: ServerThread) -> None:
    httpx.post(open_server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=10)
    m = scrape(open_server.url)
    assert 'sluice_kv_tier_blocks{tier="memory"}' in m and 'sluice_kv_tier_hit_tokens_total{tier="memory"}' in m
