"""The scheduler's model of itself (sluice/engine/ttft_model.py): hand-computed predictions from known rates.

The engine is "measured" at a = 10 ms per step plus b = 1 ms per batched token, a 512-token budget and
64 slots, unless a test says otherwise.  The admission that stretches these predictions:
tests/server/test_slo_admission.py.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from sluice.engine import ttft_model
from sluice.engine.protocol import EngineStats
from sluice.engine.ttft_model import (
    MID_STEP_WAIT_S,
    EngineLoad,
    express_request_seconds,
    predict_ttft,
    unloaded_ttft,
)
from sluice.types import Priority


def stats(**kw: object) -> EngineStats:
    base: dict[str, object] = dict(step_time_base=0.01, step_time_per_token=0.001, max_num_batched_tokens=512,
                                   max_num_seqs=64)  # fmt: skip
    base.update(kw)
    return EngineStats(**base)  # type: ignore[arg-type]


def test_prediction_from_known_rates_and_queue_by_class() -> None:
    load = EngineLoad.from_stats(stats(num_waiting_by_priority=[0, 0, 3], num_prefill_tokens_by_priority=[0, 0, 300]),
                                 policy="wfq", mean_output_tokens=16, max_num_batched_tokens=512, max_num_seqs=64)  # fmt: skip
    half_current_step = 0.5 * (0.01 + 0.001 * 300)
    # p2 behind 300 p2 tokens: one 400-token step
    assert predict_ttft(load, Priority.P2, 100) == pytest.approx(0.01 + 0.4 + half_current_step)
    # p0 under wfq: p2 keeps 1/5 of p0's share (20 tokens) while p0 prefills
    assert predict_ttft(load, Priority.P0, 100) == pytest.approx(0.01 + 0.12 + half_current_step)
    load.policy = "priority"
    assert predict_ttft(load, Priority.P0, 100) == pytest.approx(0.01 + 0.1 + half_current_step)
    assert unloaded_ttft(load, 100) == pytest.approx(0.11)


def test_slot_bound_prediction_when_every_slot_is_held_by_the_class_or_higher() -> None:
    load = EngineLoad.from_stats(stats(num_running_by_priority=[0, 4, 0], num_decoding=4, max_num_seqs=4),
                                 policy="wfq", mean_output_tokens=20, max_num_batched_tokens=512, max_num_seqs=4)  # fmt: skip
    full_step = 0.01 + 0.001 * 4  # 4 decodes, no prefill backlog to spread over the wait
    # holders not listed: one P1 must finish first: 20 output tokens over 4 slots = 5 steps, then its own prefill step
    expected = 5 * full_step + (0.01 + 0.001 * 104) + 0.5 * (0.01 + 0.004)
    assert predict_ttft(load, Priority.P1, 100) == pytest.approx(expected)
    assert predict_ttft(load, Priority.P0, 100) < 0.2, "P0 takes a P1 slot: no slot wait"


def test_slot_wait_follows_the_holders_remaining_output() -> None:
    # four P1s that started together, 12 of 20 tokens left each (mean output 20, 8 made): they free together
    held = stats(num_running_by_priority=[0, 4, 0], num_running=4, num_decoding=4, max_num_seqs=4,
                 running_slots=[[1, 8, 12]] * 4, step_time_per_seq=0.002)  # fmt: skip
    load = EngineLoad.from_stats(held, policy="wfq", mean_output_tokens=20, max_num_batched_tokens=512, max_num_seqs=4)
    step = 0.01 + 0.001 * 4 + 0.002 * 4  # 4 decodes, 4 sequences
    own = 0.01 + 0.002 + 0.001 * 104 + 0.002 * 4  # its prefill step (one sequence) next to the 4 decodes
    expected = 12 * step + own + 0.5 * step
    assert predict_ttft(load, Priority.P1, 100) == pytest.approx(expected), "a burst frees its slots after 12 steps, not 3"
    # one of them nearly done: the wait is its 2 steps
    load.running_slots = [(1, 18, 2), (1, 8, 12), (1, 8, 12), (1, 8, 12)]
    assert predict_ttft(load, Priority.P1, 100) == pytest.approx(2 * step + own + 0.5 * step)
    # a second request queued ahead takes that slot: the next frees at step 12
    load.add(Priority.P1, 100)
    assert predict_ttft(load, Priority.P1, 100) > 12 * step


def test_a_lower_class_backlog_does_not_run_in_the_steps_a_class_waits_through_for_a_slot() -> None:
    # NOTE(hol-prefill): while a P1 waits for a slot no P2 is admitted (the scheduler's NOTE(hol)), so the P2
    # backlog's prefill is not in the steps until a P1 slot frees; for a P2 it is (its own class's)
    held = stats(num_running_by_priority=[0, 4, 0], num_running=4, num_decoding=4, max_num_seqs=4,
                 running_slots=[[1, 8, 12]] * 4)  # fmt: skip
    load = EngineLoad.from_stats(held, policy="wfq", mean_output_tokens=20, max_num_batched_tokens=512, max_num_seqs=4)
    for _ in range(10):
        load.add(Priority.P2, 100)
    step = 0.01 + 0.001 * 4  # 4 decodes: no P2 prefill beside them
    own = 0.01 + 0.001 * 104  # its prefill step next to the 4 decodes
    current = 0.01 + 0.001 * 512  # the running step, as the stats can tell it: decodes and every pending prefill
    assert predict_ttft(load, Priority.P1, 100) == pytest.approx(12 * step + own + 0.5 * current)
    assert predict_ttft(load, Priority.P2, 100) > 12 * (step + 0.001 * 1000 / 12), "a P2 waits through its own backlog"


def test_p0_holders_do_not_count_against_a_lower_class_limit() -> None:
    # 8 slots, P0's peak of 3 (+1) reserved: P1 may hold 4; 3 P0s and 3 P1s run, so a P1 finds a slot
    s = stats(num_running_by_priority=[3, 3, 0], num_running=6, num_decoding=6, max_num_seqs=8,
              seq_limit_by_priority=[8, 4, 4], running_slots=[[0, 1, 15]] * 3 + [[1, 1, 15]] * 3)  # fmt: skip
    load = EngineLoad.from_stats(s, policy="wfq", mean_output_tokens=16, max_num_batched_tokens=512, max_num_seqs=8)
    assert predict_ttft(load, Priority.P1, 100) < 0.2, "P1 holds 3 of its 4 slots: no slot wait"
    load.add(Priority.P1, 100)
    assert predict_ttft(load, Priority.P1, 100) > 15 * 0.01, "its 4 slots held: it waits for a P1 to finish"


def test_lower_class_decodes_do_not_count_against_a_higher_class_prefill() -> None:
    load = EngineLoad.from_stats(stats(max_num_batched_tokens=64, num_decoding=60, num_decoding_by_priority=[0, 0, 60],
                                       num_running_by_priority=[0, 0, 60]),
                                 policy="wfq", mean_output_tokens=16, max_num_batched_tokens=64, max_num_seqs=64)  # fmt: skip
    half_current_step = 0.5 * (0.01 + 0.001 * 60)
    # p0 takes the p2 decodes' tokens: its 40-token prompt is one step
    assert predict_ttft(load, Priority.P0, 40) == pytest.approx(0.01 + 0.04 + half_current_step)
    # p2 prefills beside its own 60 decodes: 4 tokens a step, 10 steps
    assert predict_ttft(load, Priority.P2, 40) == pytest.approx(10 * 0.01 + 0.001 * (40 + 10 * 60) + half_current_step)


def test_p0_prediction_counts_express_steps() -> None:
    load = EngineLoad.from_stats(stats(num_decoding=30, num_decoding_by_priority=[0, 10, 20], express_budget=200,
                                       max_num_batched_tokens=40, num_prefill_tokens_by_priority=[0, 300, 300]),
                                 policy="wfq", mean_output_tokens=16, max_num_batched_tokens=40, max_num_seqs=64)  # fmt: skip
    current = 0.01 + 0.001 * 40
    with_express = predict_ttft(load, Priority.P0, 100)
    # one express step of its 100 tokens, no decodes, no other class's prefill beside it
    assert predict_ttft(load, Priority.P0, 100) == pytest.approx(0.01 + 0.1 + 0.5 * current)
    load.express_budget = 0  # without express steps: 40-token steps next to no decodes of its own class, GPS shares
    assert predict_ttft(load, Priority.P0, 100) > 1.5 * with_express
    load.express_budget = 200
    load.express_mid_step = True  # NOTE(mid-step-express): the express step starts between two layers
    assert predict_ttft(load, Priority.P0, 100) == pytest.approx(0.01 + 0.1 + MID_STEP_WAIT_S)
    assert predict_ttft(load, Priority.P1, 100) == predict_ttft(dataclasses.replace(load, express_mid_step=False),
                                                                 Priority.P1, 100), "only P0's wait changes"  # fmt: skip
    load.num_running_by_priority, load.seq_limit_by_priority = [64, 0, 0], [64, 64, 64]
    load.running_slots = [[0, 1, 15]] * 64
    assert predict_ttft(load, Priority.P0, 100) > 0.01 + 0.1 + 0.5 * current, "no free slot: it waits for one"


def test_under_wfq_a_class_above_goes_first_for_its_weight_share_of_the_slots_only() -> None:
    # NOTE(wfq-slots): 30 P1 and 2 P2 wait for a slot; a new P2 waits for its 2 and, by the weights 3:1,
    # for 3 P1 starts per P2 start (itself included): 9 P1, not 30
    load = EngineLoad.from_stats(stats(num_running_by_priority=[0, 4, 0], num_decoding=4, max_num_seqs=4,
                                       num_waiting_by_priority=[0, 30, 2], num_prefill_tokens_by_priority=[0, 300, 20]),
                                 policy="wfq", mean_output_tokens=20, max_num_batched_tokens=512, max_num_seqs=4)  # fmt: skip
    assert ttft_model._slots_ahead(load, Priority.P2) == 2 + 9
    assert ttft_model._slots_ahead(load, Priority.P1) == 30, "P1's own class only"
    wfq = predict_ttft(load, Priority.P2, 10)
    load.policy = "priority"
    assert ttft_model._slots_ahead(load, Priority.P2) == 32, "strict priority: every P1 first"
    assert predict_ttft(load, Priority.P2, 10) > 2 * wfq


def test_a_p0_request_with_express_steps_costs_its_own_step_and_a_decode_row_a_token() -> None:
    load = EngineLoad.from_stats(stats(step_time_per_seq=0.002, express_budget=64), policy="wfq",
                                 mean_output_tokens=16, max_num_batched_tokens=512, max_num_seqs=64)  # fmt: skip
    # its express step (10 ms + 2 ms a sequence + 10 tokens x 1 ms), then 15 decode rows of 1 + 2 ms
    assert express_request_seconds(load, 10, 16) == pytest.approx(0.012 + 0.010 + 15 * 0.003)
    assert express_request_seconds(load, 10, 0) == pytest.approx(0.022), "no output: the prefill alone"


def test_the_model_loads_without_torch() -> None:
    """The API process imports the model (and its admission): neither may pull torch in."""
    code = "import sys, sluice.engine.ttft_model, sluice.server.admission; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0, "torch imported by the TTFT model"
