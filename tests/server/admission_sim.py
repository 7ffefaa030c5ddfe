"""A closed loop of clients against the admission and a model of the engine's scheduler, on a fake clock.

The engine model is the scheduler's shape, not its code: running decodes first, then prefill chunks of the
running requests and of the waiting ones (class order, FIFO within a class) out of a token budget, up to
``max_num_seqs`` slots, a step costing ``a + b * tokens + c * seqs``.  Each step it reports ``EngineStats``
as the engine does; between steps the clients whose request finished (or was refused) send the next one,
at once (no back-off: the worst case for a 429).  Deterministic and fast: a minute of load in ~1 s.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from sluice.engine.protocol import EngineStats
from sluice.errors import OverloadedError
from sluice.server.admission import AdmissionController
from sluice.server.slo import SloTargets
from sluice.types import Priority
from tests.server.slo_fakes import FakeClock

__all__ = ["SimEngine", "LoopResult", "run_closed_loop", "sim_controller"]

# a step of SmolLM2-135M on two cores, roughly: 20 ms, 0.8 ms a batched token, 0.5 ms a sequence
STEP_BASE, STEP_PER_TOKEN, STEP_PER_SEQ = 0.02, 0.0008, 0.0005


@dataclass
class _Req:
    key: str
    priority: Priority
    prompt_left: int  # tokens still to prefill (after a preemption: the prompt and its output again)
    max_tokens: int
    sent_at: float  # clock time
    generated: int = 0


@dataclass
class SimEngine:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    prompt_tokens: int = 128  # every request's
    running: list[_Req] = field(default_factory=list)
    waiting: list[_Req] = field(default_factory=list)
    num_batched_tokens_total: int = 0

    def step(self) -> tuple[float, list[_Req], list[_Req]]:
        """One step: (its seconds, the requests that got their first token, the requests that finished)."""
        decodes = [r for r in self.running if r.prompt_left == 0]
        self.waiting.sort(key=lambda r: r.priority)  # stable: FIFO within a class
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        # a higher class takes the slot of the newest running request of the lowest class below it (preemption)
        while self.waiting and (lower := [r for r in self.running if r.priority > self.waiting[0].priority]):
            victim = max(lower, key=lambda r: (r.priority, r.sent_at))
            self.running.remove(victim)
            victim.prompt_left = self.prompt_tokens + victim.generated  # freed: recomputed later
            self.waiting.append(victim)
            self.running.append(self.waiting.pop(0))
            self.waiting.sort(key=lambda r: r.priority)
            decodes = [r for r in decodes if r is not victim]
        budget = self.max_num_batched_tokens - len(decodes)
        chunks: list[tuple[_Req, int]] = []
        for r in sorted((r for r in self.running if r.prompt_left > 0), key=lambda r: r.priority):
            if budget <= 0:
                break
            n = min(budget, r.prompt_left)
            chunks.append((r, n))
            budget -= n
        tokens = len(decodes) + sum(n for _, n in chunks)
        seqs = len(decodes) + len(chunks)
        self.num_batched_tokens_total += tokens
        first, done = [], []
        for r in decodes:
            r.generated += 1
        for r, n in chunks:
            r.prompt_left -= n
            if r.prompt_left == 0 and r.generated == 0:
                r.generated = 1
                first.append(r)
        for r in self.running:
            if r.generated >= r.max_tokens:
                done.append(r)
        self.running = [r for r in self.running if r.generated < r.max_tokens]
        return STEP_BASE + STEP_PER_TOKEN * tokens + STEP_PER_SEQ * seqs, first, done

    def abort(self, key: str) -> None:
        self.waiting = [r for r in self.waiting if r.key != key]
        self.running = [r for r in self.running if r.key != key]

    def stats(self) -> EngineStats:
        run, wait, decoding, prefill = [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]
        for r in self.running:
            run[r.priority] += 1
            decoding[r.priority] += r.prompt_left == 0
            prefill[r.priority] += r.prompt_left
        for r in self.waiting:
            wait[r.priority] += 1
            prefill[r.priority] += r.prompt_left
        return EngineStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_running_by_priority=run, num_waiting_by_priority=wait,
            num_decoding=sum(decoding), num_decoding_by_priority=decoding, num_prefill_tokens_by_priority=prefill,
            num_batched_tokens_total=self.num_batched_tokens_total,
            step_time_base=STEP_BASE, step_time_per_token=STEP_PER_TOKEN, step_time_per_seq=STEP_PER_SEQ,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            running_slots=[[int(r.priority), r.generated, r.max_tokens - r.generated] for r in self.running],
        )  # fmt: skip


@dataclass
class LoopResult:
    num_done_by_priority: list[int] = field(default_factory=lambda: [0, 0, 0])
    refused_by_code: dict[str, int] = field(default_factory=dict)  # 429s at admission, by code
    num_shed_by_priority: list[int] = field(default_factory=lambda: [0, 0, 0])  # admitted, then shed (shed, expired)
    ttft_by_priority: list[list[float]] = field(default_factory=lambda: [[], [], []])  # seconds, served requests
    num_tokens: int = 0  # generated

    @property
    def num_refused(self) -> int:
        return sum(self.refused_by_code.values())


def sim_controller(slo: str, clock: FakeClock, engine: SimEngine, seed: int = 0) -> AdmissionController:
    """The controller ``sluice serve --slo SLO`` builds, with the server's default bounds ('off': no targets)."""
    targets = None if slo == "off" else SloTargets.parse(slo)
    return AdmissionController(256, 262_144, slo=targets, max_num_batched_tokens=engine.max_num_batched_tokens,
                               max_num_seqs=engine.max_num_seqs, clock=clock, rng=random.Random(seed))  # fmt: skip


def run_closed_loop(
    slo: str,
    streams: list[Priority],  # one closed-loop client per entry, of that class
    duration_s: float = 60.0,
    prompt_tokens: int = 128,
    output_tokens: int = 64,
    open_loop: tuple[Priority, float] | None = None,  # (class, requests/s) of Poisson arrivals besides the streams
    seed: int = 0,
) -> LoopResult:
    clock, engine, out = FakeClock(), SimEngine(prompt_tokens=prompt_tokens), LoopResult()
    a = sim_controller(slo, clock, engine, seed)
    rng = random.Random(seed)
    reqs: dict[str, _Req] = {}
    stream_of: dict[str, int] = {}
    idle = list(range(len(streams)))  # streams with no request in flight
    next_arrival = clock.now + (rng.expovariate(open_loop[1]) if open_loop else float("inf"))
    end = clock.now + duration_s
    seq = 0
    a.observe_stats(engine.stats())  # measured at start-up: the server's warm-up steps

    def send(priority: Priority, stream: int | None) -> bool:
        nonlocal seq
        seq += 1
        key = f"{priority.label}-{seq}"
        try:
            d = a.admit(key, priority, prompt_tokens + output_tokens, prompt_tokens)
        except OverloadedError as e:
            out.refused_by_code[e.code or ""] = out.refused_by_code.get(e.code or "", 0) + 1
            return False
        for victim in d.shed:
            drop(victim)
        r = _Req(key, priority, prompt_tokens, output_tokens, clock.now)
        reqs[key] = r
        engine.waiting.append(r)
        if stream is not None:
            stream_of[key] = stream
        return True

    def drop(key: str) -> None:  # shed after admission: the engine aborts it, its client sends again
        r = reqs.pop(key)
        engine.abort(key)
        a.remove(key)
        out.num_shed_by_priority[r.priority] += 1
        if key in stream_of:
            idle.append(stream_of.pop(key))

    while clock.now < end:
        idle[:] = [s for s in idle if not send(streams[s], s)]  # a refused client sends again next step
        while open_loop and next_arrival <= clock.now:
            send(open_loop[0], None)
            next_arrival += rng.expovariate(open_loop[1])
        for key in a.overdue():
            drop(key)
        seconds, first, done = engine.step()
        clock.now += seconds
        for r in first:
            a.started(r.key)
            out.ttft_by_priority[r.priority].append(clock.now - r.sent_at)
        for r in done:
            a.observe_output_tokens(r.generated)
            a.remove(r.key)
            reqs.pop(r.key, None)
            out.num_done_by_priority[r.priority] += 1
            out.num_tokens += r.generated
            if r.key in stream_of:
                idle.append(stream_of.pop(r.key))
        a.observe_stats(engine.stats())
    return out
