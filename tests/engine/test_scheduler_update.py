"""Scheduler.update_from_output / finish_requests without a model: progress, sampled tokens, stops, aborts."""

from __future__ import annotations

from sluice.engine.block_manager import BlockManager
from sluice.engine.protocol import SamplingParams
from sluice.engine.request import Request, RequestStatus
from sluice.engine.scheduler import Scheduler, SchedulerOutput

EOS = 2


def create_scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 512, max_model_len: int = 256) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks),
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=8,
        policy="fcfs",
        max_model_len=max_model_len,
        eos_token_ids=(EOS,),
    )


def create_requests(n: int, num_tokens: int = 20, **sampling: object) -> list[Request]:
    params = SamplingParams(**{"max_tokens": 8, **sampling})  # type: ignore[arg-type]
    return [Request(f"r{i}", [100 + 1000 * i + j for j in range(num_tokens)], params) for i in range(n)]


def _sample(sched: Scheduler, out: SchedulerOutput, token: int) -> list:  # type: ignore[type-arg]
    n = sum(s.samples for s in out.scheduled)
    return sched.update_from_output(out, [token] * n, [None] * n)


def test_update_advances_progress_and_appends_the_sampled_token() -> None:
    sched = create_scheduler()
    (req,) = create_requests(1)
    sched.add_request(req)
    out = sched.schedule()
    assert req.num_computed_tokens == 0, "schedule() plans; progress moves only when the step is applied"
    assert req.timings.first_scheduled is not None
    outputs = _sample(sched, out, 7)
    assert req.num_computed_tokens == 20 and req.output_token_ids == [7]
    assert [o.new_token_ids for o in outputs] == [[7]]
    assert outputs[0].timings is req.timings and req.timings.first_token is not None, "the first token carries timings"
    assert not outputs[0].finished


def test_chunked_prefill_emits_nothing_until_its_last_chunk() -> None:
    sched = create_scheduler(max_num_batched_tokens=16)
    (req,) = create_requests(1, num_tokens=40)
    sched.add_request(req)
    for computed in (16, 32):
        assert _sample(sched, sched.schedule(), 7) == [], "a chunk short of the prompt's end samples nothing"
        assert req.num_computed_tokens == computed
    assert [o.new_token_ids for o in _sample(sched, sched.schedule(), 7)] == [[7]]
    assert req.num_computed_tokens == 40


def test_eos_finishes_with_stop_and_frees_the_blocks() -> None:
    sched = create_scheduler()
    (req,) = create_requests(1)
    sched.add_request(req)
    (out,) = _sample(sched, sched.schedule(), EOS)
    assert out.finished and out.finish_reason == "stop" and out.stop_token_id == EOS
    assert req.status is RequestStatus.FINISHED_STOPPED and req.timings.finished is not None
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks, "a finished request holds no block"
    assert not sched.has_unfinished() and "r0" not in sched.requests


def test_eos_is_ignored_under_min_tokens_and_ignore_eos() -> None:
    sched = create_scheduler()
    a, = create_requests(1, min_tokens=2)
    b, = create_requests(1, ignore_eos=True)
    b.request_id = "b"
    for r in (a, b):
        sched.add_request(r)
    outs = _sample(sched, sched.schedule(), EOS)
    assert not any(o.finished for o in outs), "EOS ends neither a request under min_tokens nor one ignoring EOS"
    outs = _sample(sched, sched.schedule(), EOS)
    assert {o.request_id: o.finished for o in outs} == {"r0": True, "b": False}


def test_max_tokens_and_context_window_finish_with_length() -> None:
    sched = create_scheduler(max_model_len=22)
    short, = create_requests(1, max_tokens=1)
    long_, = create_requests(1, max_tokens=8)
    long_.request_id = "long"
    for r in (short, long_):
        sched.add_request(r)
    outs = {o.request_id: o for o in _sample(sched, sched.schedule(), 7)}
    assert outs["r0"].finish_reason == "length", "max_tokens reached"
    assert not outs["long"].finished
    (out,) = _sample(sched, sched.schedule(), 7)
    assert out.finish_reason == "length" and long_.num_tokens == 22, "the context window (22 tokens) is reached"


def test_finish_requests_gives_one_final_output_per_unfinished_request() -> None:
    sched = create_scheduler(max_num_batched_tokens=20)
    running, waiting = create_requests(2)
    for r in (running, waiting):
        sched.add_request(r)
    sched.schedule()  # the budget admits only the first
    assert running.block_ids and not waiting.block_ids
    outs = sched.finish_requests(["r0", "r1", "r0", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [
        ("r0", True, "abort"),
        ("r1", True, "abort"),
    ], "each unfinished request once; repeated and unknown ids are skipped"
    assert all(o.timings is not None and o.timings.finished is not None for o in outs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert not sched.has_unfinished() and len(sched.waiting) == 0 and not sched.running
