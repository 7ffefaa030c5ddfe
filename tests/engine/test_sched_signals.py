"""The scheduler's memory between steps (sluice/engine/sched_signals.py)."""

from __future__ import annotations

import pytest

from sluice.engine.protocol import SamplingParams
from sluice.engine.request import Request
from sluice.engine.sched_signals import (
    IDLE_GAP_S,
    PEAK_DECAY_S,
    TARGET_MEMORY_S,
    CycleClock,
    RunningPeaks,
    TargetMemory,
    reserved_seq_limit,
)
from sluice.types import Priority


def test_target_memory_is_a_sliding_window_minimum() -> None:
    mem = TargetMemory()
    mem.add(0.5, now=0.0)
    mem.add(0.3, now=1.0)  # tighter: the 0.5 can never be the minimum again
    mem.add(0.4, now=1.5)  # looser, but outlives the 0.3
    mem.add(0.0, now=1.5)  # no target: ignored
    assert mem.tightest(1.5) == 0.3
    assert mem.tightest(1.0 + TARGET_MEMORY_S + 0.01) == 0.4, "the 0.3 expired; the later 0.4 still holds"
    assert mem.tightest(1.5 + TARGET_MEMORY_S + 0.01) is None
    assert mem.tightest(100.0, current=(0.0, 0.7, 2.0)) == 0.7, "current targets hold whenever they came"


def test_cycle_clock_decays_and_skips_idle_gaps() -> None:
    clock = CycleClock()
    clock.observe(0.0)
    clock.observe(0.04)
    assert clock.cycle_time == pytest.approx(0.04)
    clock.observe(0.04 + IDLE_GAP_S + 0.1)  # idle, not a step cycle
    assert clock.cycle_time == pytest.approx(0.04)
    t = 0.04 + IDLE_GAP_S + 0.1
    for _ in range(40):
        t += 0.01
        clock.observe(t)
    assert clock.cycle_time == pytest.approx(0.01, rel=0.05), "follows the new cycle time"


def test_running_peaks_hold_then_decay() -> None:
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1), priority=Priority.P0) for i in range(3)]
    peaks = RunningPeaks(now=0.0)
    peaks.update(0.0, reqs)
    assert peaks.peaks[Priority.P0] == 3.0 and peaks.peaks[Priority.P2] == 0.0
    peaks.update(PEAK_DECAY_S, reqs[:1])
    assert peaks.peaks[Priority.P0] == pytest.approx(3.0 / 2.718281828, rel=1e-6), "one time constant later"
    peaks.update(10 * PEAK_DECAY_S, reqs[:1])
    assert peaks.peaks[Priority.P0] == 1.0, "never below what runs now"


def test_lower_classes_leave_p0s_recent_peak_plus_one_free() -> None:
    # NOTE(trunk-reservation): one rule for the scheduler and its TTFT model
    assert reserved_seq_limit(64, 0.0) == 64, "no P0 of late: nothing reserved"
    assert reserved_seq_limit(64, 2.3) == 64 - 3 - 1, "a decaying peak is rounded up"
    assert reserved_seq_limit(4, 10.0) == 1, "a lower class always keeps a slot"
