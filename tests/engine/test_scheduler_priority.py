"""A higher class takes slots, token budget and blocks from strictly lower classes (issue 11).

Scheduler-only tests drive ``Scheduler`` with a fake runner (every chunk is
computed, every sample is token 1); the end-to-end test runs the tiny model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.engine.block_manager import BlockManager
from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineRequest, SamplingParams
from sluice.engine.request import Request, RequestStatus
from sluice.engine.scheduler import TARGET_MEMORY_S, Scheduler, SchedulerOutput
from sluice.engine.step_model import StepTimeModel
from sluice.types import Priority

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def create_scheduler(
    *, num_blocks: int = 256, max_num_batched_tokens: int = 64, max_num_seqs: int = 4, policy: str = "wfq",
    clock: FakeClock | None = None,
) -> Scheduler:  # fmt: skip
    return Scheduler(BlockManager(num_blocks), max_num_batched_tokens, max_num_seqs, policy, clock=clock or FakeClock())


def make_request(rid: str, priority: Priority, num_tokens: int = 8, *, max_tokens: int = 50, arrival: float | None = None,
                 ttft_target: float = 0.0) -> Request:  # fmt: skip
    prompt = [1000 * sum(map(ord, rid)) + j for j in range(num_tokens)]  # distinct prompts: no prefix hits
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority,
                   arrival_time=arrival, ttft_target=ttft_target)  # fmt: skip


def apply(sched: Scheduler, out: SchedulerOutput) -> None:
    n = sum(s.samples for s in out.scheduled)
    sched.update_from_output(out, [1] * n, [None] * n)


def scheduled_ids(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


@pytest.mark.parametrize("policy", ["wfq", "priority", "fcfs"])
def test_p0_arrival_runs_at_next_step_when_every_slot_holds_a_p2_decode(policy: str) -> None:
    sched = create_scheduler(max_num_seqs=4, policy=policy)
    p2 = [make_request(f"p2-{i}", Priority.P2, arrival=10.0 + i) for i in range(4)]
    for r in p2:
        sched.add_request(r)
    apply(sched, sched.schedule())  # all four prefilled, now decoding
    apply(sched, sched.schedule())
    assert all(r.status is RequestStatus.RUNNING and r.is_prefill_done for r in p2)
    p0 = make_request("p0", Priority.P0)
    sched.add_request(p0)
    out = sched.schedule()
    assert "p0" in scheduled_ids(out), "a P0 arrival must run at the next step, taking a P2's slot"
    assert p0.status is RequestStatus.RUNNING
    assert [v.request_id for v in out.preempted] == ["p2-3"], "the newest P2 gives up its slot"
    assert len(sched.running) == 4


def test_p2_arrival_never_preempts_a_higher_class() -> None:
    sched = create_scheduler(max_num_seqs=2)
    for rid, p in (("p0", Priority.P0), ("p1", Priority.P1)):
        sched.add_request(make_request(rid, p))
    apply(sched, sched.schedule())
    sched.add_request(make_request("p2", Priority.P2))
    out = sched.schedule()
    assert not out.preempted and "p2" not in scheduled_ids(out)
    assert sched.waiting.count_by_priority() == [0, 0, 1]


@pytest.mark.parametrize("policy", ["wfq", "priority"])
def test_p0_prefill_gets_its_chunk_when_p1_prefills_fill_the_budget(policy: str) -> None:
    sched = create_scheduler(max_num_batched_tokens=64, max_num_seqs=8, policy=policy)
    p1 = [make_request(f"p1-{i}", Priority.P1, num_tokens=200) for i in range(3)]
    for r in p1:
        sched.add_request(r)
    out = sched.schedule()
    assert sum(scheduled_ids(out).values()) == 64, "the P1 prefills fill the budget"
    apply(sched, out)
    p0 = make_request("p0", Priority.P0, num_tokens=40)
    sched.add_request(p0)
    out = sched.schedule()
    got = scheduled_ids(out)
    assert got.get("p0") == 40, f"the P0 prefill must get its whole chunk first, got {got}"
    assert sum(got.values()) == 64 and not out.preempted, "P1 keeps the rest of the budget and its blocks"


@pytest.mark.parametrize("policy", ["wfq", "priority"])
def test_higher_class_takes_the_budget_from_lower_class_decodes(policy: str) -> None:
    # 8 P2 decodes fill an 8-token budget; a P0 prefill takes those tokens for a step
    sched = create_scheduler(max_num_batched_tokens=8, max_num_seqs=9, policy=policy)
    p2 = [make_request(f"p2-{i}", Priority.P2, num_tokens=1, arrival=10.0 + i) for i in range(8)]
    for r in p2:
        sched.add_request(r)
    apply(sched, sched.schedule())
    sched.add_request(make_request("p0", Priority.P0, num_tokens=5))
    out = sched.schedule()
    got = scheduled_ids(out)
    assert got.get("p0") == 5, f"P0 must get its chunk out of the P2 decodes' budget, got {got}"
    assert len(got) == 4 and not out.preempted, "3 P2 decodes run, 5 skip one step and keep their blocks"
    assert set(got) - {"p0"} == {"p2-0", "p2-1", "p2-2"}, "the newest P2 decodes give up their tokens"


def test_waiting_p0_takes_blocks_from_running_p2() -> None:
    sched = create_scheduler(num_blocks=6, max_num_batched_tokens=256, max_num_seqs=8)
    for i in range(3):
        sched.add_request(make_request(f"p2-{i}", Priority.P2, num_tokens=31, arrival=10.0 + i))  # 2 blocks each
    apply(sched, sched.schedule())
    assert sched.block_manager.num_free_blocks == 0
    sched.add_request(make_request("p0", Priority.P0, num_tokens=40))  # 3 blocks
    out = sched.schedule()
    assert "p0" in scheduled_ids(out)
    assert [v.request_id for v in out.preempted] == ["p2-2", "p2-1"], "newest P2 first, only as many as needed"
    sched.block_manager.check_invariants()


def test_no_preemption_when_even_all_lower_classes_would_not_make_room() -> None:
    sched = create_scheduler(num_blocks=4, max_num_batched_tokens=256, max_num_seqs=8)
    sched.add_request(make_request("p2", Priority.P2, num_tokens=16))
    apply(sched, sched.schedule())
    sched.add_request(make_request("p0", Priority.P0, num_tokens=90))  # 6 blocks > 4 in all
    out = sched.schedule()
    assert not out.preempted, "preempting P2 could not make P0 fit: it must keep running"


def test_a_class_behind_its_target_goes_before_wfq_shares() -> None:
    def first_served(ttft_target: float) -> str:
        clock = FakeClock(101.0)
        sched = create_scheduler(max_num_batched_tokens=32, max_num_seqs=8, policy="wfq", clock=clock)
        # p2 is alone for a while: its virtual time stays low, so fairness favours it
        sched.add_request(make_request("p1", Priority.P1, num_tokens=32, arrival=100.0, ttft_target=ttft_target))
        sched.add_request(make_request("p2", Priority.P2, num_tokens=32, arrival=100.0))
        sched.waiting.vtime[1] = 50.0  # P1 was served a lot recently
        out = sched.schedule()
        return next(iter(scheduled_ids(out)))

    assert first_served(0.0) == "p2", "within target (no target), WFQ virtual time decides"
    assert first_served(10.0) == "p2", "1 s into a 10 s target is not behind"
    assert first_served(1.5) == "p1", "1 s into a 1.5 s target is behind: P1 goes first"


def test_wfq_shares_one_slot_between_backlogged_p1_and_p2() -> None:
    """NOTE(served-only) in the request queue: with one slot and P1 and P2 both backlogged, the slot
    goes by WFQ (3:1 in prefill tokens), not to P1 alone.  When a pick that found no slot moved the
    system virtual time, P2 was lifted to P1's tag at every such pick and lost every tie: all 40 P1s
    started before the first P2."""
    clock = FakeClock(100.0)
    sched = create_scheduler(max_num_seqs=1, max_num_batched_tokens=64, policy="wfq", clock=clock)
    for i in range(40):
        for p in (Priority.P1, Priority.P2):  # targets far away: no class is ever behind
            sched.add_request(make_request(f"{p.label}-{i}", p, num_tokens=16, max_tokens=4, arrival=100.0,
                                           ttft_target=1000.0))  # fmt: skip
    starts: list[int] = []
    for _ in range(200):
        out = sched.schedule()
        starts += [int(s.request.priority) for s in out.scheduled if s.is_prefill]
        apply(sched, out)
        clock.now += 0.01
    first = starts[:20]
    assert 4 <= first.count(2) <= 6, f"P2 should get ~1/4 of the slot's starts while both wait: {first}"
    assert sched.num_preemptions == 0, "a P1 within its target takes no slot from a running P2"


def test_a_p1_takes_a_running_p2s_slot_only_once_behind_its_target_or_with_none() -> None:
    """NOTE(take-when-needed): P0 always preempts a lower class for a slot; under wfq a P1 with a TTFT
    target only once it is behind (half its target used), a P1 with no target at once (class order), and
    under strict priority any P1 at once."""

    def preempted_after(p1_target: float, waited: float, policy: str = "wfq") -> list[str]:
        clock = FakeClock(100.0)
        sched = create_scheduler(max_num_seqs=1, max_num_batched_tokens=64, policy=policy, clock=clock)
        sched.add_request(make_request("p2", Priority.P2, max_tokens=50))
        apply(sched, sched.schedule())
        sched.add_request(make_request("p1", Priority.P1, arrival=100.0, ttft_target=p1_target))
        clock.now += waited
        out = sched.schedule()
        return [v.request_id for v in out.preempted]

    assert preempted_after(10.0, 1.0) == [], "1 s into a 10 s target: the P1 waits for the slot"
    assert preempted_after(10.0, 6.0) == ["p2"], "6 s into it the P1 is behind: it takes the slot"
    assert preempted_after(0.0, 0.0) == ["p2"], "no target: class order, at once"
    assert preempted_after(10.0, 1.0, "priority") == ["p2"], "strict priority keeps no shares: at once"


def test_preempted_request_resumes_and_finishes() -> None:
    sched = create_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    p2 = make_request("p2", Priority.P2, max_tokens=5)
    sched.add_request(p2)
    for _ in range(2):
        apply(sched, sched.schedule())
    sched.add_request(make_request("p0", Priority.P0, max_tokens=3))
    done: set[str] = set()
    for _ in range(30):
        out = sched.schedule()
        n = sum(s.samples for s in out.scheduled)
        for o in sched.update_from_output(out, [1] * n, [None] * n):
            if o.finished:
                done.add(o.request_id)
    assert done == {"p0", "p2"} and p2.num_preemptions == 1 and p2.num_output_tokens == 5
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_step_budget_can_be_bounded_and_tight_targets_are_remembered_for_a_while() -> None:
    clock = FakeClock(100.0)
    sched = create_scheduler(max_num_batched_tokens=64, max_num_seqs=8, clock=clock)
    sched.add_request(make_request("p1", Priority.P1, num_tokens=50, ttft_target=2.0))
    sched.add_request(make_request("p0", Priority.P0, num_tokens=50, ttft_target=0.3))
    assert sched.tightest_ttft_target() == 0.3
    out = sched.schedule(token_budget=20)
    assert out.num_batched_tokens == 20 and out.token_budget == 20, "the step must stay within the bounded budget"
    assert sched.schedule(token_budget=1000).token_budget == 64, "never over max_num_batched_tokens"
    while any(not r.is_prefill_done for r in sched.requests.values()):  # both get their first tokens
        apply(sched, sched.schedule())
    clock.now += TARGET_MEMORY_S + 0.01
    assert sched.tightest_ttft_target() is None, "a target seen long ago no longer bounds the step"


def test_a_tight_target_bounds_steps_while_its_request_waits_and_briefly_after() -> None:
    """NOTE(target-memory): one P0 request must not bound every step for long after it came, but
    a P0 still waiting for its first token keeps its target in force however old it is."""
    assert TARGET_MEMORY_S <= 2.0, "a sparse P0 would bound the lower classes' batches for seconds"
    clock = FakeClock(100.0)
    sched = create_scheduler(max_num_batched_tokens=64, max_num_seqs=4, clock=clock)
    sched.add_request(make_request("p2", Priority.P2, num_tokens=8, ttft_target=5.0))
    sched.add_request(make_request("p0", Priority.P0, num_tokens=8, ttft_target=0.3))
    clock.now += 3.0  # the engine was busy elsewhere: p0 still waits
    assert sched.tightest_ttft_target() == 0.3, "a waiting P0 bounds the steps whenever it came"
    apply(sched, sched.schedule())  # both prefilled: first tokens
    assert sched.tightest_ttft_target() is None, "no request before its first token, none added lately"
    sched.add_request(make_request("p0b", Priority.P0, num_tokens=8, ttft_target=0.3))
    apply(sched, sched.schedule())
    clock.now += TARGET_MEMORY_S / 2
    assert sched.tightest_ttft_target() == 0.3, "remembered a while after its request came"
    clock.now += TARGET_MEMORY_S / 2 + 0.01
    assert sched.tightest_ttft_target() is None, "then the lower classes' batches are free again"


def _engine(model: Path, **kw: object) -> EngineCore:
    args: dict[str, object] = {"model": str(model), "dtype": "float32", "kv_cache_memory": 8 << 20}
    args.update(kw)
    return EngineCore(**args)  # type: ignore[arg-type]


def _budget(engine: EngineCore) -> int | None:
    """The token budget ``EngineCore.step`` would plan with now (its one look at the tightest target)."""
    return engine.planner.token_budget(engine.scheduler.tightest_ttft_target())


def _row_cap(engine: EngineCore) -> int | None:
    """The row cap ``EngineCore.step`` would set now."""
    return engine.planner.row_cap(engine.scheduler.tightest_ttft_target())


def test_p2_preempted_by_p0_finishes_with_output_identical_to_an_unconstrained_run(tiny_llama: Path) -> None:
    prompts = {f"p2-{i}": [300 + 7 * i + j for j in range(20 + 3 * i)] for i in range(2)}
    prompts["p0"] = [50 + j for j in range(12)]
    prio = {"p2-0": 2, "p2-1": 2, "p0": 0}

    def submit(engine: EngineCore, rid: str) -> None:
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompts[rid], sampling=GREEDY, priority=prio[rid]))

    free = _engine(tiny_llama, max_num_seqs=8)
    for rid in prompts:
        submit(free, rid)
    expected: dict[str, list[int]] = {rid: [] for rid in prompts}
    while free.has_unfinished_requests():
        for o in free.step():
            expected[o.request_id].extend(o.new_token_ids)

    tight = _engine(tiny_llama, max_num_seqs=2)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    submit(tight, "p2-0")
    submit(tight, "p2-1")
    for _ in range(5):  # both P2s decoding, every slot taken
        for o in tight.step():
            got[o.request_id].extend(o.new_token_ids)
    submit(tight, "p0")
    first = tight.step()
    assert any(o.request_id == "p0" for o in first), "P0 must produce its first token at the next step"
    assert tight.scheduler.num_preemptions == 1
    for o in first:
        got[o.request_id].extend(o.new_token_ids)
    while tight.has_unfinished_requests():
        for o in tight.step():
            got[o.request_id].extend(o.new_token_ids)
    assert got == expected, "a preempted (recomputed) P2 must produce exactly the tokens of an unconstrained run"


def test_step_time_model_recovers_base_and_per_token_cost() -> None:
    m = StepTimeModel()
    for n in (8, 64, 200, 512, 30, 128) * 5:
        m.observe(n, 0.02 + 0.001 * n)
    assert m.base == pytest.approx(0.02, rel=1e-6) and m.per_token == pytest.approx(0.001, rel=1e-6)
    both = StepTimeModel()
    for n, q in ((8, 8), (64, 2), (200, 16), (16, 16), (300, 4), (40, 1)) * 5:
        both.observe(n, 0.005 + 0.0002 * n + 0.003 * q, q)
    assert (both.base, both.per_token, both.per_seq) == pytest.approx((0.005, 0.0002, 0.003), rel=1e-6)
    together = StepTimeModel()  # decode-only steps: tokens and sequences move together, one line carries both
    for q in (4, 16, 8, 32) * 5:
        together.observe(q, 0.005 + 0.0032 * q, q)
    assert together.per_seq == 0.0 and together.predict(20, 20) == pytest.approx(0.005 + 0.0032 * 20)
    flat = StepTimeModel()
    for _ in range(10):
        flat.observe(100, 0.12)
    assert flat.base == 0.0 and flat.predict(100) == pytest.approx(0.12), "one size: all of it per token"


def test_engine_bounds_its_steps_while_tight_targets_are_about(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, max_num_batched_tokens=512)
    for n in (16, 256) * 4:
        engine.step_model.observe(n, 0.01 + 0.001 * n)  # a = 10 ms, b = 1 ms / token
    assert _budget(engine) is None, "no target seen: the full budget"
    engine.add_request(EngineRequest(request_id="p0", prompt_token_ids=list(range(5, 400)), sampling=GREEDY,
                                     priority=0, ttft_target=0.33))  # fmt: skip
    assert _budget(engine) == 100, "a step may take a third of 0.33 s: (0.11 - 0.01) / 0.001 tokens"
    engine.step()
    assert engine.make_stats().max_num_batched_tokens == 100, "the stats report the bounded budget"


def test_bounded_budget_keeps_every_decode_and_every_slot() -> None:
    sched = create_scheduler(max_num_batched_tokens=64, max_num_seqs=16)
    for i in range(12):
        sched.add_request(make_request(f"p2-{i}", Priority.P2, num_tokens=4, arrival=10.0 + i))
    apply(sched, sched.schedule())
    assert len(sched.running) == 12
    sched.add_request(make_request("p2-late", Priority.P2, num_tokens=4, arrival=30.0))
    out = sched.schedule(token_budget=16)
    ids = scheduled_ids(out)
    assert all(ids[f"p2-{i}"] == 1 for i in range(12)) and ids["p2-late"] == 4, (
        "12 decodes, and 4 prefill tokens left: a bounded budget does not shrink the slots (NOTE(bounded-slots))"
    )
    apply(sched, out)
    sched.add_request(make_request("p0", Priority.P0, num_tokens=4, arrival=40.0))
    out = sched.schedule(token_budget=13 + 4)
    assert scheduled_ids(out)["p0"] == 4 and not out.preempted, "a free slot: the P0 preempts nobody"


def test_express_step_runs_p0_prefills_alone() -> None:
    sched = create_scheduler(max_num_batched_tokens=256, max_num_seqs=16)
    for i in range(6):
        sched.add_request(make_request(f"p2-{i}", Priority.P2, num_tokens=8, arrival=10.0 + i))
    apply(sched, sched.schedule())
    sched.add_request(make_request("p1", Priority.P1, num_tokens=8, arrival=20.0))
    sched.add_request(make_request("p0", Priority.P0, num_tokens=40, arrival=21.0, ttft_target=0.1))
    assert sched.urgent_prefill() == (1, 40)
    out = sched.schedule(token_budget=32, express=True)
    assert out.express and scheduled_ids(out) == {"p0": 32}, "only P0's prefill: no decode, no P1 admission"
    apply(sched, out)
    assert sched.urgent_prefill() == (1, 8), "its chunked prefill is still urgent"
    out = sched.schedule(express=True)
    assert scheduled_ids(out) == {"p0": 8}
    apply(sched, out)
    out = sched.schedule()
    ids = scheduled_ids(out)
    assert not out.express and all(ids[f"p2-{i}"] == 1 for i in range(6)) and ids["p0"] == 1 and ids["p1"] == 8


def test_engine_takes_an_express_step_for_a_p0_among_many_decodes(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, max_num_batched_tokens=512, max_num_seqs=16)
    for i in range(12):
        engine.add_request(EngineRequest(request_id=f"p2-{i}", prompt_token_ids=[5 + i] * 8, sampling=GREEDY, priority=2))
    for _ in range(3):
        engine.step()
    engine.step_model = StepTimeModel()  # only the known rates below: the real steps' times vary with the machine
    for n, q in ((16, 16), (200, 4), (12, 12), (64, 2)) * 4:
        engine.step_model.observe(n, 0.002 + 0.0001 * n + 0.001 * q, q)  # a = 2 ms, b = 0.1 ms / token, c = 1 ms / seq
    engine.add_request(EngineRequest(request_id="p0", prompt_token_ids=list(range(5, 15)), sampling=GREEDY,
                                     priority=0, ttft_target=0.5))  # fmt: skip
    # alone: 2 + 1 + 1 ms; next to the 12 decodes: 2 + 2.2 + 13 ms
    assert engine.planner.is_express(_budget(engine))
    outs = engine.step()
    assert engine.num_express_steps == 1 and [o.request_id for o in outs] == ["p0"], "the P0's first token, alone"
    stats = engine.make_stats()
    assert stats.steps_by_kind == [3, 1, 0] and stats.batched_tokens_by_kind[1] == 10, "NOTE(step-kinds) in core"
    assert not engine.planner.is_express(_budget(engine)), "nothing urgent left"
    engine.add_request(EngineRequest(request_id="p0-b", prompt_token_ids=list(range(5, 15)), sampling=GREEDY,
                                     priority=0, ttft_target=0.5))  # fmt: skip
    engine.planner.express_time = [0.75, 1.0]
    assert not engine.planner.is_express(_budget(engine)), "express steps took over 70% of the recent time: a normal step"


def test_lower_classes_leave_p0s_recent_peak_of_slots_free() -> None:
    clock = FakeClock(100.0)
    sched = create_scheduler(max_num_seqs=8, max_num_batched_tokens=256, clock=clock)
    for i in range(3):
        sched.add_request(make_request(f"p0-{i}", Priority.P0, max_tokens=2, arrival=10.0 + i))
    apply(sched, sched.schedule())
    apply(sched, sched.schedule())  # the P0s finish; their peak (3) is remembered
    assert not sched.running and sched.peak_running[0] >= 2.9
    for i in range(8):
        sched.add_request(make_request(f"p2-{i}", Priority.P2, arrival=20.0 + i))
    apply(sched, sched.schedule())
    assert len(sched.running) == 8 - 3 - 1, "P2 fills only the slots P0's recent peak (+1) does not need"
    sched.add_request(make_request("p0-new", Priority.P0, arrival=30.0))
    out = sched.schedule()
    assert "p0-new" in scheduled_ids(out) and not out.preempted, "a P0 within its peak finds a slot: nothing recomputed"
    clock.now += 60.0
    sched.schedule()
    assert sched.seq_limit_for(Priority.P2) >= 8 - 1 - 1, "the reservation fades with P0's traffic"


def test_running_p0s_sit_in_their_reserved_slots_not_in_the_lower_classes() -> None:
    sched = create_scheduler(max_num_seqs=8, max_num_batched_tokens=256, clock=FakeClock(100.0))
    for i in range(3):
        sched.add_request(make_request(f"p0-{i}", Priority.P0, max_tokens=40, arrival=10.0 + i))
    apply(sched, sched.schedule())
    for i in range(8):
        sched.add_request(make_request(f"p2-{i}", Priority.P2, arrival=20.0 + i))
    apply(sched, sched.schedule())
    p2 = [r for r in sched.running if r.priority == Priority.P2]
    assert len(sched.running) == 7 and len(p2) == 8 - 3 - 1, "3 P0s run in their reserved slots; P2 gets the other 4"


def test_an_express_step_that_cannot_start_its_p0_falls_back_to_a_normal_step(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, max_num_batched_tokens=512, max_num_seqs=2)
    for i in range(2):
        engine.add_request(EngineRequest(request_id=f"p0-{i}", prompt_token_ids=[5 + i] * 8, sampling=GREEDY,
                                         priority=0, ttft_target=0.5))  # fmt: skip
    engine.step()
    for n, q in ((16, 16), (200, 4), (12, 12), (64, 2)) * 4:
        engine.step_model.observe(n, 0.002 + 0.0001 * n + 0.005 * q, q)  # c = 5 ms / seq
    engine.add_request(EngineRequest(request_id="p0-late", prompt_token_ids=list(range(5, 15)), sampling=GREEDY,
                                     priority=0, ttft_target=0.5))  # fmt: skip
    assert engine.planner.is_express(_budget(engine)), "a P0 is waiting and decodes are running"
    outs = engine.step()  # both slots held by P0s: the express step is empty, so the decodes run
    assert sorted(o.request_id for o in outs) == ["p0-0", "p0-1"] and engine.num_express_steps == 0


def test_row_cap_bounds_the_lower_classes_slots_but_never_p0s() -> None:
    sched = create_scheduler(max_num_seqs=16, max_num_batched_tokens=256)
    sched.row_cap = 6  # NOTE(row-cap): set by the engine from its step time while tight targets are about
    for i in range(2):
        sched.add_request(make_request(f"p0-{i}", Priority.P0, arrival=5.0 + i))
    for i in range(8):
        sched.add_request(make_request(f"p2-{i}", Priority.P2, arrival=10.0 + i))
    apply(sched, sched.schedule())
    p2 = [r.request_id for r in sched.running if r.priority == Priority.P2]
    assert len(p2) == 4, f"6 rows less the 2 running P0s: 4 P2 slots, got {p2}"
    assert sched.seq_limit_for(Priority.P0) == 16
    for i in range(6):
        sched.add_request(make_request(f"p0-late-{i}", Priority.P0, arrival=20.0 + i))
    out = sched.schedule()
    assert sum(1 for k in scheduled_ids(out) if k.startswith("p0-late")) == 6 and not out.preempted, (
        "P0 keeps every slot: six more P0s start past the cap without preempting anyone"
    )
    sched.row_cap = None
    assert sched.seq_limit_for(Priority.P2) > 6, "no cap: the lower classes' limit is the slots again"


def test_a_tight_target_is_behind_once_its_slack_is_under_two_step_cycles() -> None:
    clock = FakeClock(100.0)
    sched = create_scheduler(max_num_seqs=8, clock=clock)
    p0 = make_request("p0", Priority.P0, arrival=100.0, ttft_target=0.07)
    assert not sched._is_behind(p0, 100.0), "no step measured yet: only the half-target rule"
    for _ in range(4):  # busy steps of 40 ms
        sched.schedule()
        clock.now += 0.04
    assert sched.cycle_time == pytest.approx(0.04)
    assert sched._is_behind(p0, 100.0 + 0.01), "60 ms left of 70 is under two 40 ms cycles: it goes first"
    slack = make_request("p1", Priority.P1, arrival=100.0, ttft_target=2.0)
    assert not sched._is_behind(slack, 100.01), "a 2 s target has slack for many cycles"
    clock.now += 5.0  # idle: a gap between schedule() calls is not a step cycle
    sched.schedule()
    assert sched.cycle_time == pytest.approx(0.04)


def test_engine_caps_the_rows_of_a_step_while_tight_targets_are_about(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, max_num_batched_tokens=512)
    for n in (16, 256) * 4:
        engine.step_model.observe(n, 0.01 + 0.001 * n)  # a = 10 ms, b = 1 ms / token (a row costs b)
    assert _row_cap(engine) is None, "no target seen: no cap"
    engine.add_request(EngineRequest(request_id="p0", prompt_token_ids=list(range(5, 20)), sampling=GREEDY,
                                     priority=0, ttft_target=0.33))  # fmt: skip
    # a third of 0.33 s = 110 ms, less a step with 16 prefill tokens (26 ms): 84 rows of 1 ms
    assert _row_cap(engine) == 84
    engine.step()
    assert engine.scheduler.row_cap == 84 and engine.make_stats().seq_limit_by_priority[2] <= 84
    engine.add_request(EngineRequest(request_id="p0-tight", prompt_token_ids=list(range(5, 20)), sampling=GREEDY,
                                     priority=0, ttft_target=0.03))  # fmt: skip
    assert _row_cap(engine) == 8, "a target too tight for any row: MIN_STEP_ROWS still run"


def test_with_mid_step_express_steps_the_rows_take_two_thirds_of_the_target_and_a_step_half(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, max_num_batched_tokens=512)
    for n in (16, 256) * 4:
        engine.step_model.observe(n, 0.01 + 0.001 * n)  # a = 10 ms, b = 1 ms / token (a row costs b)
    engine.add_request(EngineRequest(request_id="p0", prompt_token_ids=list(range(5, 20)), sampling=GREEDY,
                                     priority=0, ttft_target=0.33))  # fmt: skip
    assert _row_cap(engine) == 84, "at step boundaries only: a third of the target"
    engine.set_arrivals(lambda: None, lambda outs: None)  # as the engine core process does: express steps mid-step
    # NOTE(row-cap): two thirds of 0.33 s = 220 ms, less the 26-ms step: 194 rows (a P0 does not wait out the step)
    assert _row_cap(engine) in (193, 194)
    # NOTE(step-cap): the prefill tokens, half of 0.33 s = 165 ms less the 10-ms fixed cost: 155 tokens
    assert _budget(engine) in (154, 155)
    engine.config.express_mid_step = False  # --no-express-mid-step
    assert _row_cap(engine) == 84
    assert _budget(engine) == 100, "at step boundaries only: a third of the target"


def test_an_express_step_takes_only_the_p0s_it_can_serve_by_their_deadline(tiny_llama: Path) -> None:
    """NOTE(express-deadline): where a step's time grows with its prompts, a burst is split so the oldest
    P0s make their target; a P0 already past saving does not bound the step."""
    engine = _engine(tiny_llama, max_num_batched_tokens=512, max_num_seqs=32)
    for i in range(12):
        engine.add_request(EngineRequest(request_id=f"p2-{i}", prompt_token_ids=[5 + i] * 8, sampling=GREEDY, priority=2))
    for _ in range(3):
        engine.step()
    now = 1000.0
    engine.scheduler.clock = lambda: now

    def known_model() -> None:  # the real steps' times vary with the machine: only these rates
        engine.step_model = StepTimeModel()
        for n, q in ((16, 16), (200, 4), (12, 12), (64, 2)) * 4:
            engine.step_model.observe(n, 0.01 + 0.001 * n, q)  # 10 ms + 1 ms a token: one 20-token P0 30 ms, two 50

    def p0(rid: str, arrival: float, target: float = 0.06) -> None:  # 20 tokens, no prefix shared
        first = 100 + 20 * len(engine.scheduler.requests)
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=list(range(first, first + 20)),
                                         sampling=GREEDY, priority=0, ttft_target=target, arrival_time=arrival))  # fmt: skip

    for i in range(4):
        p0(f"p0-{i}", now)
    known_model()
    budget = _budget(engine)
    assert budget is not None and 2 * budget > 40, "twice the bounded budget would start a third P0's prefill"
    assert engine.planner.express_budget(budget) == 40, "two P0s end at 50 ms, within 60; a third would end at 70"
    outs = engine.step()
    assert engine.num_express_steps == 1
    assert {o.request_id for o in outs if o.new_token_ids} == {"p0-0", "p0-1"}, "the two oldest, whole"

    # 20 ms later: the third alone ends at 50 ms, within its 60; with the fourth at 70 ms
    now += 0.02
    known_model()
    assert engine.planner.express_budget(_budget(engine)) == 20
    outs = engine.step()
    assert {o.request_id for o in outs if o.new_token_ids} == {"p0-2"}

    # a P0 already past its deadline is served first (FIFO) but bounds nothing
    engine.step()  # the fourth
    known_model()
    p0("late", now - 0.1)
    for rid in ("a", "b", "c"):
        p0(rid, now)
    assert engine.planner.express_budget(_budget(engine)) == 40, "late + a end at 50 ms (a on time); + b: 70 ms"
    # a prompt whose first block is cached counts only what is left to compute
    engine.add_request(EngineRequest(request_id="again", prompt_token_ids=engine.scheduler.requests["p0-0"].prompt_token_ids,
                                     sampling=GREEDY, priority=0, ttft_target=0.06, arrival_time=now))  # fmt: skip
    assert dict((r.request_id, n) for r, n in engine.scheduler.p0_prefills())["again"] == 4
    # with a target they all meet, the step takes them all (the budget is the cap)
    for r, _ in engine.scheduler.p0_prefills():
        r.ttft_target = 1.0
    budget = _budget(engine)
    assert engine.planner.express_budget(budget) == min(512, 2 * budget)


def test_express_step_when_a_bounded_normal_step_cannot_hold_the_p0s(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, max_num_batched_tokens=512, max_num_seqs=32)
    for i in range(12):
        engine.add_request(EngineRequest(request_id=f"p2-{i}", prompt_token_ids=[5 + i] * 8, sampling=GREEDY, priority=2))
    for _ in range(3):
        engine.step()
    engine.step_model = StepTimeModel()  # only the known rates below: the real steps' times vary with the machine
    for n, q in ((16, 16), (200, 4), (12, 12), (64, 2)) * 4:
        engine.step_model.observe(n, 0.01 + 0.001 * n, q)  # a = 10 ms, b = 1 ms / token: a decode row is cheap
    for i in range(4):
        engine.add_request(EngineRequest(request_id=f"p0-{i}", prompt_token_ids=list(range(5 + i, 35 + i)),
                                         sampling=GREEDY, priority=0, ttft_target=0.3))  # fmt: skip
    budget = _budget(engine)
    assert budget is not None and budget < 12 + 4 * 30, "the bounded budget cannot hold 12 decodes and 120 P0 tokens"
    # alone 130 ms against 142 ms next to the decodes: under EXPRESS_GAIN, but a normal step would chunk the P0s
    assert engine.planner.is_express(budget)
    assert engine.planner.express_budget(budget) == min(512, 2 * budget), "an express step batches twice the budget"
    engine.step()
    assert engine.num_express_steps == 1
