"""How large each engine step is and what kind it is, from the measured step time.

    target  = scheduler.tightest_ttft_target()
    scheduler.row_cap = planner.row_cap(target)     rows for the classes below P0   NOTE(row-cap)
    budget  = planner.token_budget(target)          the step's prefill tokens       NOTE(step-cap)
    express = planner.is_express(budget)            P0's prefills alone             NOTE(express-step)
    ... the step runs ...
    planner.observe_step(...); planner.count_step(kind, seconds, tokens)

``EngineCore`` asks these once a step; the planner owns the step-time model
(``StepTimeModel``) and the engine's step accounting by kind (NOTE(step-kinds)).
It makes no choice of requests: that is the scheduler's.  The figures behind
each share are in docs/benchmarks.md ("Overload") and docs/design/overload.md.
"""

from __future__ import annotations

from sluice.engine.config import EngineConfig
from sluice.engine.protocol import STEP_KINDS
from sluice.engine.scheduler import Scheduler
from sluice.engine.step_model import StepTimeModel

__all__ = [
    "StepPlanner", "NORMAL", "EXPRESS", "NESTED", "STEP_SHARE", "MIN_STEP_TOKENS", "MID_STEP_SHARE",
    "MID_STEP_ROW_SHARE", "MIN_STEP_ROWS", "EXPRESS_GAIN", "EXPRESS_SHARE", "EXPRESS_DECAY",
]  # fmt: skip

STEP_SHARE = 1.0 / 3.0  # share of the tightest recent TTFT target one step may take (NOTE(step-cap))
MIN_STEP_TOKENS = 16  # ... but a step may always batch this many prefill tokens
MID_STEP_SHARE = 1.0 / 2.0  # STEP_SHARE while express steps start mid-step (NOTE(step-cap))
MID_STEP_ROW_SHARE = 2.0 / 3.0  # ... of the target the rows may take while express steps start mid-step (NOTE(row-cap))
MIN_STEP_ROWS = 8  # ... and the classes below P0 may always hold this many slots (NOTE(row-cap))
EXPRESS_GAIN = 1.5  # an express step is taken when a normal step would take this many times longer (NOTE(express-step))
EXPRESS_SHARE = 0.7  # ... and while express steps took less than this share of the recent step time
EXPRESS_DECAY = 0.97  # per step: the memory of that share (~30 steps, about a second: a burst of P0s passes)
NORMAL, EXPRESS, NESTED = range(len(STEP_KINDS))  # NOTE(step-kinds)


class StepPlanner:
    def __init__(self, config: EngineConfig, scheduler: Scheduler) -> None:
        self.config = config
        self.scheduler = scheduler
        self.step_model = StepTimeModel()
        self.has_arrivals = False  # the engine core process took input hooks (EngineCore.set_arrivals)
        self.express_time = [0.0, 0.0]  # decayed seconds of recent steps: express, all
        self.busy_by_kind = [0.0, 0.0, 0.0]  # NOTE(step-kinds): cumulative seconds by STEP_KINDS ...
        self.tokens_by_kind = [0, 0, 0]  # ... batched tokens ...
        self.steps_by_kind = [0, 0, 0]  # ... and steps
        self._last_step: tuple[int, int, float, float] | None = None  # (tokens, seqs, start, end) of the previous busy step

    @property
    def mid_step(self) -> bool:
        """Express steps may start mid-step: on in the config, and the engine looks for arrivals mid-step."""
        return self.has_arrivals and self.config.express_steps and self.config.express_mid_step

    # ------------------------------------------------------------ step bounds

    def token_budget(self, target: float | None) -> int | None:
        """The step's token budget: ``max_num_batched_tokens`` (None), or less while tight TTFT targets are
        about (``target``: ``Scheduler.tightest_ttft_target()``).

        NOTE(step-cap): a request arriving mid-step waits for that step to end, then for its own
        prefill step.  While requests with a TTFT target have come in recently, a step's prefill
        tokens are bounded so that the step takes ``STEP_SHARE`` of the tightest target (by the
        measured step time; ``MID_STEP_SHARE`` while express steps start mid-step, since a P0 then
        does not wait out the running step), never fewer than ``MIN_STEP_TOKENS``.  Every running
        decode stays in the budget: bounding them would make requests wait for slots instead.
        """
        model = self.step_model
        if target is None or model.per_token <= 0.0:
            return None
        decodes = sum(1 for r in self.scheduler.running if r.is_prefill_done)
        fixed = model.predict(decodes, decodes + 1)  # every decode, and a prefilling sequence
        share = MID_STEP_SHARE if self.mid_step else STEP_SHARE
        prefill = max(MIN_STEP_TOKENS, int((share * target - fixed) / model.per_token))
        return min(self.config.max_num_batched_tokens, decodes + prefill)

    def row_cap(self, target: float | None) -> int | None:
        """Rows a step may carry for the classes below P0 while tight TTFT targets are about (None: no cap).

        NOTE(row-cap): the step cap bounds a step's prefill tokens, but the running decodes are the
        rest of the step, one row each, and on a CPU a decode row costs about what a prefill token
        does.  So the slots of the classes below P0 are bounded too: with ``MIN_STEP_TOKENS`` of
        prefill, the rows that fit ``STEP_SHARE`` of the tightest target (``MID_STEP_ROW_SHARE``
        while express steps start mid-step), never fewer than ``MIN_STEP_ROWS``
        (``Scheduler.seq_limit_for``).  P0 keeps every slot; the lower classes wait for slots, which
        the admission's prediction sees.
        """
        model = self.step_model
        if target is None or model.per_token <= 0.0:
            return None
        share = MID_STEP_ROW_SHARE if self.mid_step else STEP_SHARE
        room = share * target - model.predict(MIN_STEP_TOKENS, 1)
        per_row = model.per_token + model.per_seq
        return max(MIN_STEP_ROWS, int(room / per_row))

    # ------------------------------------------------------------ express steps

    def is_express(self, budget: int | None) -> bool:
        """Whether the next step runs P0's pending prefills alone (NOTE(express-step) in the scheduler).

        Only when a normal step (every running decode next to those prefills) would take
        ``EXPRESS_GAIN`` times as long as the prefills alone, by the measured step time, or could not
        hold them next to every decode within the bounded budget (the P0s would wait two steps), and
        while express steps took under ``EXPRESS_SHARE`` of the recent step time.
        """
        model = self.step_model
        if not self.express_share_left():
            return False
        seqs, tokens = self.scheduler.urgent_prefill()
        if seqs == 0:
            return False
        tokens = min(tokens, self.express_budget(budget))
        decodes = sum(1 for r in self.scheduler.running if r.is_prefill_done)
        alone = model.predict(tokens, seqs)
        if budget is not None and tokens + decodes > budget:
            return True  # a normal step would not hold every decode and this prefill: P0 would wait two steps
        normal = model.predict(tokens + decodes, seqs + decodes)
        return normal > EXPRESS_GAIN * alone

    def express_share_left(self) -> bool:
        """Express steps are on, the step time is measured, and they took under ``EXPRESS_SHARE`` of the recent time."""
        express, total = self.express_time
        return self.config.express_steps and self.step_model.per_token > 0.0 and express <= EXPRESS_SHARE * total

    def express_budget(self, budget: int | None) -> int:
        """An express step's tokens: twice the bounded budget (several P0 prompts in one step, not
        chunked over two), at most ``max_num_batched_tokens``, and no more than the P0s it can take
        by their deadlines (NOTE(express-deadline))."""
        cap = self.config.max_num_batched_tokens
        cap = cap if budget is None else min(cap, 2 * budget)
        return min(cap, self._deadline_tokens(cap))

    def _deadline_tokens(self, cap: int) -> int:
        """The P0 prefill tokens one express step takes before it would make an on-time P0 late.

        NOTE(express-deadline): every P0 of an express step gets its first token when the whole step
        ends.  Where the GEMMs are compute-bound a step's time grows with every prompt in it, and one
        step of many P0s can make all of them late where the first few would have been on time.  So
        the step takes P0's prefills in the order it serves them (oldest first) only while, by the
        step-time model, it still ends by the earliest deadline (arrival + TTFT target) among those
        it would serve on time.  A P0 already past saving bounds nothing; the first is always taken.
        Returns ``cap`` when everything waiting fits.
        """
        model = self.step_model
        now = self.scheduler.clock()
        tokens = seqs = 0
        earliest = float("inf")  # the earliest deadline among the P0s the step so far serves on time
        for r, n in self.scheduler.p0_prefills():
            end = now + model.predict(tokens + n, seqs + 1)
            if seqs and end > earliest:
                return min(cap, tokens)
            tokens, seqs = tokens + n, seqs + 1
            if tokens >= cap:
                break
            deadline = r.timings.arrival + r.ttft_target
            if r.ttft_target > 0.0 and end <= deadline:
                earliest = min(earliest, deadline)
        return cap

    # ------------------------------------------------------------ accounting

    def observe_step(self, num_tokens: int, num_seqs: int, start: float, end: float) -> None:
        """Feed the step-time model one step late, so back-to-back steps include the loop's own overhead.

        NOTE(cycle-time): what a waiting request sees is the time from one step's start to the next
        one's (publishing outputs, reading input included); a gap over 10 ms means the loop idled,
        and then only the step itself counts.
        """
        prev = self._last_step
        if prev is not None:
            n, q, s, e = prev
            self.step_model.observe(n, start - s if start - e < 0.01 else e - s, q)
        self._last_step = (num_tokens, num_seqs, start, end)

    def count_step(self, kind: int, seconds: float, num_tokens: int) -> None:
        """Count one step's time and tokens: the totals by kind, and the decayed express share.

        NOTE(step-kinds): each second of the engine's steps is counted once, in the kind of step it
        went to (``STEP_KINDS``): a normal step, an express step taken at a step boundary, or one
        nested in a normal step between two of its layers (NOTE(mid-step-express)), whose time the
        normal step's leaves out.  The stats carry the totals and ``/metrics`` exports them
        (``sluice_engine_busy_seconds``, ``..._batched_tokens_by_kind``, ``..._steps_by_kind``).
        """
        self.busy_by_kind[kind] += seconds
        self.tokens_by_kind[kind] += num_tokens
        self.steps_by_kind[kind] += 1
        share = self.express_time  # EXPRESS_SHARE bounds the express part of the recent time
        share[0] = share[0] * EXPRESS_DECAY + (seconds if kind != NORMAL else 0.0)
        share[1] = share[1] * EXPRESS_DECAY + seconds

    @property
    def num_steps(self) -> int:
        """Steps run, not counting the express steps nested in them."""
        return self.steps_by_kind[NORMAL] + self.steps_by_kind[EXPRESS]

    @property
    def num_express_steps(self) -> int:
        """Express steps run, at step boundaries and nested (NOTE(express-step))."""
        return self.steps_by_kind[EXPRESS] + self.steps_by_kind[NESTED]

    @property
    def num_mid_step_express(self) -> int:
        """Express steps run between two layers of another step (NOTE(mid-step-express))."""
        return self.steps_by_kind[NESTED]
