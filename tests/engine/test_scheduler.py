"""Scheduling behaviour: prefix caching, preemption by recompute, priority classes and WFQ."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sluice.engine.block_manager import BlockManager
from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineRequest, SamplingParams
from sluice.engine.request import Request
from sluice.engine.scheduler import Scheduler
from sluice.types import Priority

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _engine(model: Path, **kw: object) -> EngineCore:
    args: dict[str, object] = {"model": str(model), "dtype": "float32", "kv_cache_memory": 8 << 20}
    args.update(kw)
    return EngineCore(**args)  # type: ignore[arg-type]


def _run(engine: EngineCore, prompts: dict[str, list[int]], params: SamplingParams = GREEDY, prio: dict[str, int] | None = None) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=p, sampling=params, priority=(prio or {}).get(rid, 1)))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def _count_computed(engine: EngineCore) -> dict[str, int]:
    """Wrap the runner to count tokens computed per request."""
    counts: dict[str, int] = {}
    inner = engine.runner.execute

    def execute(sched, rows, *hooks):  # type: ignore[no-untyped-def]
        for s in sched.scheduled:
            counts[s.request.request_id] = counts.get(s.request.request_id, 0) + s.num_new_tokens
        return inner(sched, rows, *hooks)

    engine.runner.execute = execute  # type: ignore[method-assign]
    return counts


def test_prefix_cache_computes_only_the_suffix(tiny_llama: Path) -> None:
    shared = [100 + i for i in range(64)]
    a, b = shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]
    engine = _engine(tiny_llama)
    counts = _count_computed(engine)
    _run(engine, {"a": a})
    engine.add_request(EngineRequest(request_id="b", prompt_token_ids=b, sampling=GREEDY))
    out_b: list[int] = []
    cached = -1
    while engine.has_unfinished_requests():
        for o in engine.step():
            out_b.extend(o.new_token_ids)
            cached = o.num_cached_tokens
    assert cached == 64, "the 64-token shared prefix (4 blocks) should come from the cache"
    # prefill computes only the 5-token suffix; each of the 23 later tokens is one decode step
    assert counts["b"] == len(b) - 64 + GREEDY.max_tokens - 1
    fresh = _run(_engine(tiny_llama, enable_prefix_caching=False), {"b": b})
    assert out_b == fresh["b"], "prefix-cached output must equal a cold run"
    assert engine.make_stats().prefix_cache_hits == 64


def test_preemption_recomputes_and_outputs_match_unconstrained_run(tiny_llama: Path) -> None:
    prompts = {f"r{i}": [200 + 13 * i + j for j in range(30 + 5 * i)] for i in range(6)}
    prio = {f"r{i}": i % 3 for i in range(6)}
    big = _run(_engine(tiny_llama), prompts, prio=prio)
    # 14 blocks of 16 tokens: the 6 requests need up to 5 blocks each -> preemption
    small = _engine(tiny_llama, kv_cache_memory=14 * 2 * 2 * 16 * 2 * 16 * 4, enable_prefix_caching=False)
    assert small.block_manager.num_blocks == 14
    preempted_classes: list[tuple[int, list[int]]] = []
    inner = small.scheduler._preempt

    def spy(victim: Request, out):  # type: ignore[no-untyped-def]
        holders = [int(r.priority) for r in small.scheduler.running if r is not victim and r.block_ids]
        preempted_classes.append((int(victim.priority), holders))
        inner(victim, out)

    small.scheduler._preempt = spy  # type: ignore[method-assign]
    got = _run(small, prompts, prio=prio)
    assert small.scheduler.num_preemptions > 0, "the small KV budget should force preemption"
    assert got == big, "preempted (recomputed) requests must produce the same tokens"
    for victim, holders in preempted_classes:
        assert all(h <= victim for h in holders), f"a p{victim} request was preempted while a lower class held blocks: {holders}"
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


class _FakeRun:
    """Drive a Scheduler without a model: every scheduled chunk is computed, every sample is token 1."""

    def __init__(self, sched: Scheduler, max_out: int):
        self.sched, self.params, self.step_no = sched, SamplingParams(max_tokens=max_out, ignore_eos=True), 0
        self.first_sched: dict[str, int] = {}
        self.arrival: dict[str, int] = {}

    def add(self, rid: str, prompt: list[int], priority: Priority) -> None:
        self.arrival[rid] = self.step_no
        self.sched.add_request(Request(rid, prompt, self.params, priority=priority))

    def step(self) -> list[int]:
        out = self.sched.schedule()
        for s in out.scheduled:
            self.first_sched.setdefault(s.request.request_id, self.step_no)
        num_samples = sum(s.samples for s in out.scheduled)
        self.sched.update_from_output(out, [1] * num_samples, [None] * num_samples)
        self.step_no += 1
        return out.prefill_tokens_by_priority


def test_wfq_gives_p1_three_fifths_of_p0_prefill_tokens() -> None:
    sched = Scheduler(BlockManager(4096), max_num_batched_tokens=256, max_num_seqs=256, policy="wfq")
    run = _FakeRun(sched, max_out=2)
    for i in range(300):
        for p in (Priority.P0, Priority.P1):
            run.add(f"{p.label}-{i}", [1000 * i + 10 * int(p) + j for j in range(64)], p)
    totals = [0, 0, 0]
    for _ in range(60):  # both classes stay backlogged for all of these steps
        per = run.step()
        totals = [a + b for a, b in zip(totals, per)]
    assert sched.waiting.count_by_priority()[0] > 0 and sched.waiting.count_by_priority()[1] > 0
    ratio = totals[1] / totals[0]
    assert 1 / 3 <= ratio <= 2 / 3, f"P1/P0 prefill share {ratio:.2f} should be near 3/5 (WFQ 5:3)"


@pytest.mark.parametrize("policy", ["wfq", "priority"])
def test_p0_queue_time_is_below_p2_under_saturation(policy: str) -> None:
    sched = Scheduler(BlockManager(2048), max_num_batched_tokens=128, max_num_seqs=16, policy=policy)
    run = _FakeRun(sched, max_out=8)
    rng = random.Random(7)
    classes: dict[str, int] = {}
    for n in range(800):
        p = Priority(rng.choice([0, 1, 2]))
        classes[f"r{n}"] = int(p)
        run.add(f"r{n}", [n * 100 + j for j in range(rng.randint(16, 96))], p)
        if n % 2 == 1:  # two arrivals per step outpace service: saturating
            run.step()
    waits: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for rid, arrival in run.arrival.items():  # a request never scheduled has waited until the end (at least)
        waits[classes[rid]].append(run.first_sched.get(rid, run.step_no) - arrival)

    def p95(xs: list[int]) -> float:
        xs = sorted(xs)
        return float(xs[int(0.95 * (len(xs) - 1))]) if xs else float("inf")

    assert waits[0], "some P0 requests must have been served"
    assert p95(waits[0]) < p95(waits[2]), f"p95 queue steps P0={p95(waits[0])} must be below P2={p95(waits[2])}"


def test_abort_frees_blocks_at_next_step(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    engine.add_request(EngineRequest(request_id="x", prompt_token_ids=list(range(10, 60)), sampling=GREEDY))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort(["x"])
    outs = engine.step()
    assert any(o.request_id == "x" and o.finish_reason == "abort" for o in outs)
    assert engine.block_manager.num_used_blocks == 0, "aborted request's blocks must be freed"
    assert not engine.has_unfinished_requests()
