"""Several engine cores behind one API process (``--data-parallel-size``, NOTE(data-parallel) in
sluice.server.lanes): the stats merge, the lanes' configs, the admission's choice of a lane, the
client's routing, and a server with two fake engine cores end to end."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.engine.config import EngineConfig
from sluice.engine.protocol import EngineStats, KVTierStats
from sluice.errors import ConfigError, OverloadedError
from sluice.server.admission import AdmissionController
from sluice.server.config import load_settings
from sluice.server.lanes import (
    LanedAdmission,
    LanedClient,
    build_admission,
    data_parallel_lanes,
    lane_configs,
    lane_lending,
    merge_stats,
    prompt_block_keys,
)
from sluice.server.telemetry import ServerMetrics
from sluice.types import Priority
from tests.server.conftest import ServerThread, start_fake_server


def test_merge_stats_sums_amounts_averages_levels_and_joins_lists() -> None:
    a = EngineStats(num_running=3, num_waiting_by_priority=[1, 0, 2], kv_cache_usage=0.2, num_steps=10,
                    running_slots=[[0, 1, 5]], step_time_per_token=0.001, express_mid_step=False,
                    kv_tiers=[KVTierStats(name="disk", num_blocks=4, recent_load_seconds=[0.1])])  # fmt: skip
    b = EngineStats(num_running=4, num_waiting_by_priority=[0, 3, 1], kv_cache_usage=0.4, num_steps=5,
                    running_slots=[[2, 0, 9]], step_time_per_token=0.003, express_mid_step=True,
                    kv_tiers=[KVTierStats(name="disk", num_blocks=6, recent_load_seconds=[0.2])])  # fmt: skip
    m = merge_stats([a, b])
    assert m.num_running == 7 and m.num_steps == 15
    assert m.num_waiting_by_priority == [1, 3, 3]
    assert m.kv_cache_usage == pytest.approx(0.3) and m.step_time_per_token == pytest.approx(0.002)
    assert m.running_slots == [[0, 1, 5], [2, 0, 9]]
    assert m.express_mid_step is True
    assert len(m.kv_tiers) == 1 and m.kv_tiers[0].num_blocks == 10
    assert m.kv_tiers[0].recent_load_seconds == [0.1, 0.2]
    assert merge_stats([a]) is a


def test_lanes_metrics_merge_at_scrape_and_count_each_tier_wait_once() -> None:
    a, b = _StubClient(), _StubClient()
    client = LanedClient([a, b], {})  # type: ignore[list-item]
    metrics = ServerMetrics("m")
    metrics.engine.source = lambda: client.stats
    a.stats = EngineStats(num_running=1, kv_tiers=[KVTierStats(name="disk", recent_load_seconds=[0.5])])
    metrics.observe_stats(a.stats)  # what the app does with each lane's stats as they arrive
    b.stats = EngineStats(num_running=2, kv_tiers=[KVTierStats(name="disk", recent_load_seconds=[0.25])])
    metrics.observe_stats(b.stats)
    assert client.stats.num_running == 3
    text = metrics.render().decode()
    assert "sluice_num_requests_running 3.0" in text  # the merged snapshot, read at scrape time
    assert 'sluice_kv_tier_load_seconds_count{tier="disk"} 2.0' in text  # each lane's wait once


def test_lane_configs_share_the_cores_threads_and_tier_directories() -> None:
    cfg = EngineConfig(model="fake", kv_disk_dir="/var/kv")
    lanes = lane_configs(cfg, 2, (0, 1, 2))
    assert [cpus for _, cpus in lanes] == [(0, 1), (2,)]
    assert [c.num_threads for c, _ in lanes] == [2, 1]
    # NOTE(lane-tiers): the first lane's tier is one engine's, the others' beside it, and a lane's config
    # differs from the engine's only in fields that leave the tier's fingerprint alone: the first lane
    # finds the blocks one engine stored there, and one engine those of the first lane
    assert [c.kv_disk_dir for c, _ in lanes] == ["/var/kv", "/var/kv/lane-1"]
    from sluice.engine.kv_tiers.factory import _NO_EFFECT_ON_KV

    for lane_cfg, _ in [*lanes, *lane_configs(cfg, 2, None)]:
        changed = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(lane_cfg, f.name)}
        assert changed <= _NO_EFFECT_ON_KV
    # fewer cores than lanes: every lane may use them all, one thread each
    assert [(c.num_threads, cpus) for c, cpus in lane_configs(cfg, 3, (4, 5))] == [(1, (4, 5))] * 3
    # threads given: kept; not pinned: the cores this process may use, shared out
    assert all(c.num_threads == 3 for c, _ in lane_configs(EngineConfig(model="fake", num_threads=3), 2, None))
    assert all(c.num_threads and c.num_threads >= 1 for c, _ in lane_configs(EngineConfig(model="fake"), 2, None))
    # one engine: a thread per pinned core, else the engine's default
    assert lane_configs(cfg, 1, (0, 1)) == [(dataclasses.replace(cfg, num_threads=2), (0, 1))]
    assert lane_configs(cfg, 1, None) == [(cfg, None)]


def test_an_engine_takes_the_idle_lanes_cores_and_gives_them_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE(lane-lend): before each step an engine runs on every core if the other lanes have been idle for
    LEND_AFTER_S, else on its share."""
    from sluice.kernels import ext
    from sluice.server.lanes import LEND_AFTER_S

    monkeypatch.delenv("SLUICE_LANE_LEND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cfg = EngineConfig(model="fake")
    first, second = lane_lending(cfg, 2, None)
    assert first is not None and second is not None and first.marks is second.marks
    assert (first.own, first.lent) == (2, 4)
    assert [c.num_threads for c, _ in lane_configs(cfg, 2, None)] == [4, 4], "a pool thread per core to lend"
    now = [time.monotonic()]
    first.clock = second.clock = lambda: now[0]
    calls: list[int] = []
    monkeypatch.setattr(ext, "set_work_pool_active", calls.append)
    monkeypatch.setattr(ext, "work_pool_threads", lambda: 4)  # the model runs on sluice's work pool
    first.update(True)  # the second has been idle only since the lanes were made: its share
    now[0] += LEND_AFTER_S
    first.update(True)  # idle long enough now: all four cores
    second.update(True)  # the first busy: its share
    first.update(True)  # the second busy too: back to its share
    second.update(False)  # idle: its mark is set, nothing to change
    now[0] += LEND_AFTER_S / 2
    first.update(True)  # a gap between the second's steps: not lent yet
    now[0] += LEND_AFTER_S / 2 + 1e-9  # (past the boundary: two halves added to a large clock may round below it)
    first.update(True)  # idle long enough: all of them
    second.update(False)  # still idle: its mark stays where it was
    assert calls == [2, 4, 2, 2, 4]
    assert first.marks[0] == 0.0 and 0.0 < second.marks[1] <= now[0] - LEND_AFTER_S
    # a model on torch's threads (not on the pool): they keep the lane's share, and it never borrows
    import torch

    threads: list[int] = []
    monkeypatch.setattr(ext, "work_pool_threads", lambda: 0)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    (dense, _) = lane_lending(cfg, 2, None)
    assert dense is not None
    dense.clock = lambda: now[0] + 10 * LEND_AFTER_S  # every other lane long idle
    calls.clear()
    dense.update(True)
    dense.update(True)
    assert threads == [2] and calls == [2] and dense.lent == 2
    # not lent: one lane, pinned cores, threads given, or switched off
    assert lane_lending(cfg, 1, None) == [None]
    assert lane_lending(cfg, 2, (0, 1, 2, 3)) == [None, None]
    assert lane_lending(EngineConfig(model="fake", num_threads=1), 2, None) == [None, None]
    assert [c.num_threads for c, _ in lane_configs(EngineConfig(model="fake", num_threads=1), 2, None)] == [1, 1]
    monkeypatch.setenv("SLUICE_LANE_LEND", "0")
    assert lane_lending(cfg, 2, None) == [None, None]
    assert [c.num_threads for c, _ in lane_configs(cfg, 2, None)] == [2, 2]


def _lanes(n: int, **kw: Any) -> LanedAdmission:
    args = {"max_queued_requests": 8, "max_queued_tokens": 10_000, **kw}
    return LanedAdmission([AdmissionController(**args) for _ in range(n)], {})


def test_p0s_spread_over_the_lanes_by_the_ones_waiting_for_a_first_output() -> None:
    adm = _lanes(2)
    assert adm.admit("a", Priority.P0, 20, 10).lane == 0
    assert adm.admit("b", Priority.P0, 20, 10).lane == 1  # lane 0 has a P0 waiting
    assert adm.admit("c", Priority.P0, 20, 10).lane == 0  # one each: the fewest queued, lane 0
    adm.started("b")  # lane 1's P0 got its first output
    assert adm.admit("d", Priority.P0, 20, 10).lane == 1
    assert adm.num_queued == 3
    for k in "abcd":
        adm.remove(k)
    assert adm.num_queued == 0 and adm._assigned == {}


def test_a_lone_stream_stays_in_the_first_lane_while_every_lane_is_idle() -> None:
    """NOTE(lane-lend): the lanes' predictions differ when idle by their measurements only; a lone stream
    stays in one lane, so that lane finds the others idle long enough to borrow their cores."""
    from tests.server.slo_fakes import FakeClock, controller, stats

    clock = FakeClock()
    slow, fast = controller("p0=0.5s", clock), controller("p0=0.5s", clock)
    slow.observe_stats(stats(step_time_base=0.05))
    fast.observe_stats(stats(step_time_base=0.01))  # predicts a lone request sooner
    adm = LanedAdmission([slow, fast], {})
    for k in "abc":  # one request after another
        assert adm.admit(k, Priority.P2, 20, 10).lane == 0
        adm.remove(k)
    assert adm.admit("d", Priority.P2, 20, 10).lane == 0
    assert adm.admit("e", Priority.P2, 20, 10).lane == 1, "a lane busy: the shortest predicted wait again"
    adm.remove("d")
    adm.remove("e")
    slow.observe_stats(stats(step_time_base=0.05, num_running=1))  # nothing queued, but lane 0's engine runs one
    assert adm.admit("f", Priority.P2, 20, 10).lane == 1


def test_a_prompt_goes_to_the_lane_that_holds_its_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE(lane-prefix): a conversation's next turn goes to the lane its history was sent to, whose prefix
    cache likely holds it, unless it would miss its class's target there; while every lane is idle, to the
    lane that holds most of it."""
    from tests.server.slo_fakes import FakeClock, controller, stats

    def lanes() -> LanedAdmission:
        clock = FakeClock()
        ctrls = [controller("p2=5s", clock), controller("p2=5s", clock)]
        for c in ctrls:
            c.observe_stats(stats())  # 10 ms a step + 1 ms a batched token
        return LanedAdmission(ctrls, {})

    history = list(range(1000, 1400))  # 400 tokens: 25 full blocks
    turn = history + list(range(5000, 5040))
    adm = lanes()
    assert adm.admit("t1", Priority.P2, 440, 400, [history]).lane == 0  # every lane idle: the first
    adm.remove("t1")
    assert adm.cached_tokens(0, [prompt_block_keys(turn)]) == 400 and adm.cached_tokens(1, [prompt_block_keys(turn)]) == 0
    assert adm.admit("x", Priority.P2, 30, 10, [[7] * 10]).lane == 0  # lane 0 now has a request queued
    assert adm.admit("t2", Priority.P2, 480, 440, [turn]).lane == 0, "the lane with the history, though busier"
    for k in ("x", "t2"):
        adm.remove(k)
    # a lane that holds nothing of it: the shortest predicted wait, as before
    assert adm.admit("y", Priority.P2, 30, 10, [[7] * 10]).lane == 0
    assert adm.admit("other", Priority.P2, 480, 440, [list(range(9000, 9440))]).lane == 1
    adm.remove("y")
    adm.remove("other")
    # every lane idle: the one holding most of the prompt, not the first
    assert adm.admit("t3", Priority.P2, 480, 440, [list(range(9000, 9440)) + [1] * 20]).lane == 1
    adm.remove("t3")
    # the lane holding the history would be late (its queue alone is over P2's 5-s target): the other lane
    adm.lanes[0].observe_stats(stats(num_running=3, num_waiting=3, num_waiting_by_priority=[0, 0, 3],
                                     num_prefill_tokens_by_priority=[0, 0, 6000]))  # fmt: skip
    assert adm.lanes[0].predict(adm.lanes[0].load(), Priority.P2, 40) > 5.0
    assert adm.admit("t4", Priority.P2, 480, 440, [turn]).lane == 1
    adm.remove("t4")
    adm.lanes[0].observe_stats(stats())
    # blocks are keyed by everything before them: the same block after another history is not a hit
    assert adm.cached_tokens(0, [prompt_block_keys([5] * 16 + history)]) == 0
    # SLUICE_LANE_PREFIX=0: the shortest predicted wait only
    monkeypatch.setenv("SLUICE_LANE_PREFIX", "0")
    adm = lanes()
    assert adm.admit("t1", Priority.P2, 440, 400, [history]).lane == 0
    adm.remove("t1")
    assert adm.admit("x", Priority.P2, 30, 10, [[7] * 10]).lane == 0
    assert adm.admit("t2", Priority.P2, 480, 440, [turn]).lane == 1


def test_the_prefix_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice.server.lanes as lanes_mod

    monkeypatch.setattr(lanes_mod, "PREFIX_MEMORY_BLOCKS", 4)
    adm = _lanes(2)
    old, new = list(range(64)), list(range(100, 164))  # 4 blocks each
    adm.admit("a", Priority.P2, 80, 64, [old])
    adm.remove("a")
    adm.admit("b", Priority.P2, 80, 64, [new])
    assert adm.prefix_memory is not None and len(adm.prefix_memory[0]) == 4
    assert adm.cached_tokens(0, [prompt_block_keys(new)]) == 64 and adm.cached_tokens(0, [prompt_block_keys(old)]) == 0


def test_a_request_is_refused_only_when_every_lane_refuses_it() -> None:
    adm = _lanes(2, max_queued_requests=1)
    assert adm.admit("x", Priority.P2, 20, 10).lane == 0
    assert adm.admit("y", Priority.P2, 20, 10).lane == 1  # lane 0 is full: the other lane takes it
    with pytest.raises(OverloadedError) as e:
        adm.admit("z", Priority.P2, 20, 10)
    assert e.value.code == "queue_full" and "z" not in adm._assigned
    # a P0 sheds a queued P2 in the lane it goes to, and only there
    d = adm.admit("p", Priority.P0, 20, 10)
    assert d.shed == ["x"] and d.lane == 0
    assert adm.num_queued == 2
    assert adm.refuse_early(Priority.P2) is None  # nothing refused by predicted wait: parse and admit


def test_one_engine_core_is_admitted_by_the_same_object_as_its_controller_alone() -> None:
    """No second path for one engine core: a one-lane LanedAdmission decides as its controller alone does."""
    from tests.server.slo_fakes import FakeClock, controller, stats

    clock = FakeClock()
    alone, inner = controller("p0=0.2s", clock), controller("p0=0.2s", clock)
    adm = LanedAdmission([inner], {})
    assert adm.prefix_memory is None, "one lane: no lane to choose, no prompt blocks to remember"
    for c in (alone, inner):
        c.observe_stats(stats())
    for i in range(3):
        assert adm.admit(f"p2-{i}", Priority.P2, 116, 100, [[1] * 100]) == dataclasses.replace(
            alone.admit(f"p2-{i}", Priority.P2, 116, 100), lane=0)
    d = adm.admit("p0", Priority.P0, 101, 100)
    assert d == alone.admit("p0", Priority.P0, 101, 100) and d.shed == ["p2-2", "p2-1"]
    adm.observe_stats(0, stats(num_running_by_priority=[0, 1, 0]))
    assert inner.load().num_running_by_priority == [0, 1, 0] and adm.num_queued == alone.num_queued == 2
    for k in ("p2-0", "p0"):
        adm.remove(k)
    assert adm.num_queued == 0 and adm._assigned == {"p2-2": 0, "p2-1": 0}, "the shed ones leave when serving removes them"


def test_the_server_bounds_are_shared_out_over_the_lanes() -> None:
    settings = load_settings(model="fake", max_queued_requests=5, max_queued_tokens=1001, slo="p0=1s",
                             max_queue_wait=30)  # fmt: skip
    one, two = build_admission(settings, 1, {}), build_admission(settings, 2, {})
    assert [(a.max_requests, a.max_tokens) for a in one.lanes] == [(5, 1001)]
    assert [(a.max_requests, a.max_tokens) for a in two.lanes] == [(3, 501)] * 2, "rounded up"
    assert all(a.slo is not None and a.slo.seconds[0] == 1.0 and a.max_queue_wait == 30 for a in two.lanes)


class _StubClient:
    def __init__(self) -> None:
        self.commands: list[str] = []
        self.aborted: list[str] = []
        self.is_dead = False
        self.num_open_requests = 1
        self.stats = EngineStats()

    async def control(self, command: str, timeout: float = 600.0, **args: Any) -> dict[str, Any]:
        self.commands.append(command)
        return {"command": command, "lane": id(self)}

    def abort(self, ids: list[str]) -> None:
        self.aborted += ids


def test_commands_reach_every_lane_but_profiling_the_first_and_aborts_follow_the_request() -> None:
    a, b = _StubClient(), _StubClient()
    client = LanedClient([a, b], {"r1": 1})  # type: ignore[list-item]
    reply = asyncio.run(client.control("lora_load", name="x", path="/p"))
    assert a.commands == ["lora_load"] and b.commands == ["lora_load"] and reply["lane"] == id(a)
    asyncio.run(client.control("profile_start"))
    assert a.commands == ["lora_load", "profile_start"] and b.commands == ["lora_load"]
    client.abort(["r1-0", "r1-1"])
    assert a.aborted == [] and b.aborted == ["r1-0", "r1-1"]
    client.abort(["gone-0"])  # a request whose lane is forgotten: every lane is told (an unknown id is a no-op)
    assert a.aborted == ["gone-0"] and b.aborted[-1] == "gone-0"
    assert client.num_open_requests == 2 and not client.is_dead
    b.is_dead = True
    assert client.is_dead


def test_more_than_one_engine_core_is_cpu_only() -> None:
    with pytest.raises(ConfigError, match="data-parallel-size.*CPU only"):
        load_settings(model="fake", data_parallel_size=2, device="cuda")
    with pytest.raises(ConfigError, match="data-parallel-size"):
        load_settings(model="fake", data_parallel_size=0)


def test_data_parallel_size_is_auto_or_a_count_and_a_bad_one_is_one_line() -> None:
    assert load_settings(model="fake").data_parallel_size == "1"
    assert load_settings(model="fake", data_parallel_size=2).data_parallel_size == "2"
    assert load_settings(model="fake", data_parallel_size=" Auto ").data_parallel_size == "auto"
    assert load_settings(model="fake", environ={"SLUICE_DATA_PARALLEL_SIZE": "AUTO"}).data_parallel_size == "auto"
    for bad in ("two", "65", "-1", True):
        with pytest.raises(ConfigError, match="data-parallel-size: must be auto or a number of engine cores"):
            load_settings(model="fake", data_parallel_size=bad)
    # auto on a GPU is one engine core, not an error
    assert load_settings(model="fake", device="cuda", data_parallel_size="auto").data_parallel_size == "auto"


def test_auto_runs_two_lanes_only_where_they_were_measured_to_help(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """NOTE(dp-auto): two lanes for sluice's engine on 2-3 unpinned cores with quantized weights that fit
    twice; one engine core everywhere else, with the reason for the log."""
    import psutil

    import sluice.server.lanes as lanes_mod

    machine = {"cores": {0, 1}}
    monkeypatch.setattr(lanes_mod.os, "sched_getaffinity", lambda pid: machine["cores"])
    monkeypatch.delenv("SLUICE_LANE_LEND", raising=False)
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"\0" * 4096)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "model.safetensors").write_bytes(b"\0" * 4096)

    def lanes(model: Path | str = gguf, setting: str = "auto", cpus: Any = None, custom: bool = False, **kw: Any) -> int:
        n, why = data_parallel_lanes(setting, EngineConfig(model=str(model), **kw), cpus, custom)
        assert why.startswith("auto: " if setting == "auto" else "--data-parallel-size")
        return n

    assert lanes() == 2
    assert data_parallel_lanes("auto", EngineConfig(model=str(gguf)), None)[1] == "auto: 2 cores, quantized weights"
    assert lanes(setting="3") == 3 and lanes(setting="1") == 1  # a count is taken as it is
    assert lanes(quantization="none") == 1  # dequantized: BLAS on torch's threads, not lent
    assert lanes(hf) == 1  # a float checkpoint
    assert lanes(hf, quantization="int4") == 2  # quantized at load
    (hf / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    assert lanes(hf) == 2
    assert lanes(num_threads=1) == 1 and lanes(cpus=(0, 1)) == 1 and lanes(custom=True) == 1
    assert lanes(device="cuda") == 1
    assert lanes(tmp_path / "missing.gguf") == 1  # the engine reports a missing model
    monkeypatch.setenv("SLUICE_LANE_LEND", "0")
    assert lanes() == 1
    monkeypatch.delenv("SLUICE_LANE_LEND")
    for cores in ({0}, {0, 1, 2, 3}):
        machine["cores"] = cores
        assert lanes() == 1
    machine["cores"] = {0, 1, 2}
    assert lanes() == 2
    # two copies of the weights must fit in half the free memory
    free = type("VM", (), {"available": 4096 * 3})()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    assert lanes() == 1
    free.available = 4096 * 4
    assert lanes() == 2


@pytest.fixture(scope="module")
def dp_server() -> Any:
    srv = start_fake_server(step_delay=0.01, data_parallel_size=2)
    yield srv
    srv.stop()


async def _complete(client: httpx.AsyncClient, url: str, prompt: str, priority: str) -> httpx.Response:
    return await client.post(url + "/v1/completions", headers={"x-priority": priority},
                             json={"model": "fake", "prompt": prompt, "max_tokens": 6, "temperature": 0})  # fmt: skip


def test_two_engine_cores_serve_requests_from_both_and_forget_them_after(dp_server: ServerThread) -> None:
    state = dp_server.state

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as c:
            return await asyncio.gather(*(_complete(c, dp_server.url, f"hello {i}", "p0" if i % 2 else "p2")
                                          for i in range(12)))  # fmt: skip

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 12
    texts = [r.json()["choices"][0]["text"] for r in responses]
    assert all(len(t) == 6 for t in texts)
    # the same prompt gives the same greedy text whichever lane serves it
    again = httpx.post(dp_server.url + "/v1/completions", json={"model": "fake", "prompt": "hello 3", "max_tokens": 6,
                                                                "temperature": 0}, timeout=30)  # fmt: skip
    assert again.json()["choices"][0]["text"] == texts[3]
    assert isinstance(state.client, LanedClient)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(c.stats.num_steps for c in state.client.clients):
        time.sleep(0.05)
    assert all(c.stats.num_steps > 0 for c in state.client.clients)  # both engines served
    assert state.client.stats.num_steps == sum(c.stats.num_steps for c in state.client.clients)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (state.client._lanes or state.client.num_open_requests):
        time.sleep(0.05)
    assert state.admission.num_queued == 0 and state.client.num_open_requests == 0
    assert state.client._lanes == {}  # no request left assigned to a lane


def test_a_client_gone_mid_stream_is_aborted_in_its_lane(dp_server: ServerThread) -> None:
    body = {"model": "fake", "prompt": "long one", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", dp_server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            break  # the first event, then hang up
    client = dp_server.state.client
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and client.num_open_requests:
        time.sleep(0.05)
    assert client.num_open_requests == 0 and dp_server.state.admission.num_queued == 0
    assert httpx.get(dp_server.url + "/health", timeout=5).status_code == 200


def test_one_engine_core_dying_fails_its_requests_and_the_health_check() -> None:
    srv = start_fake_server(step_delay=0.02, data_parallel_size=2)
    try:
        client = srv.state.client
        assert isinstance(client, LanedClient)
        body = {"model": "fake", "prompt": "doomed", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # started, in some lane
            (lane,) = client._lanes.values()
            pid = client.clients[lane].pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            rest = "\n".join(lines)
        assert "the engine core process died" in rest and rest.strip().endswith("data: [DONE]")
        assert client.is_dead and not client.clients[1 - lane].is_dead
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
    finally:
        srv.stop()


def test_two_real_engine_cores_load_an_adapter_each_and_answer_alike(tmp_path: Path) -> None:
    """The tiny random Llama on two lanes: an adapter loaded over HTTP is loaded by both engines, and the
    same greedy request gives the same tokens from either lane (same weights, batch-invariant kernels)."""
    from sluice.models.config import ModelConfig
    from sluice.server.app import build_app
    from tests.lora_factory import make_lora_dir
    from tests.model_factory import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "tiny-llama")
    cfg = ModelConfig.from_hf(json.loads((model / "config.json").read_text()))
    adapter = make_lora_dir(tmp_path / "a", cfg, rank=4, seed=1)
    s = load_settings(model=str(model), kv_cache_memory="32MiB", max_model_len=512, max_lora_rank=16,
                      data_parallel_size=2, num_threads=1, enable_runtime_lora=True, lora_dir=[str(tmp_path)])  # fmt: skip
    srv = ServerThread(build_app(s)).start(timeout=180)
    try:
        client = srv.state.client
        assert isinstance(client, LanedClient)
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10  # each engine publishes its stats with the load's reply
        while time.monotonic() < deadline and not all(c.stats.lora and "a" in c.stats.lora.adapters
                                                      for c in client.clients):  # fmt: skip
            time.sleep(0.05)
        assert all(c.stats.lora and "a" in c.stats.lora.adapters for c in client.clients)

        async def run() -> list[httpx.Response]:
            body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(c.post(srv.url + "/v1/completions", json={**body, "model": m},
                                                     headers={"x-priority": "p0"})  # fmt: skip
                                              for m in ("a", "a", "a", "a", base, base, base, base)))

        base = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        before = [c.stats.num_steps for c in client.clients]
        responses = asyncio.run(run())
        assert [r.status_code for r in responses] == [200] * 8
        texts = [r.json()["choices"][0]["text"] for r in responses]
        assert len(set(texts[:4])) == 1 and len(set(texts[4:])) == 1  # the same answer from either lane
        assert [c.stats.num_steps for c in client.clients] != before
        assert all(c.stats.num_steps > b for c, b in zip(client.clients, before, strict=True))  # both lanes ran
    finally:
        srv.stop()
