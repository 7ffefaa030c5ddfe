"""The TTFT prediction against a real engine run (tiny random Llama, in-process, virtual time).

Waves of 8 requests (20% P0, 40% P1, 40% P2) arrive every ``WAVE_GAP_STEPS`` steps
on 4 slots and a 64-token budget (their slot-steps ~87% of the slots' turnover), so they queue up
behind each other; each one's TTFT is predicted at arrival from the engine's last stats,
exactly as the API process does (its first output counted as a start, NOTE(class-drain)), and compared with the TTFT it then gets.

NOTE(stationary-waves): only the middle waves are measured.  The admission stretches a
class's prediction by the higher classes' arrival rate (NOTE(higher-arrivals)): a steady
arrival process.  The waves before the measured ones give it that rate, and the waves
after them keep arriving, as the stretch assumes.  Four back-to-back waves and then
nothing (the earlier design) measured two transients instead: the first wave's P2s were
overtaken by P1s of later waves no rate had foreseen yet (predicted 0.2 s, served 0.7 s),
the last wave's by none of the arrivals the measured rate promised (1.5 s, 0.85 s), and on
an AMD EPYC 9 runs in 10 failed the bound.

NOTE(virtual-time): the engine, its scheduler, the admission and the waves all read one
virtual clock, which only a step's execution moves: by ``a + b x tokens + c x sequences``
of the step, each step off by up to ``JITTER`` either way (seeded).  The model, the
scheduling and the prediction are the real ones; the host's timing is not.  In real time
the steps are ~1-2 ms, and on the CI's shared 2 cores a pause of the host moved whole
waves past the bound: all three real-time runs of one CI run failed (18-22 of 32 within),
where the same build passed on the next machine.  How long steps take on a host is the
benchmarks' business (docs/benchmarks.md); this test checks that the prediction follows
what the scheduler does, and a systematically wrong one fails it.

Stated bound: for at least 75% of the requests, |measured - predicted| <=
0.5 x measured + 3 step times (the prediction is made at step granularity).
The median error is printed.
The least accurate class is P2 (WFQ share 1 of the slots the reservation for P0 leaves).
"""

from __future__ import annotations

import random
import statistics
from typing import Any

import pytest

from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineRequest, SamplingParams
from sluice.server.admission import AdmissionController
from sluice.server.slo import SloTargets
from sluice.types import Priority

WAVE_GAP_STEPS = 30  # steps between two waves: the 4 slots turn over about as fast as the waves fill them
WARM_WAVES, MEASURED_WAVES, TAIL_WAVES = 2, 4, 2  # NOTE(stationary-waves)
STEP_BASE, STEP_PER_TOKEN, STEP_PER_SEQ = 1.0e-3, 15e-6, 40e-6  # NOTE(virtual-time): what the 2 cores measured
JITTER = 0.2  # ... and each step off by up to this share either way


class VirtualClock:
    """Seconds that pass only when ``advance`` is called (NOTE(virtual-time))."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _timed_engine(tiny_model_dir: str, clock: VirtualClock, rng: random.Random) -> EngineCore:
    """The engine on ``clock``: each executed step moves it by the step's cost (NOTE(virtual-time))."""
    engine = EngineCore(model=tiny_model_dir, dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=4,
                        max_num_batched_tokens=64, clock=clock)  # fmt: skip
    execute = engine.runner.execute

    def timed_execute(sched: Any, *args: Any) -> Any:
        out = execute(sched, *args)
        cost = STEP_BASE + STEP_PER_TOKEN * sched.num_batched_tokens + STEP_PER_SEQ * len(sched.scheduled)
        clock.advance(cost * (1.0 + rng.uniform(-JITTER, JITTER)))
        return out

    engine.runner.execute = timed_execute  # type: ignore[method-assign]
    return engine


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.model_factory import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


def _measure(tiny_model_dir: str, seed: int) -> tuple[int, int, str]:
    """One run in virtual time: (predictions within the bound, predictions, the failure message)."""
    clock, rng = VirtualClock(), random.Random(seed)
    engine = _timed_engine(tiny_model_dir, clock, random.Random(seed + 1000))
    admission = AdmissionController(10_000, 10**9, slo=SloTargets.parse("p0=1000s,p1=1000s,p2=1000s"), policy="wfq",
                                    max_num_batched_tokens=64, max_num_seqs=4, clock=clock)  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def step() -> list[str]:
        outs = engine.step()
        admission.observe_stats(engine.make_stats())
        firsts = []
        for o in outs:
            if o.new_token_ids and o.num_generated_tokens == 1:
                firsts.append(o.request_id)
            if o.finished:
                admission.observe_output_tokens(o.num_generated_tokens)
        return firsts

    # warm-up: fit the step-time model on steps of many sizes, 1 to 4 sequences (NOTE(per-seq-cost))
    for k in (1, 2, 3, 4, 4, 3, 2, 1):
        for i in range(k):
            engine.add_request(EngineRequest(request_id=f"w{k}-{i}-{rng.random()}", sampling=sp,
                                             prompt_token_ids=[7 + i] * rng.randint(4, 60)))  # fmt: skip
        while engine.has_unfinished_requests():
            step()
    # NOTE(warm-mix): then two unmeasured waves shaped like the measured ones, so
    # the step-time fit (an exponentially weighted line) has seen steps of the
    # sizes it will predict, not only the tail of the warm-up's last few decodes
    for wave in range(2):
        for j in range(8):
            engine.add_request(EngineRequest(request_id=f"m{wave}-{j}", sampling=sp,
                                             prompt_token_ids=[50 + j] * rng.randint(8, 40)))  # fmt: skip
        for _ in range(6):
            step()
    while engine.has_unfinished_requests():
        step()
    predicted: dict[str, float] = {}
    sent: dict[str, float] = {}
    measured: dict[str, float] = {}
    measured_ids: set[str] = set()
    n = 0
    for wave in range(WARM_WAVES + MEASURED_WAVES + TAIL_WAVES):
        for _ in range(8):
            rid, p = f"r{n}", Priority(rng.choice([0, 1, 1, 2, 2]))
            prompt = [100 + n + j for j in range(rng.randint(8, 40))]
            d = admission.admit(rid, p, len(prompt) + sp.max_tokens, len(prompt))
            assert d.predicted_ttft is not None
            predicted[rid], sent[rid] = d.predicted_ttft, clock()
            engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=sp, priority=int(p),
                                             arrival_time=sent[rid], ttft_target=d.target or 0.0))  # fmt: skip
            if WARM_WAVES <= wave < WARM_WAVES + MEASURED_WAVES:
                measured_ids.add(rid)
            n += 1
        for _ in range(WAVE_GAP_STEPS):
            for rid in step():
                if rid in sent:
                    measured[rid] = clock() - sent[rid]
                    admission.started(rid)
    while engine.has_unfinished_requests():
        for rid in step():
            if rid in sent:
                measured[rid] = clock() - sent[rid]
                admission.started(rid)
    stats = engine.make_stats()
    step_time = stats.step_time_base + stats.step_time_per_token * 64
    errors = {rid: measured[rid] - predicted[rid] for rid in measured if rid in measured_ids}
    within = [rid for rid, e in errors.items() if abs(e) <= 0.5 * measured[rid] + 3 * step_time]
    median_rel = statistics.median(abs(e) / measured[rid] for rid, e in errors.items())
    print(f"a={stats.step_time_base * 1000:.2f} ms b={stats.step_time_per_token * 1e6:.0f} us; prediction error: median {median_rel:.0%} of the measured TTFT; {len(within)}/{len(errors)} within bound")
    assert len(measured) == n, "every request must get its first token"
    return len(within), len(errors), (
        f"only {len(within)}/{len(errors)} predictions within 50% + 3 steps ({step_time * 1000:.1f} ms each): "
        + ", ".join(f"{rid} {predicted[rid]:.3f}/{measured[rid]:.3f}" for rid in sorted(errors, key=lambda r: int(r[1:])))
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_predicted_ttft_is_within_the_stated_bound_on_a_real_run(tiny_model_dir: str, seed: int) -> None:
    within, total, message = _measure(tiny_model_dir, seed)
    assert within >= 0.75 * total, message


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
