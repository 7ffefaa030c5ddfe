"""The scheduler's model of itself: a new request's time to first token from what is ahead of it (pure).

Written here, beside the scheduler it models, so that a change to the scheduler changes its model in
the same place; the API process's admission (``sluice.server.admission``) imports it and feeds it the
engine's last stats (``EngineLoad.from_stats``).  No torch: the API process stays light.

The wait, from the measured step time ``a + b * tokens + c * seqs`` (``step_model``):

    prefill-bound   the prefill tokens served before the request's last prompt token: its class's
                    backlog (FIFO) and the other classes' shares while it waits (wfq: GPS shares by
                    ``PRIORITY_WEIGHTS``; priority: every higher class; fcfs: everything), at
                    ``max_num_batched_tokens - decodes`` tokens a step; a P0 with express steps: its
                    own backlog alone, ``express_budget`` tokens a step (NOTE(express-prediction))
    slot-bound      with every slot it may use held by its class or higher ones (P0's reserved slots
                    aside, NOTE(trunk-reservation)), the steps until enough of them free
                    (NOTE(slot-turnover))

plus half the running step (a P0 with a free slot and mid-step express steps waits
``MID_STEP_WAIT_S`` instead).  Lower classes hold no slots, blocks or decode tokens against it (it takes
them).  Arrivals after it are not foreseen here: the admission stretches the prediction by them.
Checked against real runs by ``benchmarks/prediction_error.py`` (docs/benchmarks.md, "TTFT prediction
error").
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.engine.config import MID_STEP_POLL_S
from sluice.engine.protocol import EngineStats
from sluice.engine.sched_signals import reserved_seq_limit
from sluice.types import PRIORITY_WEIGHTS, Priority

__all__ = ["EngineLoad", "MID_STEP_WAIT_S", "express_request_seconds", "predict_ttft", "unloaded_ttft"]

MID_STEP_WAIT_S = MID_STEP_POLL_S + 0.001  # a P0's wait for a mid-step express step: the engine's next look, plus a layer


@dataclass
class EngineLoad:
    """What is ahead of a new request: the engine's last stats plus what was sent after them."""

    step_time_base: float = 0.0  # seconds, a
    step_time_per_token: float = 0.0  # seconds per batched token, b
    step_time_per_seq: float = 0.0  # seconds per scheduled sequence, c
    max_num_batched_tokens: int = 512
    express_budget: int = 0  # tokens of P0 prefill an express step batches (0: no express steps)
    express_mid_step: bool = False  # ... and one may start mid-step (the engine's NOTE(mid-step-express))
    max_num_seqs: int = 64
    seq_limit_by_priority: list[int] | None = None  # slots each class may fill (None: max_num_seqs for all)
    num_decoding: int = 0
    num_decoding_by_priority: list[int] | None = None  # None: unknown, all decodes count for every class
    num_running_by_priority: list[int] = field(default_factory=lambda: [0, 0, 0])
    num_waiting_by_priority: list[int] = field(default_factory=lambda: [0, 0, 0])  # requests that need a slot
    num_prefill_tokens_by_priority: list[int] = field(default_factory=lambda: [0, 0, 0])
    mean_output_tokens: float = 16.0  # decode steps a request holds its slot (measured)
    # per slot holder: (class, output tokens so far, output tokens it may still make); None: unknown
    running_slots: list[tuple[int, int, int]] | None = None
    policy: str = "wfq"

    @classmethod
    def from_stats(cls, s: EngineStats, *, policy: str, mean_output_tokens: float,
                   max_num_batched_tokens: int, max_num_seqs: int) -> EngineLoad:  # fmt: skip
        return cls(
            step_time_base=s.step_time_base,
            step_time_per_token=s.step_time_per_token,
            step_time_per_seq=s.step_time_per_seq,
            max_num_batched_tokens=s.max_num_batched_tokens or max_num_batched_tokens,
            express_budget=s.express_budget,
            express_mid_step=s.express_mid_step,
            max_num_seqs=s.max_num_seqs or max_num_seqs,
            num_decoding=s.num_decoding,
            seq_limit_by_priority=list(s.seq_limit_by_priority) if any(s.seq_limit_by_priority) else None,
            num_decoding_by_priority=list(s.num_decoding_by_priority) if sum(s.num_decoding_by_priority) else None,
            num_running_by_priority=list(s.num_running_by_priority),
            num_waiting_by_priority=list(s.num_waiting_by_priority),
            num_prefill_tokens_by_priority=list(s.num_prefill_tokens_by_priority),
            mean_output_tokens=mean_output_tokens,
            policy=policy,
            running_slots=(None if (s.num_running or sum(s.num_running_by_priority)) and not s.running_slots
                           else [(p, g, left) for p, g, left in s.running_slots]),  # None: an engine that does not list them
        )

    @property
    def is_measured(self) -> bool:
        return self.step_time_base > 0.0 or self.step_time_per_token > 0.0

    @property
    def slot_hold_steps(self) -> float:
        """Steps a request admitted now holds its slot: a prefill step and the measured mean output."""
        return 1.0 + max(1.0, self.mean_output_tokens)

    def step_time(self, num_tokens: float, num_seqs: float = 0.0) -> float:
        """``StepTimeModel.predict`` on the terms the engine published."""
        return self.step_time_base + self.step_time_per_token * num_tokens + self.step_time_per_seq * num_seqs

    def copy(self) -> EngineLoad:
        """A copy whose queue counts (``add``) change apart from this one's."""
        return dataclasses.replace(self, num_waiting_by_priority=list(self.num_waiting_by_priority),
                                   num_prefill_tokens_by_priority=list(self.num_prefill_tokens_by_priority))  # fmt: skip

    def add(self, priority: int, num_prompt_tokens: int, sign: int = 1) -> None:
        """Count (or, ``sign=-1``, uncount) a queued request the stats do not show yet (or that is shed)."""
        self.num_waiting_by_priority[priority] = max(0, self.num_waiting_by_priority[priority] + sign)
        t = self.num_prefill_tokens_by_priority[priority] + sign * num_prompt_tokens
        self.num_prefill_tokens_by_priority[priority] = max(0, t)


def unloaded_ttft(load: EngineLoad, num_prompt_tokens: int) -> float:
    """An idle engine's TTFT for this prompt: its prefill chunks, one step each."""
    budget = max(1, load.max_num_batched_tokens)
    steps = max(1, math.ceil(num_prompt_tokens / budget))
    return steps * load.step_time(0, 1) + load.step_time_per_token * num_prompt_tokens


def express_request_seconds(load: EngineLoad, num_prompt_tokens: float, num_output_tokens: float) -> float:
    """Engine time of one P0 request with express steps: its prefill in a step of its own, then a decode row
    of a normal step for each token after the first (the admission's NOTE(express-share))."""
    prefill = load.step_time(0, 1) + load.step_time_per_token * num_prompt_tokens
    return prefill + max(0.0, num_output_tokens - 1.0) * (load.step_time_per_token + load.step_time_per_seq)


def _slot_classes(c: int) -> slice:
    """The classes whose slot holders count against class ``c``'s limit: P0 for P0; 1..c for the others,
    whose limit leaves P0's reserved slots out (NOTE(trunk-reservation))."""
    return slice(0 if c == 0 else 1, c + 1)


def _seq_limit(load: EngineLoad, c: int) -> int:
    """Running requests class ``c`` may be admitted up to: the engine's published limit, lowered by the P0s
    queued since the stats as the engine's reservation will be (NOTE(trunk-reservation))."""
    limit = load.max_num_seqs if load.seq_limit_by_priority is None else load.seq_limit_by_priority[c]
    p0 = load.num_running_by_priority[0] + load.num_waiting_by_priority[0]
    if c > 0 and p0 > 0:
        limit = min(limit, reserved_seq_limit(load.max_num_seqs, p0))
    return limit


def _slots_ahead(load: EngineLoad, c: int) -> int:
    """Waiting requests that take a slot before a new class-``c`` one.

    NOTE(wfq-slots): under ``wfq`` the queue hands out freed slots by the classes' weights (NOTE(served-only)
    in the request queue), so a class above goes first for ``w_k / w_c`` starts per start of this class (the
    new request included).  Under ``priority`` every one goes first; ``fcfs`` is taken as the same (a bound).
    """
    waiting = load.num_waiting_by_priority
    if load.policy != "wfq" or c == 0:
        return sum(waiting[_slot_classes(c)])
    own, wc = waiting[c], PRIORITY_WEIGHTS[Priority(c)]
    return own + sum(min(waiting[k], math.ceil((own + 1) * PRIORITY_WEIGHTS[Priority(k)] / wc)) for k in range(1, c))


def _slot_wait_steps(load: EngineLoad, c: int, limit: int, max_ahead: int = 4096) -> float:
    """Steps until a new class-``c`` request gets a slot: the slots' free times, simulated.

    NOTE(slot-turnover): each holder frees its slot after its expected remaining output (the mean output less
    what it made, at least one token, at most what ``max_tokens`` leaves; one past the mean is expected to run
    as long again); each request queued ahead then takes the earliest free slot for a prefill step and the
    mean output.  A burst that started together frees its slots together, which a mean turnover rate misses.
    """
    assert load.running_slots is not None
    mean = max(1.0, load.mean_output_tokens)
    times = []
    classes = range(3)[_slot_classes(c)]
    for p, generated, left in load.running_slots:
        if p in classes:
            expected = mean - generated if generated < mean else mean
            times.append(float(max(1.0, min(float(left), expected))))
    times.extend(0.0 for _ in range(limit - len(times)))
    heapq.heapify(times)
    for _ in range(len(times) - limit):  # over the limit (it fell): those slots do not come back
        heapq.heappop(times)
    ahead = _slots_ahead(load, c)
    hold = load.slot_hold_steps
    for _ in range(min(ahead, max_ahead)):
        heapq.heappush(times, heapq.heappop(times) + hold)
    start = heapq.heappop(times)
    if ahead > max_ahead:  # past the cap, the slots turn over at the mean rate
        start += (ahead - max_ahead) * hold / max(1, limit)
    return start


def _tokens_served_first(load: EngineLoad, priority: int, own: float) -> float:
    """Prefill tokens the engine computes until ``own`` more tokens of class ``priority`` are done."""
    backlog: Sequence[float] = load.num_prefill_tokens_by_priority
    if load.policy == "fcfs":
        return sum(backlog) + own
    if load.policy == "priority":
        return sum(backlog[:priority]) + own
    # GPS: while the class is backlogged, class k gets w_k / w_c of its service
    wc = PRIORITY_WEIGHTS[Priority(priority)]
    total = own
    for k, tokens in enumerate(backlog):
        if k != priority:
            total += min(float(tokens), own * PRIORITY_WEIGHTS[Priority(k)] / wc)
    return total


def predict_ttft(load: EngineLoad, priority: int, num_prompt_tokens: int,
                 later: Sequence[tuple[int, int]] | None = None) -> float:  # fmt: skip
    """Predicted seconds from now to the first token of a new request (0 until the engine is measured).

    ``later``: (requests, prompt tokens) per class from P0 on that arrive while it waits and go first as far
    as the policy lets them (the admission's NOTE(gps-arrivals)); the step in flight does not hold them.
    """
    if not load.is_measured:
        return 0.0
    running = sum(load.num_running_by_priority)
    current = load.step_time(min(load.max_num_batched_tokens, load.num_decoding + sum(load.num_prefill_tokens_by_priority)),
                             running)  # fmt: skip
    if later:
        load = load.copy()
        for k, (n, tokens) in enumerate(later):
            load.num_waiting_by_priority[k] += n
            load.num_prefill_tokens_by_priority[k] += tokens
    c = int(priority)
    own = float(load.num_prefill_tokens_by_priority[c] + num_prompt_tokens)
    # NOTE(lower-decodes): a lower class's decodes give their step tokens to this
    # class's prefill; only its own class's and higher ones' count against it
    by_class = load.num_decoding_by_priority
    decodes = load.num_decoding if by_class is None else sum(by_class[: c + 1])
    per_step = max(1.0, load.max_num_batched_tokens - decodes)
    if c == Priority.P0 and load.express_budget > 0:
        # NOTE(express-prediction): P0's prefills run in express steps (the engine's
        # NOTE(express-step)): no decodes, no other class's prefill, twice the budget;
        # between two of them the running decodes take a normal step
        steps = max(1, math.ceil(own / load.express_budget))
        prefill_bound = (steps * load.step_time(0, 1) + load.step_time_per_token * own
                         + (steps - 1) * load.step_time(load.num_decoding, load.num_decoding))  # fmt: skip
    else:
        served = _tokens_served_first(load, c, own)
        steps = max(1, math.ceil(served / per_step))
        # each prefill step carries the decodes and at least one prefilling sequence
        prefill_bound = steps * load.step_time(decodes, decodes + 1) + load.step_time_per_token * served
    # slots: running and queued requests of this class and higher ones come first
    classes = _slot_classes(c)
    holders = sum(load.num_running_by_priority[classes]) + _slots_ahead(load, c)
    limit = _seq_limit(load, c)
    short = holders + 1 - limit
    slot_bound = 0.0
    if short > 0:
        if load.running_slots is not None:
            wait_steps = _slot_wait_steps(load, c, limit)
        else:  # NOTE(slot-turnover), without the holders: one slot frees every mean_output_tokens / max_num_seqs steps
            decoding = max(1, min(load.max_num_seqs, load.max_num_batched_tokens))  # slots that decode each step
            wait_steps = short * max(1.0, load.mean_output_tokens) / decoding
        if wait_steps > 0.0:
            # the steps while it waits: every slot of its limit busy, P0's holders for as long as they hold, and
            # the prefill backlog of its class and the higher ones spread over them.  NOTE(hol-prefill): not the
            # lower classes' backlog: while a class waits for a slot the scheduler admits nobody below it
            # (its NOTE(hol)); counting it overpredicted these waits (docs/benchmarks.md, "TTFT prediction error")
            p0 = 0.0
            if c > 0:
                p0_holders = load.num_running_by_priority[0] + load.num_waiting_by_priority[0]
                p0 = p0_holders * min(1.0, load.slot_hold_steps / wait_steps)
            rows = min(float(load.max_num_seqs), limit + p0)
            prefill = min(per_step, sum(load.num_prefill_tokens_by_priority[: c + 1]) / wait_steps)
            step = load.step_time(min(float(load.max_num_batched_tokens), rows + prefill), rows)
            slot_bound = wait_steps * step + unloaded_ttft(load, num_prompt_tokens + decodes) + load.step_time_per_seq * decodes
    if c == Priority.P0 and load.express_budget > 0 and load.express_mid_step and slot_bound == 0.0:
        # NOTE(mid-step-express) in the engine: a P0 with a free slot does not wait for the running
        # step, only for the engine's next look at its input (between two layers)
        return prefill_bound + min(0.5 * current, MID_STEP_WAIT_S)
    return max(prefill_bound, slot_bound) + 0.5 * current
