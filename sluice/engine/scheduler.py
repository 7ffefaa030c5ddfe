"""Continuous batching with chunked prefill, priority classes and preemption.

The scheduler decides *how many tokens* each request computes this step; the
block manager decides *whether they fit*.  It never touches tensors.

One step (``schedule``):

1. Admission preemption: if the next waiting request (in queue-policy order)
   cannot get blocks for its first chunk and strictly lower classes hold
   blocks, preempt those (lowest class, newest first) until it fits.
2. Running decodes, in priority order: one token each.
3. Running prefills that were chunked in an earlier step, in priority order.
4. Waiting requests, in queue-policy order, each given a prefill chunk out of
   what is left of ``max_num_batched_tokens``, while running < ``max_num_seqs``.

When a running request needs a block and none is free, the lowest class,
newest request is preempted by recompute (its blocks freed; it goes back to
the front of its class's waiting queue).  Victims are taken from the end of
the priority-ordered running list, so a higher class is never preempted to make
room for a lower one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.engine.block_manager import BlockManager
from sluice.engine.request import Request, RequestStatus
from sluice.engine.request_queue import make_request_queue

__all__ = ["Scheduler", "SchedulerOutput", "ScheduledRequest"]


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    samples: bool = field(init=False)  # a token is sampled: the chunk reaches the last known token

    def __post_init__(self) -> None:
        self.samples = self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first, then prefills
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    prefill_tokens_by_priority: list[int] = field(default_factory=lambda: [0, 0, 0])

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        policy: str = "wfq",
    ):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting = make_request_queue(policy)
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------ lifecycle

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Remove a request from whichever queue holds it and free its blocks."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.block_manager.free_request(req)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ------------------------------------------------------------ policy

    @staticmethod
    def _order_key(req: Request) -> tuple[int, float]:
        return (int(req.priority), req.timings.arrival)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.block_manager.free_request(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(victim)
        out.preempted.append(victim)

    def _chunk(self, req: Request, budget: int) -> int:
        return min(req.num_tokens - req.num_computed_tokens, budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        self.running.sort(key=self._order_key)
        self._admission_preemption(out)

        # 2 + 3: running requests, decodes first then continuing prefills
        decodes = [r for r in self.running if r.is_prefill_done]
        prefills = [r for r in self.running if not r.is_prefill_done]
        scheduled: dict[str, ScheduledRequest] = {}
        for group in (decodes, prefills):
            for req in group:
                if budget <= 0:
                    break
                if req.status is not RequestStatus.RUNNING:
                    continue  # preempted earlier in this loop
                n = self._chunk(req, budget)
                while not bm.allocate(req, n):
                    victim = self.running[-1]  # lowest class, newest
                    undone = scheduled.pop(victim.request_id, None)
                    if undone is not None:  # un-schedule it and refund its tokens
                        out.scheduled.remove(undone)
                        budget += undone.num_new_tokens
                        if undone.num_new_tokens > 1 or not victim.is_prefill_done:
                            out.prefill_tokens_by_priority[victim.priority] -= undone.num_new_tokens
                    self._preempt(victim, out)
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:
                    continue
                n = min(n, budget)
                sr = ScheduledRequest(req, n)
                out.scheduled.append(sr)
                scheduled[req.request_id] = sr
                budget -= n
                if not req.is_prefill_done or n > 1:
                    out.prefill_tokens_by_priority[req.priority] += n

        # 4: admit waiting requests
        while budget > 0 and len(self.running) < self.max_num_seqs:
            head = self.waiting.peek()
            if head is None or head in out.preempted:
                break  # NOTE(thrash): a request preempted this step waits for the next one
            req = head
            cached: list[int] = []
            if req.num_computed_tokens == 0 and not req.block_ids:
                cached = bm.lookup_prefix(req)
            num_cached_tokens = len(cached) * bm.block_size
            n = min(req.num_tokens - num_cached_tokens, budget)
            probe_computed = req.num_computed_tokens
            req.num_computed_tokens = num_cached_tokens
            fits = bm.can_allocate(req, n, None) if not cached else True
            req.num_computed_tokens = probe_computed
            if not fits or not bm.allocate(req, n, cached or None):
                break  # NOTE(hol): no bypass, a later request must not overtake a higher one
            self.waiting.pop()
            if req.num_cached_tokens < 0:  # first admission: account prefix hits
                req.num_cached_tokens = num_cached_tokens
                bm.record_lookup(req.num_prompt_tokens, num_cached_tokens)
            self.waiting.charge(req.priority, req.num_tokens - req.num_computed_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            out.prefill_tokens_by_priority[req.priority] += n
            budget -= n

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _admission_preemption(self, out: SchedulerOutput) -> None:
        head = self.waiting.peek()
        if head is None or not self.running:
            return
        bm = self.block_manager
        cached = bm.lookup_prefix(head) if not head.block_ids else []
        saved = head.num_computed_tokens
        head.num_computed_tokens = len(cached) * bm.block_size
        n = min(head.num_tokens - head.num_computed_tokens, self.max_num_batched_tokens)
        try:
            while not bm.can_allocate(head, n, cached or None):
                victim = self.running[-1] if self.running else None
                if victim is None or victim.priority <= head.priority:
                    return
                self._preempt(victim, out)
        finally:
            head.num_computed_tokens = saved

    def update_after_step(self, sched: SchedulerOutput) -> None:
        """Advance progress of scheduled requests and register newly full blocks."""
        for s in sched.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(req)
