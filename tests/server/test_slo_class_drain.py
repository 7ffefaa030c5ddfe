"""Admission by each class's measured drain (NOTE(class-drain) and the P0 margin, NOTE(p0-margin) in
``sluice.server.admission``): a fake clock and an engine of known rates (``slo_fakes``)."""

from __future__ import annotations

import math

import pytest

from sluice.engine.ttft_model import predict_ttft
from sluice.errors import OverloadedError
from sluice.server import admission
from sluice.types import Priority
from tests.server.slo_fakes import FakeClock, controller, ran, stats


def test_a_class_that_does_not_drain_is_refused_at_once_whatever_the_model_says() -> None:
    # NOTE(class-drain): the engine stats show an idle engine, but the queued p2 has not started in 2 s
    clock = FakeClock()
    a = controller("p0=0.2s,p1=2s,p2=1s", clock)
    a.observe_stats(stats())
    a.admit("p2-a", Priority.P2, 116, 100)
    clock.now += 0.5
    assert a.drain_wait(Priority.P2) == pytest.approx(0.5), "too little backlog for a rate: the oldest one's age"
    a.admit("p2-b", Priority.P2, 116, 100)
    clock.now += 1.5
    # 2 s of backlog (1.5 s of it with two queued), no start: at most one per ~1.9 weighted seconds
    wait = a.drain_wait(Priority.P2)
    assert 5.0 < wait < 6.0, wait
    assert predict_ttft(a.load(), Priority.P2, 100) < 1.0, "the model alone would admit it"
    with pytest.raises(OverloadedError) as e:
        a.admit("p2-c", Priority.P2, 116, 100)
    assert e.value.code == "slo_unattainable" and a.num_queued == 2, "refused at arrival, not queued to expire"
    assert e.value.retry_after is not None and 4.0 < e.value.retry_after < 10.0, "Retry-After: the excess, jittered"
    assert a.drain_wait(Priority.P0) == 0.0 and a.admit("p0", Priority.P0, 116, 100).target == 0.2, "P0: the model"
    assert a.drain_wait(Priority.P1) == 0.0, "p1 never queued"


def test_an_old_backlog_does_not_refuse_a_class_on_an_idle_engine() -> None:
    # NOTE(idle-drain): a p2 waited 4 s without starting (the engine stalled), then expired
    clock = FakeClock()
    a = controller("p0=0.2s,p1=2s,p2=2s", clock)
    a.observe_stats(stats())
    a.admit("stalled", Priority.P2, 116, 100)
    clock.now += 4.0
    a.remove("stalled")  # shed as overdue: no start was ever counted
    assert a.drain_wait(Priority.P2) > 2.0, "the drain alone still says the class is slow"
    # the engine is idle and nothing of p2 or above is queued: the model decides, and admits
    assert a.drain_wait(Priority.P2, a.load()) == 0.0
    assert a.admit("next", Priority.P2, 116, 100).predicted_ttft < 2.0
    a.remove("next")
    # with a higher class running in the engine the measured drain still applies: refused
    a.observe_stats(stats(num_running_by_priority=[0, 3, 0], num_running=3))
    assert a.drain_wait(Priority.P2, a.load()) > 2.0
    with pytest.raises(OverloadedError) as e:
        a.admit("behind-p1", Priority.P2, 116, 100)
    assert e.value.code == "slo_unattainable"


def test_a_class_that_drains_fast_is_admitted_on_its_measured_rate() -> None:
    clock = FakeClock()
    a = controller("p0=0.2s,p1=0.45s,p2=5s", clock)
    a.observe_stats(stats())
    a.admit("p1-0", Priority.P1, 20, 4)
    for i in range(1, 31):  # 3 s: a p1 arrives and one starts every 0.1 s, one always queued
        clock.now += 0.1
        a.admit(f"p1-{i}", Priority.P1, 20, 4)
        a.started(f"p1-{i - 1}")
    wait = a.drain_wait(Priority.P1)
    assert wait == pytest.approx(2 * 0.1, rel=0.05), "one queued ahead, 10 starts a second"
    assert a.predict(a.load(), Priority.P1, 4) == pytest.approx(wait), "over the model's near-zero wait"
    a.admit("p1-next", Priority.P1, 20, 4)
    for i in range(2):  # 0.3 s, 0.4 s
        a.admit(f"p1-more-{i}", Priority.P1, 20, 4)
    # 4 queued ahead: 0.5 s, over 0.45 s
    with pytest.raises(OverloadedError):
        a.admit("p1-last", Priority.P1, 20, 4)
    for key in ("p1-30", "p1-next", *(f"p1-more-{i}" for i in range(2))):
        a.remove(key)  # finished or shed: not starts, the rate is unchanged
    clock.now += 30.0
    assert a.drain_wait(Priority.P1) == 0.0, "after 30 s with nothing queued the old backlog no longer counts"


def test_a_class_whose_oldest_request_waited_past_the_target_is_refused_at_once() -> None:
    # the class drained fast until now (its rate still says so), then stops: the oldest one's age tells at once
    clock = FakeClock()
    a = controller("p0=0.2s,p1=0.5s,p2=5s", clock)
    a.observe_stats(stats())
    for i in range(40):  # 2 s: a p1 every 50 ms, started at once
        a.admit(f"p1-{i}", Priority.P1, 20, 4)
        clock.now += 0.05
        a.started(f"p1-{i}")
    a.admit("stuck", Priority.P1, 20, 4)
    clock.now += 0.3
    a.admit("behind", Priority.P1, 20, 4)  # 0.3 s behind the oldest, within 0.5 s
    clock.now += 0.3
    assert a.drain_wait(Priority.P1) == pytest.approx(0.6), "the rate alone would say ~0.2 s"
    with pytest.raises(OverloadedError) as e:
        a.admit("p1-new", Priority.P1, 20, 4)
    assert e.value.code == "slo_unattainable"
    a.started("stuck")
    assert a.drain_wait(Priority.P1) < 0.5
    a.admit("p1-new", Priority.P1, 20, 4)


def test_a_surge_of_higher_class_arrivals_counts_within_a_second() -> None:
    # NOTE(higher-arrivals): the arrival rate is the larger of a 5-s and a 1-s average
    clock = FakeClock()
    a = controller("p0=1s,p1=2s,p2=5s", clock)

    a.mean_prompt_tokens = 10.0

    def run(seconds: float, p0_per_tick: int) -> None:  # ticks of 50 ms; 20 requests' work/s; the engine always busy
        for _ in range(round(seconds / 0.05)):
            for k in range(p0_per_tick):
                key = f"p0-{clock.now:.2f}-{k}"
                a.admit(key, Priority.P0, 20, 10)
                a.remove(key)
            a.observe_output_tokens(16)
            clock.now += 0.05
            a.observe_stats(ran(1, num_running=3))

    run(30.0, 0)
    assert a.higher_load(Priority.P1) == 0.0
    run(1.0, 1)  # P0 at 20/s for one second: the engine's whole rate
    rho = a.higher_load(Priority.P1)
    slow_alone = 1.0 - math.exp(-1.0 / admission.RATE_WINDOW_S)  # what the 5-s average alone would say by now
    assert rho > 0.6 > 2 * slow_alone, rho
    run(3.0, 0)  # the surge is over: remembered at the 5-s average's pace (0.1), not the 1-s one's (0.03)
    assert 0.07 < a.higher_load(Priority.P1) < 0.13


def test_a_surge_from_an_idle_engine_counts_once_it_is_a_quarter_second_old() -> None:
    # NOTE(surge-onset): 30 s of P2 at 20/s (the engine's whole rate), 3 s idle, then P0 at 20/s
    clock = FakeClock()
    a = controller("p0=1s,p1=0.5s,p2=5s", clock)

    a.mean_prompt_tokens = 10.0

    def run(seconds: float, priority: Priority) -> None:  # 50-ms ticks: one admitted and started, one's work done
        for _ in range(round(seconds / 0.05)):
            key = f"{priority.label}-{clock.now:.2f}"
            a.admit(key, priority, 20, 10)
            a.remove(key)
            a.observe_output_tokens(16)
            clock.now += 0.05
            a.observe_stats(ran(1, num_running=3))  # the engine busy

    run(30.0, Priority.P2)
    a.observe_stats(stats())  # the engine drains and idles for 3 s
    clock.now += 3.0
    assert a.higher_load(Priority.P1) == 0.0
    run(0.1, Priority.P0)  # two P0s in 0.1 s: a burst, not yet a rate
    assert a.higher_load(Priority.P1) < 0.15
    run(0.2, Priority.P0)  # six P0s in 0.3 s
    rho = a.higher_load(Priority.P1)
    one_second_average = 1.0 - math.exp(-0.3 / admission.FAST_RATE_WINDOW_S)  # its share of the rate by now
    assert rho > 0.8 > 3 * one_second_average, f"the surge's rate is seen at once: rho {rho:.2f}"
    with pytest.raises(OverloadedError) as e:  # 0.115 s of queue, times 1 / (1 - rho) > 0.5 s
        a.admit("p1", Priority.P1, 116, 100)
    assert e.value.code == "slo_unattainable"
    run(2.0, Priority.P0)  # in the same busy period: the 1-s average has filled, and reads the same
    assert a.higher_load(Priority.P1) > 0.8


def test_a_draining_batch_does_not_count_as_capacity() -> None:
    # NOTE(work-rate): 20 s of full-batch P2 work at 20 requests/s; then the closed loop ends and the batch
    # drains: 128 requests finish within a second on a tenth of the work; then P0 arrives at 20/s
    clock = FakeClock()
    a = controller("p0=1s,p1=0.5s,p2=5s", clock)
    a.mean_prompt_tokens = 10.0
    for i in range(400):
        a.admit(f"p2-{i}", Priority.P2, 20, 10)
        a.remove(f"p2-{i}")
        a.observe_output_tokens(16)
        clock.now += 0.05
        a.observe_stats(ran(1, num_running=128))
    for i in range(20):  # the drain: 6.4 completions a tick, the last decodes of a shrinking batch
        for _ in range(6):
            a.observe_output_tokens(16)
        clock.now += 0.05
        a.observe_stats(ran(0.1, num_running=128 - 6 * i))
    for i in range(40):  # 2 s of P0 at 20/s, the engine's whole rate, on the engine still finishing its batch
        a.admit(f"p0-{i}", Priority.P0, 20, 10)
        a.remove(f"p0-{i}")
        a.observe_output_tokens(16)
        clock.now += 0.05
        a.observe_stats(ran(1, num_running=8))
    rho = a.higher_load(Priority.P1)
    assert rho > 0.8, f"rho {rho:.2f}: the drain's completions (~120/s for a second) counted as capacity"


def test_p0_predictions_grow_while_admitted_p0s_miss_and_shrink_back_once_they_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE(p0-margin): the share of admitted P0s past their target sets a factor on P0's predictions."""
    # one P0 after the other, each 0.4 s late, is 40 s of overload: many P0s would overlap in it; without
    # the fading here, the growth and the fading are seen apart
    monkeypatch.setattr(admission, "P0_MARGIN_DECAY_S", 1e9)
    clock = FakeClock()
    a = controller("p0=0.3s", clock)
    a.observe_stats(stats())
    base = a.predict(a.load(), Priority.P0, 100)  # one 100-token step: 0.01 + 0.1 s, plus half the current one
    p2_before = a.predict(a.load(), Priority.P2, 100)
    n = refused = 0

    def start_p0(wait: float) -> None:
        nonlocal n, refused
        n += 1
        try:
            a.admit(f"p0-{n}", Priority.P0, 101, 100)
        except OverloadedError:
            refused += 1
            clock.now += wait
            return
        clock.now += wait
        a.started(f"p0-{n}")

    for _ in range(20):
        start_p0(0.05)  # within the 0.3 s target
    assert a.p0_margin == 1.0 and a.predict(a.load(), Priority.P0, 100) == pytest.approx(base)
    for _ in range(20):
        start_p0(0.4)  # every one late: the engine is past what the model sees
    assert refused == 0 and a.p0_miss_share > admission.P0_MISS_HIGH
    margin = a.p0_margin
    assert margin > 1.1 and a.predict(a.load(), Priority.P0, 100) == pytest.approx(base * margin)
    assert a.predict(a.load(), Priority.P2, 100) == pytest.approx(p2_before), "only P0's prediction changes"
    for _ in range(120):
        start_p0(0.4)
    assert refused > 0, "a P0 the model alone would admit (0.115 s) is refused once the margin passes 0.3 / 0.115"
    margin, set_at = a._p0_margin  # as the last start set it (the refusals since set nothing)
    monkeypatch.setattr(admission, "P0_MARGIN_DECAY_S", 5.0)
    clock.now = set_at + 5.0
    assert a.p0_margin == pytest.approx(1.0 + (margin - 1.0) / math.e), "the margin fades with time: no lock-in"
    for _ in range(400):
        start_p0(0.05)  # on time again: the misses fade, the margin goes back to 1
    assert a.p0_miss_share < admission.P0_MISS_LOW and a.p0_margin == pytest.approx(1.0)
    for _ in range(400):
        start_p0(0.4 if n % 20 == 0 else 0.05)  # one late in twenty: under P0_MISS_HIGH, no margin
    assert a.p0_margin == pytest.approx(1.0)
