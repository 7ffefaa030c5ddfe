"""Admission by predicted wait (issue 11): known engine rates, a fake clock, hand-computed predictions.

The engine (``slo_fakes``) is "measured" at a = 10 ms per step plus b = 1 ms per batched
token, a 512-token budget and 64 slots.  The model it stretches: tests/engine/test_ttft_model.py;
the class-drain rules: ``test_slo_class_drain.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest

from sluice.engine.ttft_model import predict_ttft
from sluice.errors import OverloadedError
from sluice.http_errors import retry_after_header
from sluice.server import admission, admission_rates
from sluice.server.slo import SloTargets
from sluice.types import Priority
from tests.server.conftest import until
from tests.server.slo_fakes import FakeClock, controller, ran, stats


def test_request_over_its_target_is_rejected_at_once_with_retry_after() -> None:
    clock = FakeClock()
    a = controller("p2=0.5s", clock)
    a.observe_stats(stats(num_waiting_by_priority=[0, 0, 3], num_prefill_tokens_by_priority=[0, 0, 300]))
    with pytest.raises(OverloadedError) as e:
        a.admit("p2-new", Priority.P2, 116, 100)  # predicted 0.565 s > 0.5 s
    assert e.value.status_code == 429 and e.value.code == "slo_unattainable"
    assert 1.0 <= e.value.retry_after <= 2.5, "Retry-After: at least the base second, at most 1.5x + 1 s of jitter"
    assert a.num_queued == 0
    d = a.admit("p1", Priority.P1, 116, 100)  # p1's auto target is at least 2 s
    assert d.shed == [] and d.predicted_ttft is not None and d.target is not None and d.target >= 2.0


def test_p0_sheds_just_enough_queued_p2_newest_first() -> None:
    clock = FakeClock()
    a = controller("p0=0.2s", clock)
    a.observe_stats(stats())
    for i in range(3):
        a.admit(f"p2-{i}", Priority.P2, 116, 100)  # sent after the stats: counted as queued ahead
    d = a.admit("p0", Priority.P0, 101, 100)
    # with 3 p2 queued: 0.285 s; shedding p2-2: 0.235 s; shedding p2-1 too: 0.185 s <= 0.2 s
    assert d.shed == ["p2-2", "p2-1"], "newest of the lowest class first, only as many as needed"
    assert d.predicted_ttft == pytest.approx(0.185) and a.num_queued == 2


def test_p1_sheds_only_requests_queued_a_moment_ago_p0_any() -> None:
    clock = FakeClock()
    a = controller("p0=0.2s,p1=0.2s,p2=100s", clock)  # p2: queued 2 s with no start, it still fits (NOTE(class-drain))
    a.observe_stats(stats())
    for i in range(3):
        a.admit(f"p2-{i}", Priority.P2, 116, 100)
    clock.now += 1.0  # they have queued a second: a 429 now would waste it
    with pytest.raises(OverloadedError) as e:
        a.admit("p1", Priority.P1, 101, 100)  # 0.285 s with them, and they may not be shed for it
    assert e.value.code == "slo_unattainable" and a.num_queued == 3, "refused at once, nobody shed"
    clock.now += 1.0  # the p1 refusal is 1 s old: p2 is admitted again (NOTE(refused-above))
    a.admit("p2-young", Priority.P2, 116, 100)
    clock.now += 0.005
    # p2-young sheds alone: 4 queued p2 -> 0.335 s; without it 0.285 s, still over 0.2 s
    with pytest.raises(OverloadedError):
        a.admit("p1", Priority.P1, 101, 100)
    d = a.admit("p0", Priority.P0, 101, 100)  # P0 goes first over any queued lower-class request
    assert d.shed == ["p2-young", "p2-2", "p2-1"] and d.predicted_ttft is not None and d.predicted_ttft <= 0.2


def test_nobody_is_shed_when_shedding_all_lower_classes_would_not_help() -> None:
    clock = FakeClock()
    a = controller("p1=0.05s", clock)
    a.observe_stats(stats())
    a.admit("p2", Priority.P2, 116, 100)
    with pytest.raises(OverloadedError):
        a.admit("p1", Priority.P1, 116, 100)  # 0.11 s even alone
    assert a.num_queued == 1, "a failed admission sheds nobody"


def test_requests_the_stats_already_count_are_not_counted_twice() -> None:
    clock = FakeClock(9.0)
    a = controller("auto", clock)
    a.observe_stats(stats())
    a.admit("p1", Priority.P1, 116, 100)
    assert a.load().num_prefill_tokens_by_priority == [0, 100, 0], "sent after the last stats: counted by the API"
    clock.now = 10.0
    a.observe_stats(stats(num_waiting_by_priority=[0, 1, 0], num_prefill_tokens_by_priority=[0, 100, 0]))
    assert a.load().num_prefill_tokens_by_priority == [0, 100, 0], "now in the engine's stats: counted once"


def test_unmeasured_engine_admits_on_the_queue_bound_alone() -> None:
    a = controller("p2=0.001s", FakeClock())
    d = a.admit("p2", Priority.P2, 116, 100)
    assert d.predicted_ttft is None and d.shed == []


def test_retry_after_of_a_shed_wave_is_spread_out() -> None:
    clock = FakeClock()
    a = controller("p2=0.5s", clock, seed=1)
    a.observe_stats(stats(num_waiting_by_priority=[0, 0, 30], num_prefill_tokens_by_priority=[0, 0, 3000]))
    headers = []
    for i in range(50):
        with pytest.raises(OverloadedError) as e:
            a.admit(f"p2-{i}", Priority.P2, 116, 100)
        headers.append(int(retry_after_header(e.value.retry_after)))
    assert len(set(headers)) >= 3, f"50 shed requests must not all be told the same second: {sorted(set(headers))}"
    excess = predict_ttft(a.load(), Priority.P2, 100) - 0.5
    assert min(headers) >= excess, "Retry-After is never shorter than the predicted excess wait"


def test_slo_targets_parse_and_auto_defaults() -> None:
    t = SloTargets.parse("p0=300ms, p2=4")
    assert t.seconds == (0.3, None, 4.0)
    assert t.target(Priority.P1, unloaded=0.05) == 2.0, "auto p1: the 2 s floor"
    assert t.target(Priority.P1, unloaded=0.5) == 5.0, "auto p1: 10x a slow unloaded TTFT"
    assert SloTargets.parse("auto").target(Priority.P0, unloaded=0.2) == pytest.approx(0.8)
    for bad in ("p3=1s", "p0", "p0=-1s", "p0=fast"):
        with pytest.raises(ValueError):
            SloTargets.parse(bad)


async def test_server_answers_429_at_once_when_the_predicted_wait_is_over_target(server_factory) -> None:
    # one slot, 0.1 s steps: a p2 behind a 20-token p1 would wait ~1.7 s, over its 1 s target
    srv = server_factory(step_delay=0.1, max_num_seqs=1, slo="p2=1s")
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:

        async def go(priority: str, tokens: int) -> httpx.Response:
            return await c.post("/v1/completions", json={"prompt": "x", "max_tokens": tokens}, headers={"x-priority": priority})

        running = asyncio.create_task(go("p1", 20))
        deadline = time.monotonic() + 10
        while srv.state.client.stats.num_running_by_priority[1] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        t0 = time.monotonic()
        r = await go("p2", 5)
        elapsed = time.monotonic() - t0
        assert r.status_code == 429 and r.json()["error"]["code"] == "slo_unattainable"
        assert int(r.headers["retry-after"]) >= 1
        assert elapsed < 1.0, f"a request that cannot meet its target is answered at once, took {elapsed:.2f} s"
        p0 = await go("p0", 1)
        assert p0.status_code == 200, "p0 takes the p1's slot: predicted within its auto target (4 x 0.1 s), admitted"
        assert (await running).status_code == 200
        text = (await c.get("/metrics")).text
    assert 'sluice_admission_rejected_total{priority="p2",reason="slo_unattainable"} 1.0' in text
    assert 'sluice_predicted_ttft_seconds{priority="p0"}' in text and 'sluice_slo_ttft_target_seconds{priority="p2"} 1.0' in text
    assert 'sluice_slo_requests_total{priority="p2"} 1.0' in text and 'sluice_slo_attained_total{priority="p2"} 0.0' in text


def _admit_for_30_s(a: admission.AdmissionController, clock: FakeClock, priority: Priority) -> None:
    """30 s of ``priority`` requests (10-token prompts) admitted at 60 req/s and started at once, on an engine
    that does 80 requests' work a second and always has work."""
    for i in range(600):
        for k in range(3):
            a.admit(f"{priority.label}-{i}-{k}", priority, 26, 10)
            a.remove(f"{priority.label}-{i}-{k}")
        for _ in range(4):
            a.observe_output_tokens(16)
        clock.now += 0.05
        a.observe_stats(ran(4, num_running=3))  # work in the engine all the time


def test_higher_classes_arrivals_stretch_a_lower_class_prediction() -> None:
    clock = FakeClock()
    a = controller("p0=1s,p1=2s,p2=0.3s", clock)
    a.observe_stats(stats())
    load = a.load()
    base = predict_ttft(load, Priority.P2, 100)
    assert a.predict(load, Priority.P2, 100) == pytest.approx(base), "nothing measured yet: the queue alone"
    a.mean_prompt_tokens = 10.0
    _admit_for_30_s(a, clock, Priority.P0)
    assert a.higher_load(Priority.P0) == 0.0, "nothing is above P0"
    assert a.higher_load(Priority.P2) == pytest.approx(0.75, rel=0.05)
    load = a.load()
    assert a.predict(load, Priority.P2, 100) == pytest.approx(predict_ttft(load, Priority.P2, 100) / 0.25, rel=0.1), (
        "P0 takes 3/4 of the engine while a P2 waits: its wait is four times the queue's"
    )
    assert a.predict(load, Priority.P0, 100) == pytest.approx(predict_ttft(load, Priority.P0, 100))
    assert predict_ttft(a.load(), Priority.P2, 100) < 0.3, "by the queue alone it would be admitted"
    with pytest.raises(OverloadedError) as e:  # 0.115 s of queue alone, 0.46 s with P0's arrivals
        a.admit("p2", Priority.P2, 116, 100)
    assert e.value.code == "slo_unattainable" and a.num_queued == 0, "refused at arrival, not shed later"


def test_with_express_steps_p0_arrivals_stretch_by_the_engine_time_of_their_own_steps() -> None:
    # NOTE(express-share): a P0's prefill runs in an express step of its own and its decodes as rows of the
    # normal steps; that engine time is its share of a lower class's wait, not its share of the work rate
    clock = FakeClock()
    a = controller("p0=1s,p1=2s,p2=5s", clock)
    for i in range(300):  # 30 s: a P0 and a P1 admitted every 0.1 s and started at once, 80 req/s of work done
        for p in (Priority.P0, Priority.P1):
            a.admit(f"{p.label}-{i}", p, 26, 10)
            a.remove(f"{p.label}-{i}")
            a.observe_output_tokens(16)
        clock.now += 0.1
        a.observe_stats(ran(8, num_running=3, express_budget=1024))
    load = a.load()
    assert load.express_budget == 1024 and a.mean_prompt_tokens == pytest.approx(10.0)
    work_share = 10 / 80  # 10 req/s of each class, 80 req/s of capacity
    assert a.higher_load(Priority.P1) == pytest.approx(work_share, rel=0.05), "without the engine's costs: the work share"
    # a P0: an express step of its 10 tokens (10 ms + 10 x 1 ms), then 15 decode rows of 1 ms each: 35 ms, 10 a second
    express_share = 10 * (0.01 + 0.010 + 0.015)
    assert a.higher_load(Priority.P1, load) == pytest.approx(express_share, rel=0.05)
    assert a.higher_load(Priority.P2, load) == pytest.approx(express_share + work_share, rel=0.05), "P1 by its work"
    assert a.predict(load, Priority.P1, 100) == pytest.approx(predict_ttft(load, Priority.P1, 100) / (1 - express_share),
                                                              rel=0.05)  # fmt: skip
    no_express = dataclasses.replace(load, express_budget=0)
    assert a.higher_load(Priority.P1, no_express) == pytest.approx(work_share, rel=0.05), "P0 in the normal steps"


def test_higher_classes_on_a_lightly_loaded_engine_do_not_stretch_a_lower_class() -> None:
    # every finished request was a P0 one, but the engine had work 0.1 s of each second: rho is 0.1, not 1
    clock = FakeClock()
    a = controller("p0=1s,p1=0.2s,p2=5s", clock)
    a.mean_prompt_tokens = 10.0
    for i in range(20):
        a.admit(f"p0-{i}", Priority.P0, 20, 10)
        a.remove(f"p0-{i}")
        a.observe_output_tokens(16)
        a.observe_stats(stats(num_running=1))
        clock.now += 0.1
        a.observe_stats(ran(1))  # done, idle for 0.9 s
        clock.now += 0.9
    assert a.higher_load(Priority.P1) == pytest.approx(0.1, rel=0.15)  # (measured once a second: within 15%)
    load = a.load()
    assert a.predict(load, Priority.P1, 100) == pytest.approx(predict_ttft(load, Priority.P1, 100) / 0.9, rel=0.02)
    a.admit("p1", Priority.P1, 116, 100)  # 0.115 s by the queue, 0.13 s with P0's arrivals: within 0.2 s
    assert a.num_queued == 1


def test_while_a_higher_class_is_refused_a_lower_class_is_refused_too() -> None:
    clock = FakeClock()
    a = controller("p0=1s,p1=0.2s,p2=100s", clock)
    a.observe_stats(stats(num_waiting_by_priority=[0, 3, 0], num_prefill_tokens_by_priority=[0, 300, 0]))
    with pytest.raises(OverloadedError):  # behind 300 p1 tokens: ~0.5 s, over 0.2 s
        a.admit("p1", Priority.P1, 116, 100)
    assert predict_ttft(a.load(), Priority.P2, 100) < 100, "by its own prediction the p2 would be admitted"
    clock.now += 0.9
    with pytest.raises(OverloadedError) as e:
        a.admit("p2", Priority.P2, 116, 100)
    assert e.value.code == "slo_unattainable" and "p1 requests are being refused" in str(e.value)
    assert a.admit("p0", Priority.P0, 116, 100).target == 1.0, "a higher class is not held back by a lower one"
    clock.now += 0.2  # the p1 refusal is 1.1 s old
    assert a.admit("p2", Priority.P2, 116, 100).predicted_ttft is not None


def test_overdue_lower_class_requests_are_shed_p0_never(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission_rates, "DRAIN_MIN_BACKLOG_S", 100.0)  # the sweep alone (NOTE(class-drain) aside)
    clock = FakeClock()
    a = controller("p0=0.1s,p1=0.5s,p2=1s", clock)
    a.observe_stats(stats())
    for key, prio in (("p0", Priority.P0), ("p1", Priority.P1), ("p2", Priority.P2)):
        assert a.admit(key, prio, 20, 4).target is not None
    clock.now += 0.9
    assert a.overdue() == [], "nobody has waited twice their target"
    clock.now += 0.2  # 1.1 s: p1 over 2 x 0.5 s, p2 not yet over 2 x 1 s; p0 is never shed for its age
    assert a.overdue() == ["p1"] and a.num_queued == 2
    clock.now += 0.01
    a.admit("p1-late", Priority.P1, 20, 4)
    clock.now += 5.0
    assert a.overdue() == ["p2", "p1-late"] and a.num_queued == 1
    assert a.overdue() == [], "swept at most every 50 ms"


async def test_an_admitted_request_pushed_back_by_higher_classes_gets_429_not_a_hang(server_factory) -> None:
    # one slot, 50-ms steps; a p2 admitted behind a p1 finishing in ~0.75 s (within its 1 s target) loses the
    # slot to a second p1 (2 s): it is answered with 429 once it has waited 2 x 1 s, not when that p1 ends (2.75 s);
    # the 0.5 s between is slack for the shared cores' pauses
    srv = server_factory(step_delay=0.05, max_num_seqs=1, slo="p1=5s,p2=1s")
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:

        async def go(priority: str, tokens: int) -> httpx.Response:
            return await c.post("/v1/completions", json={"prompt": "x", "max_tokens": tokens}, headers={"x-priority": priority})

        first = asyncio.create_task(go("p1", 15))
        deadline = time.monotonic() + 10
        while srv.state.client.stats.num_running_by_priority[1] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        p2 = asyncio.create_task(go("p2", 2))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(go("p1", 40))
        r = await p2
        elapsed = time.monotonic() - t0
        assert r.status_code == 429 and r.json()["error"]["code"] == "expired", r.text
        assert int(r.headers["retry-after"]) >= 1
        assert 2.0 <= elapsed < 2.5, f"answered when it had waited 2 x its 1 s target, took {elapsed:.2f} s"
        assert not second.done(), "the second p1 still holds the slot: the p2 was not served"
        assert (await first).status_code == 200 and (await second).status_code == 200
        text = (await c.get("/metrics")).text
        assert srv.state.admission.num_queued == 0
        assert await until(lambda: srv.state.client.stats.num_waiting + srv.state.client.stats.num_running == 0), (
            "the shed request was aborted in the engine"
        )
    assert 'sluice_admission_rejected_total{priority="p2",reason="expired"} 1.0' in text


async def test_a_started_request_preempted_and_not_resumed_is_shed_not_left_to_hang(server_factory) -> None:
    # NOTE(stalled): two slots, 50-ms steps, an engine where a higher class takes a lower one's slot. A p1
    # (target 5 s) and a p2 (target 1 s) stream their first tokens, then two p0s of 60 tokens (3 s) take both
    # slots. The p2, without output for 2 x 1 s, is shed with an error event; the p1 is not (2 x 5 s is longer
    # than the p0s take) and finishes with every token once they are done.
    srv = server_factory(step_delay=0.05, max_num_seqs=2, slo="p0=5s,p1=5s,p2=1s", engine_kwargs={"preempt": True})
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        first_token = {"p1": asyncio.Event(), "p2": asyncio.Event()}

        async def stream(priority: str) -> tuple[list[dict], float]:
            events, last_token_at = [], 0.0
            body = {"prompt": "x", "max_tokens": 100, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body, headers={"x-priority": priority}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    events.append(ev)
                    if "error" not in ev:
                        last_token_at = time.monotonic()
                        first_token[priority].set()
            return events, last_token_at

        p1, p2 = asyncio.create_task(stream("p1")), asyncio.create_task(stream("p2"))
        await asyncio.wait_for(asyncio.gather(first_token["p1"].wait(), first_token["p2"].wait()), 10)
        p0s = [asyncio.create_task(c.post("/v1/completions", json={"prompt": "y", "max_tokens": 60},
                                          headers={"x-priority": "p0"})) for _ in range(2)]  # fmt: skip
        p2_events, p2_last = await p2
        shed_at = time.monotonic()
        assert "error" in p2_events[-1] and p2_events[-1]["error"]["code"] == "expired", p2_events[-1]
        assert 2.0 <= shed_at - p2_last < 2.4, f"shed {shed_at - p2_last:.2f} s after its last token"
        assert not any(t.done() for t in p0s), "shed while the p0s still held both slots"
        for t in p0s:
            r = await t
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 60
        p1_events, _ = await p1
        assert "error" not in p1_events[-1], p1_events[-1]
        assert sum(len(e["choices"][0]["text"]) for e in p1_events) == 100, "the preempted p1 resumed and finished"
        assert srv.state.client.stats.num_preemptions >= 2
        assert await until(lambda: srv.state.client.stats.num_waiting + srv.state.client.stats.num_running == 0), (
            "the shed request was aborted in the engine"
        )
        text = (await c.get("/metrics")).text
    assert 'sluice_admission_rejected_total{priority="p2",reason="expired"} 1.0' in text
    assert 'sluice_admission_rejected_total{priority="p1",reason="expired"} 0.0' in text, "a zero from the start"


def test_under_wfq_arrivals_of_a_class_above_p1_count_up_to_their_weight_share() -> None:
    # NOTE(gps-arrivals): P1 admitted at 60 req/s on an engine that does 80 requests' work a second: 3/4 of it.
    # Strict priority stretches a P2's queue wait (one 10-token prefill step: 10 ms + 10 ms, plus half the
    # 10-ms step in flight) by 1 / (1 - 0.75).  Under WFQ the P1s arriving while it waits go first for 3x its own
    # 10 tokens only: 30 tokens (the cap binds once it waits 50 ms), so it waits 10 + 40 + 5 ms
    def p2_prediction(policy: str) -> tuple[float, float]:
        clock = FakeClock()
        a = controller("p0=1s,p1=2s,p2=5s", clock, policy=policy)
        _admit_for_30_s(a, clock, Priority.P1)
        load = a.load()
        return a.predict(load, Priority.P2, 10), predict_ttft(load, Priority.P2, 10)

    strict, base = p2_prediction("priority")
    assert base == pytest.approx(0.025) and strict == pytest.approx(base / 0.25, rel=0.05)
    gps, _ = p2_prediction("wfq")
    assert gps == pytest.approx(0.055, rel=0.05), "P1's arrivals up to 3x the P2's own prefill"
