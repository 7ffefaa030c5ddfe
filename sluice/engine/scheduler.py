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

After the model ran, ``update_from_output`` applies the step: it advances
each request's progress (``num_computed_tokens``: only the scheduler writes
it), registers newly full blocks with the block manager, appends the sampled
tokens and finishes the requests that hit a stop token, ``max_tokens`` or the
context window.  ``finish_requests`` finishes others (aborts).  Both return
the ``EngineOutput`` messages, built in one place (``_make_output``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sluice.engine.block_manager import BlockManager
from sluice.engine.protocol import EngineOutput, TokenLogprobs
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
        *,
        max_model_len: int | None = None,  # prompt + output cap; None: no cap
        eos_token_ids: Sequence[int] = (),  # end a request unless it asks ignore_eos
    ):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.requests: dict[str, Request] = {}  # request_id -> every unfinished request
        self.waiting = make_request_queue(policy)
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------ lifecycle

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[EngineOutput]:
        """Finish unfinished requests (ids of finished or unknown ones are skipped); their final outputs."""
        outputs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, status, time.monotonic())
                outputs.append(self._make_output(req, []))
        return outputs

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        """Remove a request from whichever queue holds it and free its blocks."""
        req.status = status
        req.timings.finished = now
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.block_manager.free_request(req)
        del self.requests[req.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

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

    def _first_chunk(self, req: Request, budget: int) -> tuple[list[int], int]:
        """Cached prefix blocks of a waiting request and the size of its first chunk after them.

        NOTE(waiting-state): a waiting request holds no blocks and has computed
        nothing (it is new, or was preempted and reset), so its first chunk
        starts right after the prefix the cache already holds.
        """
        cached = self.block_manager.lookup_prefix(req)
        num_cached_tokens = len(cached) * self.block_manager.block_size
        return cached, min(req.num_tokens - num_cached_tokens, budget)

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
                while not bm.allocate(req, req.num_computed_tokens + n):
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
            cached, n = self._first_chunk(req, budget)
            num_cached_tokens = len(cached) * bm.block_size
            if not bm.allocate(req, num_cached_tokens + n, cached):
                break  # NOTE(hol): no bypass, a later request must not overtake a higher one
            self.waiting.pop()
            req.num_computed_tokens = num_cached_tokens  # the prefix blocks hold its K/V already
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
        now = time.monotonic()
        for s in out.scheduled:
            if s.request.timings.first_scheduled is None:
                s.request.timings.first_scheduled = now
        return out

    def _admission_preemption(self, out: SchedulerOutput) -> None:
        head = self.waiting.peek()
        if head is None or not self.running:
            return
        cached, n = self._first_chunk(head, self.max_num_batched_tokens)
        num_tokens = len(cached) * self.block_manager.block_size + n
        while not self.block_manager.can_allocate(head, num_tokens, cached):
            victim = self.running[-1] if self.running else None
            if victim is None or victim.priority <= head.priority:
                return
            self._preempt(victim, out)

    # ------------------------------------------------------------ update

    def update_from_output(
        self, sched: SchedulerOutput, sampled_token_ids: list[int], logprobs: list[TokenLogprobs | None]
    ) -> list[EngineOutput]:
        """Apply one executed step: advance progress, append sampled tokens, finish stopped requests.

        ``sampled_token_ids`` / ``logprobs`` hold one entry per scheduled request
        that samples (``ScheduledRequest.samples``), in ``sched.scheduled`` order.
        Returns one output per sampled token.
        """
        now = time.monotonic()
        outputs: list[EngineOutput] = []
        i = 0
        for s in sched.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(req, req.num_computed_tokens)
            if not s.samples:
                continue
            tok, lp = sampled_token_ids[i], logprobs[i]
            i += 1
            req.token_ids.append(tok)
            if req.timings.first_token is None:
                req.timings.first_token = now
            status = self._check_stop(req, tok)
            if status is not None:
                self._finish(req, status, now)
            outputs.append(self._make_output(req, [tok], [lp] if lp is not None else None))
        return outputs

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling
        n_out = req.num_output_tokens
        is_stop = (not sp.ignore_eos and tok in self.eos_token_ids) or tok in sp.stop_token_ids
        if n_out >= sp.min_tokens and is_stop:
            req.stop_token_id = tok
            return RequestStatus.FINISHED_STOPPED
        if n_out >= sp.max_tokens or (self.max_model_len is not None and req.num_tokens >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _make_output(
        req: Request, new_token_ids: list[int], logprobs: list[TokenLogprobs] | None = None
    ) -> EngineOutput:
        out = EngineOutput(
            request_id=req.request_id,
            new_token_ids=new_token_ids,
            logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(0, req.num_cached_tokens),
            num_generated_tokens=req.num_output_tokens,
            num_preemptions=req.num_preemptions,
        )
        if req.status.is_finished:
            out.finished = True
            out.finish_reason = req.status.finish_reason
            out.stop_token_id = req.stop_token_id
            out.timings = req.timings
        elif new_token_ids and req.num_output_tokens == 1:
            out.timings = req.timings  # the first token: stage timings so far
        return out
