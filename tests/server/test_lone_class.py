"""Default flags (no ``--slo``): a class alone is queued and served; a mix still sheds the lower class (issue 57).

NOTE(lone-class) in ``sluice.server.admission``.  The closed loops run the admission against a model of the
engine's scheduler on a fake clock (``admission_sim``): a minute of load each, in well under a second.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from sluice.engine.ttft_model import unloaded_ttft
from sluice.errors import OverloadedError
from sluice.server import admission
from sluice.server.telemetry import PRIORITIES, REJECT_REASONS, ServerMetrics
from sluice.types import Priority
from tests.server.admission_sim import run_closed_loop
from tests.server.slo_fakes import FakeClock, controller, stats


def _p95(values: list[float]) -> float:
    return sorted(values)[int(0.95 * len(values)) - 1]


@pytest.mark.parametrize("num_streams", [32, 128])
def test_default_flags_serve_a_closed_loop_of_p1_streams_without_a_429(num_streams: int) -> None:
    served = run_closed_loop("auto", [Priority.P1] * num_streams)
    off = run_closed_loop("off", [Priority.P1] * num_streams)
    assert served.num_refused == 0 and sum(served.num_shed_by_priority) == 0, (
        f"a load of one class is queued and served, as the peers serve it: {served.refused_by_code}")
    assert served.num_done_by_priority == off.num_done_by_priority, "the same work as --slo off"
    assert _p95(served.ttft_by_priority[1]) > 2.0, "the test's load is past the 2 s that used to refuse it"


def test_explicit_targets_keep_the_strict_behaviour() -> None:
    strict = run_closed_loop("p1=2s", [Priority.P1] * 32)
    assert strict.refused_by_code.get("slo_unattainable", 0) > 0, "--slo p1=2s refuses what would wait past 2 s"
    assert _p95(strict.ttft_by_priority[1]) <= 2.0


def test_a_mixed_p0_p2_overload_still_sheds_p2_for_p0() -> None:
    # 128 P2 streams fill the engine; P0s arrive at 4/s: P2 is refused and shed, P0 keeps its derived target
    # (4 x its unloaded TTFT: 0.49 s), which it misses without the targets
    mixed = run_closed_loop("auto", [Priority.P2] * 128, open_loop=(Priority.P0, 4.0))
    p0_target = 1.05 * 4 * (0.02 + 0.0005 + 0.0008 * 128)  # 5%: the prediction's error, about one decode step
    on_time = sum(t <= p0_target for t in mixed.ttft_by_priority[0]) / len(mixed.ttft_by_priority[0])
    assert on_time >= 0.99, f"P0 within its target: {on_time:.1%}"
    assert mixed.refused_by_code.get("slo_unattainable", 0) > 0 and mixed.num_shed_by_priority[2] > 0, (
        "P2 gives way to P0: refused by its own target and shed from the queue")
    assert mixed.refused_by_code.keys() == {"slo_unattainable"} and mixed.num_shed_by_priority[0] == 0
    unguarded = run_closed_loop("p0=1000s,p1=1000s,p2=1000s", [Priority.P2] * 128, open_loop=(Priority.P0, 4.0))
    late = sum(t > p0_target for t in unguarded.ttft_by_priority[0])
    assert late > 0, "without the targets P0 is late: the shedding is what protects it"


def test_a_lone_class_is_refused_only_past_the_longest_wait_and_by_its_target_beside_a_higher_class() -> None:
    clock = FakeClock()
    a = controller("auto", clock)
    a.observe_stats(stats(num_waiting_by_priority=[0, 20, 0], num_prefill_tokens_by_priority=[0, 20_000, 0]))
    d = a.admit("p1-lone", Priority.P1, 116, 100)  # ~20 s behind 20k tokens, over the 2 s derived target
    assert d.predicted_ttft is not None and d.predicted_ttft > 10 * 2.0
    assert d.target == a.max_queue_wait, "alone, the engine gets the bound, not the 2 s target (no step cap for it)"
    a.max_queue_wait = 10.0
    a.admit("p1-next", Priority.P1, 116, 100)  # predicted ~20 s, but nobody has waited yet (NOTE(measured-ceiling))
    clock.now += 11.0  # the oldest queued P1 has now waited past the 10-s ceiling
    with pytest.raises(OverloadedError) as e:
        a.admit("p1-long", Priority.P1, 116, 100)
    assert e.value.code == "wait_too_long" and "--max-queue-wait" in str(e.value)
    a.max_queue_wait = 90.0
    a.admit("p0", Priority.P0, 116, 100)  # a higher class beside it: P1's derived target binds
    a.remove("p0")
    with pytest.raises(OverloadedError) as e:
        a.admit("p1-mixed", Priority.P1, 116, 100)
    assert e.value.code == "slo_unattainable"
    clock.now += admission.ACTIVE_WINDOW_S + admission.REFUSED_ABOVE_S
    a.admit("p2", Priority.P2, 116, 100)
    assert a.admit("p1-beside-p2", Priority.P1, 116, 100).target == 2.0, "beside P2 the engine gets P1's target"
    a.remove("p2")
    a.remove("p1-beside-p2")
    clock.now += admission.ACTIVE_WINDOW_S
    assert a.admit("p1-later", Priority.P1, 116, 100).target == a.max_queue_wait, "the others are gone: alone"


def test_p0_alone_is_queued_and_beside_a_lower_class_keeps_its_derived_target() -> None:
    clock = FakeClock()
    a = controller("auto", clock)
    a.observe_stats(stats(num_waiting_by_priority=[20, 0, 0], num_prefill_tokens_by_priority=[2_000, 0, 0]))
    d = a.admit("p0-lone", Priority.P0, 116, 100)
    derived = 4 * unloaded_ttft(a.load(), 100)
    assert d.predicted_ttft is not None and d.predicted_ttft > derived, "admitted past its derived target"
    assert d.target == a.max_queue_wait
    a.observe_stats(stats(num_waiting_by_priority=[20, 0, 0], num_prefill_tokens_by_priority=[2_000, 0, 0],
                          num_running_by_priority=[0, 0, 1]))  # fmt: skip
    with pytest.raises(OverloadedError) as e:
        a.admit("p0-mixed", Priority.P0, 116, 100)
    assert e.value.code == "slo_unattainable", "beside P2 work, P0 is held to its target (3x protection as before)"


def test_admission_rejected_counters_start_at_zero_for_every_class_and_reason() -> None:
    text = ServerMetrics("m").render().decode()
    for p in PRIORITIES:
        for reason in REJECT_REASONS:
            line = f'sluice_admission_rejected_total{{priority="{p}",reason="{reason}"}} 0.0'
            assert line in text, f"dashboards and alerts need the series before the first 429: {line}"


async def test_the_server_queues_a_lone_class_by_default_and_honours_max_queue_wait(server_factory) -> None:
    # one slot, 0.1 s steps: a P1 behind a running 30-token P1 waits ~3 s, past the derived 2 s target
    async def second_p1(srv) -> httpx.Response:
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            body = {"prompt": "x", "max_tokens": 30}
            first = asyncio.create_task(c.post("/v1/completions", json=body))
            deadline = time.monotonic() + 10
            while srv.state.client.stats.num_running_by_priority[1] == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert (await first).status_code == 200
            return r

    r = await second_p1(server_factory(step_delay=0.1, max_num_seqs=1))
    assert r.status_code == 200, f"no --slo: a lone P1 is queued and served: {r.text}"
    # past --max-queue-wait: a P1 queued behind the running one has waited 1.3 s of the 1-s ceiling
    srv = server_factory(step_delay=0.1, max_num_seqs=1, max_queue_wait=1.0)
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        first = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 30}))
        deadline = time.monotonic() + 10
        while srv.state.client.stats.num_running_by_priority[1] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        queued = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}))
        await asyncio.sleep(1.3)
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "wait_too_long", r.text
        assert (await first).status_code == 200
        late = await queued  # ~3 s behind the first: past 2 x the ceiling it is shed as overdue (NOTE(overdue))
        assert late.status_code == 200 or late.json()["error"]["code"] == "expired", late.text


def test_a_class_refused_every_time_still_counts_beside_p0() -> None:
    """At 5x every P1/P2 is refused; counted by admissions alone, P0 looked lone, was held to the longest wait
    only and queued for seconds.  A class that asked in the last ``ACTIVE_WINDOW_S`` is active (NOTE(lone-class))."""
    clock = FakeClock()
    a = controller("auto", clock)
    a.observe_stats(stats(num_running_by_priority=[0, 0, 0], num_waiting_by_priority=[40, 0, 0],
                          num_prefill_tokens_by_priority=[40_000, 0, 0]))  # fmt: skip
    alone = a.admit("p0-alone", Priority.P0, 116, 100)
    assert alone.target == a.max_queue_wait, "no other class asked: P0 alone is queued and served"
    a.remove("p0-alone")
    assert a.refuse_early(Priority.P2) is None  # a P2 asks (here refused by nothing: it only asks)
    with pytest.raises(OverloadedError) as e:
        a.admit("p0-beside", Priority.P0, 116, 100)
    assert e.value.code == "slo_unattainable", "beside a class that asks, P0's derived target binds"
    clock.now += admission.ACTIVE_WINDOW_S + 0.1
    assert a.admit("p0-later", Priority.P0, 116, 100).target == a.max_queue_wait, "the P2s stopped asking"
