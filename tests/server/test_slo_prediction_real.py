"""The TTFT prediction against a real engine run (tiny random Llama, in-process, virtual time).

The protocol is ``benchmarks/prediction_error.py``'s ``measure`` (NOTE(stationary-waves)
there): waves of 8 requests of all three classes on 4 slots, each one's TTFT predicted
at arrival from the engine's last stats, exactly as the API process does, and compared
with the TTFT it then gets.

NOTE(virtual-time): here the engine, its scheduler, the admission and the waves all read
one virtual clock, which only a step's execution moves: by ``a + b x tokens + c x
sequences`` of the step, each step off by up to ``JITTER`` either way (seeded).  The model,
the scheduling and the prediction are the real ones; the host's timing is not.  In real
time the steps of this tiny model are ~1-2 ms, and all three real-time runs of one CI run
failed (18-22 of 32 within) where the same build passed here: some TTFTs measured 3-5x
their prediction (the shared host pausing mid-wave), and some P2s were predicted at 9-15 s
and served in ~0.6 s (the stretch below, on a host slow enough for the run to last long
enough for it).  The run's length in seconds decided the result.  The real-time
figures are the benchmark's (docs/benchmarks.md, "TTFT prediction error in real time");
this test checks that the prediction follows what the scheduler does, and a
systematically wrong one fails it (2x too long or 0.4x: all three seeds).

On SmolLM2's step costs (4.5 ms + ~0.5 ms a token) the same protocol takes ~5-10 s of the
clock, long enough for the admission's 1-s and 5-s rate estimates to converge; the tests below
run it there too, a wave every 30 steps (an overload in steps: the requests not started grow
wave after wave) and every 60.  Before NOTE(served-only) (the request queue),
NOTE(take-when-needed) (the scheduler) and NOTE(gps-arrivals) (the admission), 16-28 of 32
were within the bound every 30 steps over seeds 0-7: P2 was predicted by strict priority
(P1's arrivals stretching it up to 20x) while the waves ended before the measured P2s started.

Stated bound: for at least 75% of the requests, |measured - predicted| <=
0.5 x measured + 3 step times (the prediction is made at step granularity).
The least accurate class is P2 (WFQ share 1 of the slots the reservation for P0 leaves).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from benchmarks.prediction_error import BUDGET, SLOTS, measure
from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineRequest, SamplingParams

STEP_BASE, STEP_PER_TOKEN, STEP_PER_SEQ = 1.0e-3, 15e-6, 40e-6  # NOTE(virtual-time): what the 2 cores measured
JITTER = 0.2  # ... and each step off by up to this share either way
SMOLLM2_COSTS = (4.5e-3, 470e-6, 40e-6)  # SmolLM2's step, as benchmarks/prediction_error.py fits it on the 2 cores


class VirtualClock:
    """Seconds that pass only when ``advance`` is called (NOTE(virtual-time))."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _timed_engine(tiny_model_dir: str, clock: VirtualClock, rng: random.Random,
                  costs: tuple[float, float, float] = (STEP_BASE, STEP_PER_TOKEN, STEP_PER_SEQ)) -> EngineCore:  # fmt: skip
    """The engine on ``clock``: each executed step moves it by the step's cost (NOTE(virtual-time)), ``a + b x
    tokens + c x sequences`` with ``costs`` = (a, b, c)."""
    engine = EngineCore(model=tiny_model_dir, dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=SLOTS,
                        max_num_batched_tokens=BUDGET, clock=clock)  # fmt: skip
    execute = engine.runner.execute

    def timed_execute(sched: Any, *args: Any) -> Any:
        out = execute(sched, *args)
        cost = costs[0] + costs[1] * sched.num_batched_tokens + costs[2] * len(sched.scheduled)
        clock.advance(cost * (1.0 + rng.uniform(-JITTER, JITTER)))
        return out

    engine.runner.execute = timed_execute  # type: ignore[method-assign]
    return engine


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.model_factory import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_predicted_ttft_is_within_the_stated_bound_on_a_real_run(tiny_model_dir: str, seed: int) -> None:
    clock = VirtualClock()
    r = measure(_timed_engine(tiny_model_dir, clock, random.Random(seed + 1000)), clock, seed)
    print(f"seed {seed}: {r['within']}/{r['total']} within the bound, median error {r['median_error']:.0%}")
    assert r["within"] >= 0.75 * r["total"], r["message"]


@pytest.mark.parametrize("gap", [30, 60])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_bound_holds_on_smollm2_step_costs(tiny_model_dir: str, seed: int, gap: int) -> None:
    """SmolLM2's step costs on the 2 cores (4.5 ms + 470 us a token).  A wave every 30 steps piles up a backlog
    (P1 and P2 queue for the slots the reservation for P0 leaves them; the backlog at wave 8 is 15-28); every 60
    steps leaves 3-11 requests not started by wave 8.  Over seeds 0-7: every 30 steps 24-32 of 32 within, every 60
    steps 21-32 (seed 7 short: its P2s over-predicted ~2x by the strict stretch, whose P1 share does not bind while
    P1 keeps up).  Before NOTE(gps-arrivals) and the WFQ fixes, every 30 steps 16-28."""
    clock = VirtualClock()
    engine = _timed_engine(tiny_model_dir, clock, random.Random(seed + 1000), costs=SMOLLM2_COSTS)
    r = measure(engine, clock, seed, gap=gap)
    print(f"seed {seed}: {r['within']}/{r['total']} within the bound, backlog {r['backlog'][:8]}")
    assert r["within"] >= 0.75 * r["total"], r["message"]


def test_the_engine_ages_requests_and_times_steps_by_its_clock(tiny_model_dir: str) -> None:
    """NOTE(virtual-time): what the test above relies on: a request without an arrival time arrives at the
    engine's clock, and a step's measured time is the clock's advance, not the host's."""
    clock = VirtualClock()
    engine = _timed_engine(tiny_model_dir, clock, random.Random(0))
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request(EngineRequest(request_id="a", sampling=sp, prompt_token_ids=[5] * 20))
    assert engine.scheduler.requests["a"].timings.arrival == 1000.0
    before = clock()
    engine.step()
    stats = engine.make_stats()
    cost = STEP_BASE + STEP_PER_TOKEN * 20 + STEP_PER_SEQ
    assert (1 - JITTER) * cost <= stats.step_time == clock() - before <= (1 + JITTER) * cost
