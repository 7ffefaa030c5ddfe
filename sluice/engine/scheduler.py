"""Continuous batching with chunked prefill, priority classes and preemption.

The scheduler decides *how many tokens* each request computes this step; the
block manager decides *whether they fit*.  It never touches tensors.

One step (``schedule``):

1. Running decodes, most urgent class first: one token each.
2. Prefill chunks out of what is left of ``max_num_batched_tokens``, class by
   class as the queue policy picks them (``request_queue``): a class's chunked
   prefill that is already running continues first, then its waiting
   requests are admitted, FIFO within the class.  Under ``wfq`` a class that
   is behind its TTFT target goes first; classes within target share the
   prefill tokens 5:3:1.

A higher class takes what it needs from running requests of *strictly lower*
classes, lowest class and newest first:

    slots    a waiting request with every ``max_num_seqs`` slot taken preempts one
             (lower classes leave the higher ones' recent peak free: NOTE(trunk-reservation));
             P0 always, a class with a TTFT target once it is behind it (NOTE(take-when-needed))
    blocks   a waiting request whose first chunk does not fit preempts until it does (the same)
    budget   a class facing an exhausted budget un-schedules lower classes'
             decodes for this step (``priority`` and ``wfq``; not ``fcfs``)

A waiting request whose LoRA adapter is not in memory yet, or past ``max_loras``
(NOTE(lora-admission)), or whose grammar still compiles (NOTE(grammar-wait)), is
set aside for this step and keeps its place.  With a KV tier (``kv_tiers``) a
request whose prefix continues in the tier waits in ``loading`` (a slot and its
blocks, nothing computed) until its loads are done, or recomputes if one failed.

Preemption is by recompute: the victim's blocks are freed and it goes back to
the front of its class's queue, to produce the same tokens later.  A running
request that needs a block when none is free preempts the lowest class, newest
request (maybe itself); a higher class is never preempted for a lower one.

After the model ran, ``update_from_output`` applies the step: progress
(``num_computed_tokens``: only the scheduler writes it), newly full blocks to
the prefix cache, blocks out of a sliding window back to the pool
(NOTE(window-blocks) in the block manager), the sampled tokens.  The stop rules
and the ``EngineOutput`` messages are ``outputs.OutputMaker``'s; the step's plan
is a ``SchedulerOutput`` (``sched_output``).  ``finish_requests`` ends others (aborts).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from sluice.engine.block_manager import BlockManager
from sluice.engine.config import SchedulingPolicy
from sluice.engine.hybrid_blocks import HybridBlockManager
from sluice.engine.kv_tiers.connector import KVTierConnector, LoadState
from sluice.engine.outputs import OutputMaker, make_output
from sluice.engine.protocol import EngineOutput, TokenLogprobs
from sluice.engine.request import Request, RequestStatus
from sluice.engine.request_queue import make_request_queue
from sluice.engine.sched_output import ScheduledRequest, SchedulerOutput
from sluice.engine.sched_signals import TARGET_MEMORY_S, CycleClock, RunningPeaks, TargetMemory
from sluice.types import Priority

__all__ = ["Scheduler", "SchedulerOutput", "ScheduledRequest", "BEHIND_FRACTION", "TARGET_MEMORY_S"]

BEHIND_FRACTION = 0.5  # share of its TTFT target after which a waiting request's class goes first
BEHIND_STEPS = 2.0  # ... or once what is left of its target is less than this many step cycles (NOTE(behind))


@dataclass
class _Step:
    """The step being planned."""

    out: SchedulerOutput
    budget: int  # tokens left of max_num_batched_tokens
    by_id: dict[str, ScheduledRequest]  # request_id -> its entry in out.scheduled
    now: float  # monotonic
    express: bool = False  # only P0 prefills this step (NOTE(express-step))
    nested: bool = False  # planned while another step runs: waiting P0s only, nothing taken (NOTE(mid-step-express))
    adapters: set[int] = field(default_factory=set)  # lora_id of running requests (and admitted this step)
    passed_over: list[Request] = field(default_factory=list)  # waiting adapter requests set aside this step


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager | HybridBlockManager,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        policy: str = "wfq",
        *,
        max_model_len: int | None = None,  # prompt + output cap; None: no cap
        eos_token_ids: Sequence[int] = (),  # end a request unless it asks ignore_eos
        clock: Callable[[], float] = time.monotonic,
        max_loras: int = 1 << 30,  # distinct LoRA adapters among running requests
        adapter_ready: Callable[[Request], bool] | None = None,  # its adapter is in memory (LoRAManager.is_ready)
        kv_tiers: KVTierConnector | None = None,  # tier below the prefix cache (disk), if any
        sliding_window: int | None = None,  # free the blocks out of it: every layer's, or a hybrid pool's sliding tables' (NOTE(window-blocks))
    ):
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 token, got {sliding_window}")
        self.sliding_window = sliding_window
        self.clock = clock
        self.max_loras = max_loras
        self.adapter_ready = adapter_ready
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.outputs = OutputMaker(eos_token_ids, max_model_len)  # stop rules, jump-forward, the messages
        self.requests: dict[str, Request] = {}  # request_id -> every unfinished request
        self.waiting = make_request_queue(policy)
        self.shares_slots = SchedulingPolicy(policy) is SchedulingPolicy.WFQ  # NOTE(take-when-needed)
        self.running: list[Request] = []
        self.kv_tiers = kv_tiers
        self.loading: list[Request] = []  # admitted, waiting for their KV blocks from a tier
        self.num_preemptions = 0
        self._targets = TargetMemory()  # NOTE(target-memory)
        self._peaks = RunningPeaks(self.clock())  # NOTE(trunk-reservation)
        self._cycle = CycleClock()  # NOTE(behind)
        # rows a step may carry for the classes below P0 while tight targets are about (set by the
        # engine each step from its step time, NOTE(row-cap) in EngineCore); None: max_num_seqs
        self.row_cap: int | None = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a request unless it asks ignore_eos (its output maker's)."""
        return self.outputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Sequence[int]) -> None:
        self.outputs.eos_token_ids = tuple(ids)

    @property
    def cycle_time(self) -> float:
        """Seconds from one ``schedule()`` to the next while busy (decaying mean)."""
        return self._cycle.cycle_time

    @property
    def peak_running(self) -> list[float]:
        """Recent peak of running requests by class (decaying)."""
        return self._peaks.peaks

    # ------------------------------------------------------------ lifecycle

    def add_request(self, req: Request) -> None:
        self._targets.add(req.ttft_target, self.clock())
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[EngineOutput]:
        """Finish unfinished requests (ids of finished or unknown ones are skipped); their final outputs."""
        outputs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, status, self.clock())
                outputs.append(make_output(req, []))
        return outputs

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        """Remove a request from whichever queue holds it and free its blocks."""
        req.status = status
        req.timings.finished = now
        if req in self.running:
            self.running.remove(req)
        elif req in self.loading:
            self.loading.remove(req)
        else:
            self.waiting.remove(req)
        self.block_manager.free_request(req)
        if self.kv_tiers is not None:
            self.kv_tiers.forget(req)
        del self.requests[req.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------ policy

    @staticmethod
    def _order_key(req: Request) -> tuple[int, float]:
        return (int(req.priority), req.timings.arrival)

    def _preempt(self, victim: Request, step: _Step) -> None:
        """Free a running request's blocks and put it back in front of its class (recompute later)."""
        undone = step.by_id.pop(victim.request_id, None)
        if undone is not None:  # scheduled earlier this step: un-schedule it, refund its tokens
            step.out.scheduled.remove(undone)
            step.budget += undone.num_new_tokens
            if undone.is_prefill:
                step.out.prefill_tokens_by_priority[victim.priority] -= undone.num_new_tokens
                self.waiting.charge(victim.priority, -undone.num_new_tokens)
        self.running.remove(victim)
        self.block_manager.free_request(victim)
        victim.num_computed_tokens = 0
        victim.num_forced_tokens = 0  # recomputed with the rest
        victim.spec_k = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(victim)
        step.out.preempted.append(victim)

    def _may_take_from_lower(self, req: Request, now: float) -> bool:
        """Whether ``req`` may preempt running requests of lower classes for a slot or blocks.

        NOTE(take-when-needed): P0 always may (its slots are kept free for it,
        NOTE(trunk-reservation)), and so may a request with no TTFT target and any
        request under ``priority`` and ``fcfs``.  Under ``wfq`` a P1 with a target
        takes from P2 only once it is behind it (NOTE(behind)): until then a slot
        that frees goes by the WFQ shares.  Taking earlier threw the victims' work
        away and left P2 no share under a P1 backlog (docs/design/overload.md).
        """
        if req.priority == Priority.P0 or req.ttft_target <= 0.0 or not self.shares_slots:
            return True
        return self._is_behind(req, now)

    def _lower_victim(self, priority: int) -> Request | None:
        """The running request to preempt for a request of class ``priority``: lowest class, newest, strictly lower."""
        victim = self.running[-1] if self.running else None
        return victim if victim is not None and victim.priority > priority else None

    def _add(self, step: _Step, req: Request, n: int) -> None:
        sr = ScheduledRequest(req, n)
        step.out.scheduled.append(sr)
        step.by_id[req.request_id] = sr
        step.budget -= n
        if sr.is_prefill:
            step.out.prefill_tokens_by_priority[req.priority] += n
            self.waiting.charge(req.priority, n)

    def _first_chunk(self, req: Request, budget: int) -> tuple[list[int], list[int], int]:
        """Cached prefix blocks of a waiting request, the tier keys after them, and its first chunk.

        NOTE(waiting-state): a waiting request holds no blocks and has computed
        nothing (it is new, or was preempted and reset), so its first chunk
        starts right after the prefix the cache (and the tier) already holds.
        """
        cached = self.block_manager.lookup_prefix(req)
        tier = self.kv_tiers.lookup(req, len(cached)) if self.kv_tiers is not None else []
        num_cached_tokens = (len(cached) + len(tier)) * self.block_manager.block_size
        return cached, tier, min(req.num_tokens - num_cached_tokens, budget)

    def _admit_loaded(self) -> None:
        """Requests whose tier loads finished: run them, or requeue them to recompute."""
        if self.kv_tiers is None:
            return
        if self.kv_tiers.has_loads():  # also loads whose request was aborted: release their blocks
            self.kv_tiers.poll()
        for req in list(self.loading):
            state = self.kv_tiers.load_state(req)
            if state is LoadState.WAITING:
                continue
            self.loading.remove(req)
            if state is LoadState.READY:
                req.status = RequestStatus.RUNNING
                bisect.insort(self.running, req, key=self._order_key)
            else:  # a block it needed did not arrive; the tier dropped it: recompute
                self.block_manager.free_request(req)
                req.num_computed_tokens = 0
                req.num_cached_tokens = -1
                self.waiting.prepend(req)

    def _is_behind(self, req: Request | None, now: float) -> bool:
        # NOTE(behind): a request is behind once it has used half of its TTFT target without a
        # first token, or once what is left of it is less than BEHIND_STEPS step cycles (it cannot
        # be passed over for one more step): from then on its class goes first.  The second rule
        # holds a target only a few steps long: such a request is behind when it arrives.
        if req is None or req.ttft_target <= 0.0 or req.timings.first_token is not None:
            return False
        waited = now - req.timings.arrival
        return waited > BEHIND_FRACTION * req.ttft_target or req.ttft_target - waited < BEHIND_STEPS * self.cycle_time

    def seq_limit_for(self, priority: int) -> int:
        """Running requests class ``priority`` may be admitted up to: the slots not reserved for higher classes.

        NOTE(trunk-reservation): preempting a lower class for a higher one throws
        the victim's work away (recompute).  So P0's recent peak of running
        requests, plus one, is kept free of lower-class admissions: a P0 then
        preempts only when it bursts past that peak.  P1 and P2 share the rest by
        WFQ; with no recent P0 nothing is reserved.  A lower class's limit counts
        the holders of classes other than P0, under ``max_num_seqs``, and while the
        engine bounds its steps (``row_cap``) at most the cap's rows beside P0's.
        """
        if priority == Priority.P0:
            return self.max_num_seqs
        peak = self.peak_running[Priority.P0]
        limit = self.max_num_seqs if peak <= 0.0 else self.max_num_seqs - math.ceil(peak) - 1
        if self.row_cap is not None:  # NOTE(row-cap): the step's rows, less P0's running requests
            p0 = sum(1 for r in (*self.running, *self.loading) if r.priority == Priority.P0)
            limit = min(limit, self.row_cap - p0)
        return max(1, limit)

    def tightest_ttft_target(self) -> float | None:
        """The smallest TTFT target of the requests added in the last ``TARGET_MEMORY_S`` seconds and of
        those waiting or in their prefill (each class's oldest waiting one, the running prefills):
        NOTE(target-memory) in ``sched_signals.py``."""
        waiting = [r.ttft_target for c in Priority if (r := self.waiting.head(c)) is not None]
        prefilling = [r.ttft_target for r in self.running if not r.is_prefill_done]
        return self._targets.tightest(self.clock(), (*waiting, *prefilling))

    def p0_prefills(self) -> Iterator[tuple[Request, int]]:
        """P0's prefill work in the order a step takes it (chunked prefills running, then the waiting
        requests, FIFO), each with the tokens it has left to compute (a waiting one's cached prefix not).
        Lazy: a caller that stops early looks no waiting request's prefix up past it."""
        for r in self.running:
            if r.priority == Priority.P0 and not r.is_prefill_done:
                yield r, r.num_tokens - r.num_computed_tokens
        size = self.block_manager.block_size
        for r in self.waiting.of_class(Priority.P0):
            if not r.is_waiting_for_grammar:  # it cannot start yet (NOTE(grammar-wait))
                yield r, r.num_tokens - size * len(self.block_manager.lookup_prefix(r))

    def urgent_prefill(self) -> tuple[int, int]:
        """(sequences, tokens) of P0 prefill work with a TTFT target: waiting, or a chunked prefill running."""
        n = t = 0
        for r in self.running:
            if r.priority == Priority.P0 and not r.is_prefill_done and r.ttft_target > 0.0:
                n, t = n + 1, t + r.num_tokens - r.num_computed_tokens
        for r in self.waiting.of_class(Priority.P0):
            if r.ttft_target > 0.0 and not r.is_waiting_for_grammar:
                n, t = n + 1, t + r.num_tokens
        return n, t

    def schedule(self, token_budget: int | None = None, express: bool = False, nested: bool = False) -> SchedulerOutput:
        """Plan one step of at most ``token_budget`` tokens (default and cap: ``max_num_batched_tokens``).

        NOTE(express-step): ``express`` plans P0's prefills only (waiting, and
        running chunked ones), no decodes: a P0 arriving mid-step then waits for
        the rest of that step and a short one, not for a full step of every
        running decode beside its prefill.  The engine's ``StepPlanner`` says when.

        NOTE(mid-step-express): ``nested`` plans an express step to run between two
        layers of a step in flight: every running request may be in that step, so
        it starts waiting P0s only, in free slots and blocks (no preemption, no
        budget taken), and leaves the cycle statistics and the KV tier's loaded
        requests to the next normal plan.
        """
        express = express or nested
        budget = self.max_num_batched_tokens if token_budget is None else min(token_budget, self.max_num_batched_tokens)
        # NOTE(bounded-slots): a budget bounded below max_num_batched_tokens (the
        # engine's NOTE(step-cap)) still holds every running decode plus some
        # prefill tokens; it does not shrink the slots (max_num_seqs), or a class
        # with many short requests (P0 under load) would wait for slots instead.
        step = _Step(SchedulerOutput(express=express), budget, {}, self.clock(), express, nested)
        if not nested:
            self._cycle.observe(step.now)
        step.adapters.update(r.lora_id for r in self.running if r.lora_id)
        if not nested:
            self._admit_loaded()
        self.running.sort(key=self._order_key)
        self._peaks.update(step.now, (*self.running, *self.loading))  # a loading request holds its slot
        # 1: running decodes, most urgent first, one token each
        for req in [r for r in self.running if r.is_prefill_done and not express]:
            if step.budget <= 0:
                break
            if req.status is RequestStatus.RUNNING:  # else preempted earlier in this loop
                self._schedule_running(step, req)
        # 2: prefill chunks, class by class as the queue policy picks them
        self._schedule_prefills(step)
        for req in reversed(step.passed_over):  # back in front of their classes, in their order
            self.waiting.prepend(req)
        out = step.out
        if step.adapters:
            # NOTE(lora-rows): each adapter's rows contiguous in the flat batch, so the
            # model applies its deltas to one slice per adapter (models/lora.py).
            out.scheduled.sort(key=lambda s: s.request.lora_id)
        out.num_batched_tokens = budget - step.budget
        out.token_budget = budget
        for s in out.scheduled:
            if s.request.timings.first_scheduled is None:
                s.request.timings.first_scheduled = step.now
        return out

    def _schedule_running(self, step: _Step, req: Request) -> None:
        """Give a running request its next chunk; a block shortage preempts the lowest class, newest (maybe itself).

        NOTE(spec-slots): a decode that drafts (``spec_k``, speculation) gets its draft tokens too, as many as
        the budget leaves; their blocks are allocated with the rest, and the ones the target rejects are
        given back after the step (``update_from_output``).  Drafts never preempt: where their blocks do
        not fit, the decode goes on without them.
        """
        n = min(req.num_tokens - req.num_computed_tokens + (req.spec_k if req.is_prefill_done else 0), step.budget)
        if req.spec_k and not self.block_manager.can_allocate(req, req.num_computed_tokens + n):
            n = min(req.num_tokens - req.num_computed_tokens, step.budget)
        while not self.block_manager.allocate(req, req.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is req:
                return
        self._add(step, req, n)

    def _schedule_prefills(self, step: _Step) -> None:
        chunked: list[deque[Request]] = [deque() for _ in Priority]  # running prefills, oldest first
        for r in self.running:
            if not r.is_prefill_done:
                chunked[r.priority].append(r)
        can_admit = [True for _ in Priority]
        if step.express:  # NOTE(express-step): P0's prefills only
            for c in Priority:
                if c != Priority.P0 or step.nested:  # nested: the running ones may be in the step in flight
                    chunked[c].clear()
                if c != Priority.P0:
                    can_admit[c] = False
        while True:
            oldest: list[float | None] = []
            behind: list[bool] = []
            for c in Priority:
                q = chunked[c]
                while q and q[0].status is not RequestStatus.RUNNING:  # preempted meanwhile
                    q.popleft()
                head = q[0] if q else self._waiting_head(c, step) if can_admit[c] else None
                oldest.append(None if head is None else head.timings.arrival)
                behind.append(self._is_behind(head, step.now))
            choice = self.waiting.pick_class(oldest, behind)
            if choice is None:
                return
            c = choice.priority
            req = chunked[c][0] if chunked[c] else self._waiting_head(c, step)
            assert req is not None
            if step.budget <= 0 and not (choice.is_urgent and self._take_budget(step, req)):
                return
            if chunked[c]:
                chunked[c].popleft()
                self._schedule_running(step, req)
            elif not self._admit(step, req):
                # NOTE(hol): no bypass: a class that cannot get a slot or blocks
                # stops the classes below it too, or they would take what it needs.
                for k in range(c, len(can_admit)):
                    can_admit[k] = False

    def _waiting_head(self, c: int, step: _Step) -> Request | None:
        """The first waiting request of class ``c`` that can run now; adapter requests that cannot
        (not in memory yet, or past ``max_loras``) are set aside for this step (NOTE(lora-admission)),
        and so are requests whose grammar is still compiling (NOTE(grammar-wait))."""
        while (req := self.waiting.head(c)) is not None and not self._can_start(req, step):
            step.passed_over.append(self.waiting.pop_head(c))
        return req

    def _can_start(self, req: Request, step: _Step) -> bool:
        # NOTE(grammar-wait): a request whose grammar compiles (off the step loop, in the engine's
        # GrammarCompiler) waits as a request for an adapter load does: it keeps its place in its
        # class, holds no slot and no blocks, and the requests behind it go on.
        if req.is_waiting_for_grammar:
            return False
        return not req.lora_id or self._can_run_adapter(req, step)

    def _can_run_adapter(self, req: Request, step: _Step) -> bool:
        if self.adapter_ready is not None and not self.adapter_ready(req):
            return False
        return req.lora_id in step.adapters or len(step.adapters) < self.max_loras

    def _take_budget(self, step: _Step, req: Request) -> bool:
        """Un-schedule decodes of classes below ``req`` (lowest class, newest first) for its next chunk.

        The decodes keep their blocks and go on next step; only this step's
        tokens change hands.  False when there is nothing to take.
        """
        if req.status is RequestStatus.RUNNING:
            need = req.num_tokens - req.num_computed_tokens
        else:
            _, _, need = self._first_chunk(req, self.max_num_batched_tokens)
        for s in reversed(list(step.out.scheduled)):
            if step.budget >= need:
                break
            if s.request.priority > req.priority and not s.is_prefill:
                step.out.scheduled.remove(s)
                del step.by_id[s.request.request_id]
                step.budget += s.num_new_tokens
        return step.budget > 0

    def _admit(self, step: _Step, req: Request) -> bool:
        """Start a waiting request: a slot and blocks for its first chunk, taken from lower classes if need be."""
        if req in step.out.preempted:
            return False  # NOTE(thrash): a request preempted this step waits for the next one
        bm = self.block_manager
        cached, tier, n = self._first_chunk(req, step.budget)
        num_memory_tokens = len(cached) * bm.block_size
        num_cached_tokens = num_memory_tokens + len(tier) * bm.block_size
        takes = not step.nested and self._may_take_from_lower(req, step.now)
        lower = [r for r in self.running if r.priority > req.priority] if takes else []
        limit = self.seq_limit_for(req.priority)
        holders = len(self.running) + len(self.loading)
        # P0's own holders sit in the slots kept for it: a lower class's limit counts the other classes only
        reserved = 0 if req.priority == Priority.P0 else sum(1 for r in (*self.running, *self.loading) if r.priority == Priority.P0)
        if holders - len(lower) - reserved >= limit or holders - len(lower) >= self.max_num_seqs:
            return False  # every slot it may use is held by this class or a higher one
        if not bm.fits_after_preempting(req, num_cached_tokens + n, cached, lower):
            return False  # even preempting every lower class would not make it fit
        # NOTE(take-from-lower): a higher class takes the slot and the blocks it
        # needs from running requests of strictly lower classes, lowest class and
        # newest first, by recompute: on CPU, recomputing a short prefix costs
        # less than copying its blocks out and back (no swap space), and the
        # victim's full blocks stay in the prefix cache until evicted.
        if holders - reserved >= limit or holders >= self.max_num_seqs:  # one slot, even when the limit fell below the running count
            victim = self._lower_victim(req.priority) if takes else None
            if victim is None:
                return False
            self._preempt(victim, step)
        while not bm.can_allocate(req, num_cached_tokens + n, cached):
            victim = self._lower_victim(req.priority) if takes else None
            if victim is None:
                return False
            self._preempt(victim, step)
        self.waiting.pop_head(req.priority)
        bm.allocate(req, num_cached_tokens + n, cached)
        req.num_computed_tokens = num_cached_tokens  # the prefix blocks hold (or will hold) its K/V
        if req.num_cached_tokens < 0:  # first admission: account prefix hits
            req.num_cached_tokens = num_cached_tokens
            bm.record_lookup(req.num_prompt_tokens, num_memory_tokens)
        if self.kv_tiers is not None and self.kv_tiers.start_load(req, len(cached), tier):
            self.loading.append(req)  # computes nothing until its blocks arrived
            return True
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=self._order_key)
        self._add(step, req, n)
        if req.lora_id:
            step.adapters.add(req.lora_id)
        return True

    # ------------------------------------------------------------ update

    def update_from_output(
        self,
        sched: SchedulerOutput,
        sampled_token_ids: list[int],
        logprobs: list[TokenLogprobs | None],
        runs: dict[str, tuple[list[int], list[TokenLogprobs | None]]] | None = None,
    ) -> list[EngineOutput]:
        """Apply one executed step: advance progress, append sampled tokens, finish stopped requests.

        ``sampled_token_ids`` / ``logprobs`` hold one entry per scheduled request
        that samples (``ScheduledRequest.samples``), in ``sched.scheduled`` order.
        ``runs``: request_id -> the tokens (and logprobs) a request that drafted
        emits (speculation: its kept drafts and the target's token after them).
        Returns one output per sampled token (per run).
        """
        now = self.clock()
        outputs: list[EngineOutput] = []
        i = 0
        for s in sched.scheduled:
            req = s.request
            if s.num_spec and runs is not None and req.request_id in runs:
                i += 1
                outputs.append(self._apply_run(s, *runs[req.request_id], now))
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(req, req.num_computed_tokens)
            self._free_out_of_window(req)
            if not s.samples:
                continue
            tok, lp = sampled_token_ids[i], logprobs[i]
            i += 1
            req.token_ids.append(tok)
            req.num_forced_tokens = 0
            if req.timings.first_token is None:
                req.timings.first_token = now
            status = self.outputs.stop_status(req, tok)
            if req.grammar is not None and status is not RequestStatus.FINISHED_STOPPED:
                status = self.outputs.advance_grammar(req, tok)  # a complete grammar says "stop" even at max_tokens
            if status is not None:
                self._finish(req, status, now)
            outputs.append(self.outputs.emit(req, tok, lp))
        return outputs

    def _free_out_of_window(self, req: Request) -> None:
        """Give back the blocks no later query of ``req`` reads: its next query is at ``num_computed_tokens``
        and sees ``sliding_window - 1`` tokens before it (NOTE(window-blocks) in the block manager)."""
        if self.sliding_window is not None:
            self.block_manager.free_before(req, req.num_computed_tokens - self.sliding_window + 1)

    def _apply_run(self, s: ScheduledRequest, run: list[int], lps: list[TokenLogprobs | None], now: float) -> EngineOutput:
        """Apply a drafting decode's step: its emitted run, token by token.

        NOTE(spec-update): the K/V computed this step hold the request's pending token and its
        drafts; those of the kept drafts are valid (the run's last token is the target's own and
        is computed next step).  A stop (EOS, a stop id, max_tokens, the context) inside the run
        ends the request at that token and drops the rest.  Only blocks full of accepted tokens
        are published to the prefix cache, and blocks past the request's tokens (rejected drafts'
        slots) go back to the free list.
        """
        req = s.request
        computed = req.num_computed_tokens + s.num_new_tokens - s.num_spec + len(run) - 1
        n, status = self.outputs.run_status(req, run)
        req.num_computed_tokens = min(computed, req.num_tokens - 1)
        if req.timings.first_token is None:
            req.timings.first_token = now
        self.block_manager.cache_full_blocks(req, req.num_computed_tokens)
        self.block_manager.trim(req, req.num_tokens)
        self._free_out_of_window(req)
        if status is not None:
            self._finish(req, status, now)
        return self.outputs.emit_run(req, lps[:n])
