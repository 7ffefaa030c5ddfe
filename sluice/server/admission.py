"""Admission control: a request's predicted time to first token against its class's bound, lowest class
shed first (pure, clock-injected).  One ``AdmissionController`` per engine core; the API process holds
them in one ``LanedAdmission`` (``sluice.server.lanes``), one engine core or several.

A request is *queued* from admission until its first output arrives.  ``admit`` decides at once, never by
timing out: the prediction is the scheduler's model of itself (``sluice.engine.ttft_model``) on the
engine's last stats plus the requests sent since, stretched by what the admission measures (below).
Over the request's bound, the newest queued requests of strictly lower classes are shed if that brings
it within, else it gets 429 with a jittered ``Retry-After``.  Then the hard bounds in requests and tokens
(``max_queued_requests``, ``max_queued_tokens``), shed the same way.  The measurements behind each rule:
docs/design/overload.md and docs/benchmarks.md.

NOTE(lone-class): a derived target (NOTE(auto-slo) in ``slo``) binds only while another class is active
beside the request's (for P1/P2 a higher one, for P0 a lower one; active: queued, in the engine, or asking
(admitted or not) in the last ``ACTIVE_WINDOW_S``: a class whose every request is refused still has clients
waiting; counting admissions only, P0 at 5x looked alone, was held to the longest wait and queued for 5-6 s).
A lone class's derived target protects nobody, and refusing a load the engine can serve comes back as resent
requests (issue 57).  Alone, a class is refused only past
``max_queue_wait`` (code ``wait_too_long``) or the hard bounds, and carries that bound to the engine as
its target so the engine does not cap its rows for it (NOTE(row-cap)).  ``--slo`` targets always bind.

NOTE(measured-ceiling): for a P1/P2 whose derived target does not bind, the longest wait is judged on the
class's queue as measured (NOTE(class-drain)), not on the model, which charges a wave of arrivals the
prefill of the whole backlog.  P0 (drained by express steps) and explicit targets keep the model.

NOTE(shed-lowest-first): a P0 burst is never turned away while P2 work waits; newest first keeps the
oldest requests' queueing investment.  All or nothing: if shedding every candidate would not make room,
nobody is shed.  NOTE(young-victims): for a P1 only lower-class requests queued under ``SHED_MAX_AGE_S``
are candidates (a 429 after seconds of queueing wastes the wait); a P0 and the hard bounds shed any.

NOTE(higher-arrivals): while a request waits, higher classes keep arriving and go first, so its
prediction is divided by ``1 - rho``, rho being the higher classes' admitted rate over the engine's
capacity (the wait of a preemptive priority queue).  NOTE(work-rate): the capacity is the tokens the
engine's steps ran per second of busy time, over a mean request's tokens (completions per second
overstate it as a batch drains).  The rate is the larger of a 5-s and a 1-s average (a surge counts
within a second, a fall is remembered for five).  NOTE(express-share): with express steps, P0's share
is the engine time of its own steps and decode rows (``express_request_seconds``), not its share of the
token rate, which overstates it where steps are small.  NOTE(surge-onset): a request admitted on an
idle engine starts a busy period; its 1-s averages restart and count as a rate once ``ONSET_MIN_S`` old
(before that, a burst is read as it is, not as a rate).

NOTE(refused-above): while a higher class is refused for its predicted wait (within ``REFUSED_ABOVE_S``),
a lower class is refused too: the higher classes alone fill the engine, and a lower request admitted in
a gap would be pushed back until it is overdue.

NOTE(overdue): a queued P1/P2 without a first token after ``OVERDUE_FACTOR`` times the bound it was
admitted on has missed it for good: it is shed (429 ``expired``) rather than take engine time from
requests that can still make theirs, or hang until the client gives up.  P0 is never shed for its age.
A started request preempted and left without output: NOTE(stalled) in ``serving``.

NOTE(class-drain): what the model cannot see is how the engine's share actually falls to a class.  A
P1/P2 prediction is at least its class's oldest queued request's age (the sojourn time, as in CoDel)
and ``(queued + 1) / drain rate`` (first outputs per second of backlog, ``admission_rates``).  P0 keeps
the model: its express steps start queued P0s together.

NOTE(p0-margin): past the load where express steps take P0's prefills as they come, P0s queue behind
normal steps the model does not see.  While over ``P0_MISS_HIGH`` of admitted P0s miss their target,
each P0 start multiplies P0's predictions by ``P0_MARGIN_STEP`` (up to ``P0_MARGIN_MAX``); under
``P0_MISS_LOW`` each divides them back, and the margin fades to 1 over ``P0_MARGIN_DECAY_S`` (a margin
that refuses every P0 gets no starts to learn from).

NOTE(retry-jitter): a shed wave told "retry in 2 s" comes back as one burst.  ``Retry-After`` is the
predicted excess times U(1, 1.5), plus U(0, 1) s; whole seconds rounded up.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sluice.engine.protocol import EngineStats
from sluice.engine.ttft_model import (
    EngineLoad,
    express_request_seconds,
    predict_ttft,
    unloaded_ttft,
)
from sluice.errors import OverloadedError
from sluice.server.admission_rates import RATE_WINDOW_S, ClassDrain, Rate
from sluice.server.slo import SloTargets
from sluice.types import Priority

__all__ = ["AdmissionController", "Decision"]

_EWMA = 0.1  # weight of a new sample in the measured means
FAST_RATE_WINDOW_S = 1.0  # ... of the higher classes' arrival rate seen rising (NOTE(higher-arrivals))
ONSET_MIN_S = 0.25  # a busy period's arrivals count as a rate once it is this old (NOTE(surge-onset))
SHED_MAX_AGE_S = 0.02  # a queued request older than this is shed only for P0 or the hard bound (NOTE(young-victims))
OVERDUE_FACTOR = 2.0  # a queued P1/P2 request is shed after this many times its target (NOTE(overdue))
OVERDUE_SWEEP_S = 0.05  # the overdue sweep runs at most this often
REFUSED_ABOVE_S = 1.0  # a higher class refused this recently: a lower class is refused (NOTE(refused-above))
ACTIVE_WINDOW_S = RATE_WINDOW_S  # a class that asked this recently is active beside another (NOTE(lone-class))
EARLY_SHED_S = 0.25  # a class's last refusal, less the time since, refuses before parsing this long (NOTE(early-shed))
MAX_HIGHER_LOAD = 0.95  # rho is capped here: a wait 20x the prediction, past any target (NOTE(higher-arrivals))
GPS_ITERATIONS = 6  # predictions a wfq wait may take to settle (NOTE(gps-arrivals))
P0_MISS_WEIGHT = 0.02  # weight of one P0 start in the share of admitted P0s that missed (NOTE(p0-margin))
P0_MISS_HIGH = 0.10  # over this share of misses P0's predictions grow ...
P0_MISS_LOW = 0.04  # ... under this one they shrink back
P0_MARGIN_STEP = 1.01  # ... by this factor per P0 start
P0_MARGIN_MAX = 8.0  # ... between 1 and this
P0_MARGIN_DECAY_S = 5.0  # ... and fade back to 1 with this time constant


def _has_work(s: EngineStats) -> bool:
    """Whether the stats show a request in the engine: running, waiting or loading."""
    return s.num_running + s.num_waiting + s.num_loading > 0


@dataclass
class _Entry:
    key: str  # the HTTP request's id
    priority: Priority
    num_tokens: int  # prompt + max_tokens, all choices
    num_prompt_tokens: int  # prompt tokens to prefill, all choices
    seq: int  # admission order
    submitted_at: float  # clock time
    target: float | None = None  # the TTFT bound it was admitted on: its class's target or max_queue_wait
    # (None: no predicted-wait admission); overdue past OVERDUE_FACTOR x this


@dataclass(frozen=True)
class Decision:
    """One admitted request: what was shed for it, and the prediction it was admitted on."""

    shed: list[str]  # keys of queued lower-class requests shed to make room
    predicted_ttft: float | None = None  # seconds; None: no prediction (engine not measured, or SLO off)
    target: float | None = None  # seconds, the TTFT target it is held to (its class's; alone, max_queue_wait)
    lane: int = 0  # the engine core it goes to (NOTE(data-parallel) in sluice.server.lanes)


class AdmissionController:
    def __init__(
        self,
        max_queued_requests: int,
        max_queued_tokens: int,
        retry_after: float = 1.0,
        *,
        slo: SloTargets | None = None,  # None: no predicted-wait admission (bounded queue only)
        policy: str = "wfq",  # the engine's scheduling policy
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        max_queue_wait: float = 90.0,  # seconds: the longest predicted TTFT admitted (NOTE(lone-class))
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ):
        self.max_requests = max_queued_requests
        self.max_tokens = max_queued_tokens
        self.retry_after = retry_after
        self.slo = slo
        self.policy = policy
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_queue_wait = max_queue_wait
        self._clock = clock
        self._rng = rng or random.Random()
        self._queued: dict[str, _Entry] = {}
        self._num_tokens = 0
        self._seq = 0
        self._stats: EngineStats | None = None
        self._stats_at = float("-inf")
        self.mean_output_tokens = 16.0  # measured: generated tokens per finished request (16: a guess)
        self._num_finished = 0
        self.mean_prompt_tokens = 32.0  # measured: prompt tokens per admitted request
        self._admitted = [Rate() for _ in Priority]  # admitted requests/s by class
        self._admitted_fast = [Rate(FAST_RATE_WINDOW_S) for _ in Priority]  # ... seen rising (NOTE(higher-arrivals))
        self._tokens = Rate()  # tokens the engine's steps ran per second (NOTE(work-rate))
        self._busy = Rate()  # seconds with work in the engine, per second
        self._busy_since: float | None = None  # the first stats: when the busy rate started counting
        self._fast_since = float("-inf")  # the 1-s averages restarted here: a busy period's start (NOTE(surge-onset))
        self._swept_at = float("-inf")
        self._refused_at = [float("-inf") for _ in Priority]  # last refusal by predicted wait, by class
        self._floor = [0.0 for _ in Priority]  # ... and that refusal's 1-token best case (NOTE(early-shed))
        self._floor_by_ceiling = [False for _ in Priority]  # ... against max_queue_wait, not the target
        self._asked_at = [float("-inf") for _ in Priority]  # last request by class, admitted or not (NOTE(lone-class))
        self._drain = [ClassDrain() for _ in Priority]  # NOTE(class-drain)
        self.p0_miss_share = 0.0  # admitted P0s past their target, exponentially weighted (NOTE(p0-margin))
        self._p0_margin = (1.0, 0.0)  # ... the factor on P0's predictions it set, and when

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_queued_tokens(self) -> int:
        return self._num_tokens

    def num_queued_of(self, priority: Priority) -> int:
        """Queued requests of one class (a P0 here waits for its first output)."""
        return sum(1 for e in self._queued.values() if e.priority == priority)

    # ------------------------------------------------------------ measurements

    def observe_stats(self, stats: EngineStats) -> None:
        prev, now = self._stats, self._clock()
        if self._busy_since is None:
            self._busy_since = now
        if prev is not None and _has_work(prev):
            # the engine had work all the time since the last stats (steps, and what it does between them)
            self._busy.tick(now, min(now - self._stats_at, RATE_WINDOW_S))
        if prev is not None and stats.num_batched_tokens_total > prev.num_batched_tokens_total:
            self._tokens.tick(now, stats.num_batched_tokens_total - prev.num_batched_tokens_total)
        self._stats = stats
        self._stats_at = now

    def observe_output_tokens(self, num_generated: int) -> None:
        if self._num_finished == 0:  # the first measurement replaces the guess
            self.mean_output_tokens = float(num_generated)
        self._num_finished += 1
        self.mean_output_tokens += _EWMA * (num_generated - self.mean_output_tokens)

    def higher_load(self, priority: int, load: EngineLoad | None = None) -> float:
        """``rho`` of NOTE(higher-arrivals): the classes above ``priority``'s admitted rate over the
        engine's capacity, requests' worth of work done per second with work in the engine
        (NOTE(work-rate); 0 while unmeasured), at most ``MAX_HIGHER_LOAD``.  With express steps in
        ``load``, P0's share is the engine time its own steps take instead (NOTE(express-share))."""
        return min(MAX_HIGHER_LOAD, sum(self._higher_shares(priority, load)[0]))

    def _higher_shares(self, priority: int, load: EngineLoad | None) -> tuple[list[float], list[float]]:
        """The classes above ``priority``: each one's share of the engine (``higher_load`` sums them)
        and its admitted arrival rate in requests a second; empty while unmeasured."""
        now = self._clock()
        busy = self._busy.read(now)
        # a request's work: its prompt's prefill and a decode for each generated token after the first
        done = self._tokens.read(now) / max(1.0, self.mean_prompt_tokens + self.mean_output_tokens - 1.0)
        if done <= 0.0 or busy <= 0.0 or self._busy_since is None or priority == Priority.P0:
            return [], []
        # the share of each average's weight the time since the first stats covers: the 5-s averages
        # (done, busy, the arrivals) start low together; the 1-s one fills five times faster
        age = max(0.0, now - self._busy_since)
        observed = 1.0 - math.exp(-age / RATE_WINDOW_S)
        if observed <= 0.0:
            return [], []
        # ... or since a busy period began, NOTE(surge-onset)
        if self._fast_since <= self._busy_since:
            observed_fast = 1.0 - math.exp(-age / FAST_RATE_WINDOW_S)
        elif (onset_age := now - self._fast_since) >= ONSET_MIN_S:
            observed_fast = 1.0 - math.exp(-onset_age / FAST_RATE_WINDOW_S)
        else:  # a busy period this young: its arrivals are a burst, not yet a rate
            observed_fast = 1.0
        lam = [max(self._admitted[k].read(now), self._admitted_fast[k].read(now) * observed / observed_fast)
               for k in range(int(priority))]  # fmt: skip
        utilization = min(1.0, busy / observed)  # the busy fraction: busy seconds over the seconds observed
        shares = [x / done * utilization for x in lam]
        if load is not None and load.express_budget > 0:  # NOTE(express-share)
            p0 = express_request_seconds(load, self.mean_prompt_tokens, self.mean_output_tokens)
            shares[0] = lam[0] / observed * p0
        return shares, [x / observed for x in lam]

    def drain_wait(self, priority: int, load: EngineLoad | None = None) -> float:
        """A new request's wait behind its class's queue, measured (NOTE(class-drain)); 0 for P0.

        NOTE(idle-drain): with none of the class queued and no higher class running, waiting or queued
        (``load``), nothing is ahead of a new request and an old drain rate no longer applies: the model
        decides (one stall once left a class refused for seconds on an idle engine).
        """
        if priority == Priority.P0:
            return 0.0
        drain = self._drain[priority]
        if load is not None and not drain.queued and not self._higher_busy(load, priority):
            return 0.0
        return drain.wait(self._clock())

    def _higher_busy(self, load: EngineLoad, priority: int) -> bool:
        """Whether a class above ``priority`` has requests in the engine or queued here."""
        return any(load.num_running_by_priority[c] or load.num_waiting_by_priority[c] or self._drain[c].queued
                   for c in range(priority))  # fmt: skip

    def predict(self, load: EngineLoad, priority: int, num_prompt_tokens: int) -> float:
        """Predicted TTFT of a new request: the queue now (``predict_ttft``), stretched by the
        higher classes' arrivals while it waits (NOTE(higher-arrivals)), and no less than its
        class's queue takes to drain (NOTE(class-drain))."""
        if self.policy == "wfq" and priority > Priority.P1:
            model = self._predict_gps(load, priority, num_prompt_tokens)
        else:
            model = predict_ttft(load, priority, num_prompt_tokens) / (1.0 - self.higher_load(priority, load))
        if priority == Priority.P0:
            model *= self.p0_margin  # NOTE(p0-margin)
        return max(model, self.drain_wait(priority, load))

    def _predict_gps(self, load: EngineLoad, priority: int, num_prompt_tokens: int) -> float:
        """``predict``'s model for a class with a class other than P0 above it, under ``wfq``.

        NOTE(gps-arrivals): P0 goes before fairness (NOTE(behind-first) in the request queue), so its share
        stretches the wait as under strict priority (NOTE(higher-arrivals)).  The classes between share by
        their WFQ weights: their arrivals over the predicted wait join the load, which lets them go first
        only up to their weight's share (``predict_ttft`` under ``wfq``), and the prediction is taken again
        until it settles; stretching by their share as well counted their backlog twice.  The strict
        stretch bounds the result (WFQ never gives a class less than strict priority does).
        """
        shares, rates = self._higher_shares(priority, load)
        base = predict_ttft(load, priority, num_prompt_tokens)
        if not rates:  # unmeasured: the queue alone
            return base
        strict = base / (1.0 - min(MAX_HIGHER_LOAD, sum(shares)))  # higher_load's
        stretch = 1.0 / (1.0 - min(MAX_HIGHER_LOAD, shares[0]))
        wait = base * stretch
        added = [0] * len(rates)
        for _ in range(GPS_ITERATIONS):
            more = [0, *(round(r * wait) for r in rates[1:])]  # P0's arrivals are in the stretch
            if more == added:
                break
            later = [(n, round(n * self.mean_prompt_tokens)) for n in more]
            added, wait = more, predict_ttft(load, priority, num_prompt_tokens, later) * stretch
            if wait >= strict:
                break
        return min(wait, strict)

    def load(self) -> EngineLoad:
        """The engine's last stats plus the queued requests sent after them."""
        s = self._stats or EngineStats()
        load = EngineLoad.from_stats(
            s,
            policy=self.policy,
            mean_output_tokens=self.mean_output_tokens,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
        )
        for e in self._queued.values():
            if e.submitted_at >= self._stats_at:
                load.add(e.priority, e.num_prompt_tokens)
        return load

    def target(self, priority: Priority, num_prompt_tokens: int, load: EngineLoad | None = None) -> float | None:
        if self.slo is None:
            return None
        return self.slo.target(priority, unloaded_ttft(load or self.load(), num_prompt_tokens))

    def signal(self) -> list[tuple[float, float]]:
        """(predicted TTFT, target) per class for a request of the mean prompt length: the gateway's signal."""
        load = self.load()
        n = max(1, round(self.mean_prompt_tokens))
        out = []
        for p in Priority:
            target = self.target(p, n, load)
            out.append((self.predict(load, p, n), 0.0 if target is None else target))
        return out

    def jittered(self, seconds: float) -> float:
        """A Retry-After for a predicted excess wait of ``seconds`` (NOTE(retry-jitter))."""
        base = max(self.retry_after, seconds)
        return base * self._rng.uniform(1.0, 1.5) + self._rng.uniform(0.0, 1.0)

    # ------------------------------------------------------------ decisions

    def admit(self, key: str, priority: Priority, num_tokens: int, num_prompt_tokens: int | None = None,
              prompts: Sequence[Sequence[int]] = ()) -> Decision:
        """Admit ``key`` or raise ``OverloadedError``; the decision names the keys shed to make room
        (``prompts``, the token ids, only the lanes' choice reads: NOTE(lane-prefix) in sluice.server.lanes)."""
        self._asked_at[priority] = self._clock()
        if num_tokens > self.max_tokens:
            raise OverloadedError(
                f"request needs {num_tokens} queued tokens, over the server's limit of "
                f"{self.max_tokens} (--max-queued-tokens)",
                retry_after=self.jittered(self.retry_after),
                code="queue_full",
            )
        lower = sorted(  # shed candidates: strictly lower classes, lowest class first, newest first
            (e for e in self._queued.values() if e.priority > priority),
            key=lambda e: (-int(e.priority), -e.seq),
        )
        victims: list[_Entry] = []
        n, t = len(self._queued), self._num_tokens
        for e in lower:
            if n + 1 <= self.max_requests and t + num_tokens <= self.max_tokens:
                break
            victims.append(e)
            n, t = n - 1, t - e.num_tokens
        if n + 1 > self.max_requests or t + num_tokens > self.max_tokens:
            raise OverloadedError(
                f"server overloaded: {len(self._queued)} requests / {self._num_tokens} tokens "
                f"queued (limits {self.max_requests} / {self.max_tokens}); retry later",
                retry_after=self.jittered(self.retry_after),
                code="queue_full",
            )
        predicted = target = None
        prompt = num_tokens if num_prompt_tokens is None else num_prompt_tokens
        if self._seq == 0:  # the first measurement replaces the guess
            self.mean_prompt_tokens = float(prompt)
        self.mean_prompt_tokens += _EWMA * (prompt - self.mean_prompt_tokens)
        load = self.load()
        now = self._clock()
        if self.is_idle:  # a busy period starts (NOTE(surge-onset))
            self._admitted_fast = [Rate(FAST_RATE_WINDOW_S) for _ in Priority]
            self._fast_since = now
        bound = None
        if self.slo is not None and load.is_measured:
            alone = not any(self.is_active(k, load, now) for k in Priority if k != priority)
            victims, predicted, target, bound = self._predicted_wait(load, priority, prompt, victims, lower)
            if alone and self.slo.seconds[priority] is None:  # NOTE(lone-class): the engine gets the bound
                target = bound
        for e in victims:
            self.remove(e.key)
        self._seq += 1
        self._queued[key] = _Entry(key, priority, num_tokens, prompt, self._seq, now, bound)
        self._num_tokens += num_tokens
        self._drain[priority].add(key, now)
        self._admitted[priority].tick(now)
        self._admitted_fast[priority].tick(now)
        return Decision([e.key for e in victims], predicted, target)

    @property
    def is_idle(self) -> bool:
        """Nothing queued, and the engine's last stats showed no request in it (or none came yet)."""
        return not self._queued and (self._stats is None or not _has_work(self._stats))

    def is_active(self, priority: int, load: EngineLoad, now: float) -> bool:
        """Whether the class has requests queued here or in the engine, or asked (admitted or not) in the last
        ``ACTIVE_WINDOW_S`` (NOTE(lone-class))."""
        return bool(load.num_running_by_priority[priority] or load.num_waiting_by_priority[priority]
                    or self._drain[priority].queued or now - self._asked_at[priority] < ACTIVE_WINDOW_S)  # fmt: skip

    def target_binds(self, priority: Priority, load: EngineLoad, now: float) -> bool:
        """Whether a request of the class is refused past its class's target, or only past ``max_queue_wait``:
        a target given with ``--slo`` always binds, a derived one while another class is active beside it
        (above it, or below P0: NOTE(lone-class))."""
        if self.slo is None:
            return False
        if self.slo.seconds[priority] is not None:
            return True
        others = range(1, len(Priority)) if priority == Priority.P0 else range(int(priority))
        return any(self.is_active(k, load, now) for k in others)

    def _predicted_wait(
        self, load: EngineLoad, priority: Priority, prompt: int, victims: list[_Entry], lower: list[_Entry]
    ) -> tuple[list[_Entry], float, float, float]:
        """(victims, predicted TTFT, the class's target, the bound it was admitted on), or ``OverloadedError``."""
        target = self.target(priority, prompt, load)
        assert target is not None
        now = self._clock()
        refused = self._refused_above(priority, now)
        if refused is not None:
            raise refused
        binds = self.target_binds(priority, load, now)
        bound = min(target, self.max_queue_wait) if binds else self.max_queue_wait
        for e in victims:
            load.add(e.priority, e.num_prompt_tokens, -1)
        predicted = self.predict(load, priority, prompt)
        if not binds and priority != Priority.P0:  # NOTE(measured-ceiling): the class's queue, measured
            waited = self.drain_wait(priority, load)
            if waited <= bound:
                return victims, predicted, target, bound
            self._refused_at[priority] = now
            self._floor[priority], self._floor_by_ceiling[priority] = waited, True  # NOTE(early-shed)
            raise OverloadedError(
                f"requests of the class have waited {waited:.2f} s for a first token, over the server's longest "
                f"wait of {bound:.0f} s (--max-queue-wait); retry later",
                retry_after=self.jittered(waited - bound),
                code="wait_too_long",
            )
        if predicted <= bound:
            return victims, predicted, target, bound
        rest = [e for e in lower if e not in victims
                and (priority == Priority.P0 or now - e.submitted_at <= SHED_MAX_AGE_S)]  # NOTE(young-victims)
        best = load.copy()
        for e in rest:
            best.add(e.priority, e.num_prompt_tokens, -1)
        best_case = self.predict(best, priority, prompt)
        if best_case > bound:
            self._refused_at[priority] = now
            by_ceiling = bound < target or not binds
            if priority != Priority.P0:  # NOTE(early-shed): what any prompt of the class is predicted at least
                self._floor[priority] = best_case if prompt <= 1 else self.predict(best, priority, 1)
                self._floor_by_ceiling[priority] = by_ceiling
            if by_ceiling:
                raise OverloadedError(
                    f"predicted time to first token {predicted:.2f} s is over the server's longest wait "
                    f"of {bound:.0f} s (--max-queue-wait); retry later",
                    retry_after=self.jittered(best_case - bound),
                    code="wait_too_long",
                )
            raise OverloadedError(
                f"predicted time to first token {predicted:.2f} s is over the {priority.label} target "
                f"of {target:.2f} s; retry later",
                retry_after=self.jittered(best_case - target),
                code="slo_unattainable",
            )
        for e in rest:  # shed just enough, lowest class and newest first
            victims = [*victims, e]
            load.add(e.priority, e.num_prompt_tokens, -1)
            predicted = self.predict(load, priority, prompt)
            if predicted <= bound:
                break
        return victims, predicted, target, bound

    def refuse_early(self, priority: Priority, max_prompt_tokens: int | None = None) -> OverloadedError | None:
        """The refusal a ``priority`` request of at most ``max_prompt_tokens`` prompt tokens (None: any number)
        gets before it is parsed, or None: parse it and admit it as usual.  The rules: NOTE(early-shed) in
        sluice.server.early_shed."""
        now = self._clock()
        self._asked_at[priority] = now
        refused = self._refused_above(priority, now)
        if refused is not None or max_prompt_tokens is None or not self.has_floor(priority):
            return refused
        floor = self._floor[priority] - (now - self._refused_at[priority])
        if self._floor_by_ceiling[priority]:  # refused past max_queue_wait (NOTE(lone-class))
            if floor <= self.max_queue_wait:
                return None
            why = f"predicted time to first token of at least {floor:.2f} s is over the server's longest wait"
            return OverloadedError(f"{why} of {self.max_queue_wait:.0f} s (--max-queue-wait); retry later",
                                   retry_after=self.jittered(floor - self.max_queue_wait), code="wait_too_long")
        target = self.target(priority, max_prompt_tokens)
        if target is None or floor <= target:
            return None
        why = f"predicted time to first token of at least {floor:.2f} s is over the {priority.label} target"
        return OverloadedError(f"{why} of {target:.2f} s; retry later", retry_after=self.jittered(floor - target),
                               code="slo_unattainable")  # fmt: skip

    def has_floor(self, priority: Priority) -> bool:
        """A refusal of the class by predicted wait in the last ``EARLY_SHED_S`` may refuse it early (NOTE(early-shed))."""
        return priority != Priority.P0 and self._clock() - self._refused_at[priority] < EARLY_SHED_S

    def _refused_above(self, priority: Priority, now: float) -> OverloadedError | None:
        """NOTE(refused-above): a higher class was refused for its predicted wait in the last ``REFUSED_ABOVE_S``."""
        above = [p for p in Priority if p < priority and now - self._refused_at[p] < REFUSED_ABOVE_S]
        if not above:
            return None
        why = f"{above[-1].label} requests are being refused for their predicted wait"
        return OverloadedError(f"{why}; a {priority.label} request is refused with them; retry later",
                               retry_after=self.jittered(self.retry_after), code="slo_unattainable")  # fmt: skip

    def overdue(self) -> list[str]:
        """Remove and return the queued requests below P0 that waited ``OVERDUE_FACTOR`` times their
        target (NOTE(overdue)); the caller answers them with 429."""
        now = self._clock()
        if now - self._swept_at < OVERDUE_SWEEP_S:
            return []
        self._swept_at = now
        keys = [e.key for e in self._queued.values() if e.priority != Priority.P0 and e.target is not None
                and now - e.submitted_at > OVERDUE_FACTOR * e.target]  # fmt: skip
        for k in keys:
            self.remove(k)
        return keys

    def started(self, key: str) -> None:
        """The request's first output arrived: it leaves the queue, and counts in its class's drain
        rate (NOTE(class-drain))."""
        e = self._queued.get(key)
        if e is not None:
            now = self._clock()
            self._drain[e.priority].starts.tick(now)
            if e.priority == Priority.P0 and e.target is not None:
                self._check_p0(now - e.submitted_at > e.target, now)
        self.remove(key)

    @property
    def p0_margin(self) -> float:
        """The factor on P0's predictions now (NOTE(p0-margin)): as last set, faded towards 1 since."""
        return self._p0_margin_at(self._clock())

    def _p0_margin_at(self, now: float) -> float:
        margin, at = self._p0_margin
        return 1.0 + (margin - 1.0) * math.exp(-max(0.0, now - at) / P0_MARGIN_DECAY_S)

    def _check_p0(self, missed: bool, now: float) -> None:
        """One admitted P0's first token at ``now``, on time or not: the margin on P0's predictions (NOTE(p0-margin))."""
        self.p0_miss_share += P0_MISS_WEIGHT * (float(missed) - self.p0_miss_share)
        margin = self._p0_margin_at(now)
        if self.p0_miss_share > P0_MISS_HIGH:
            margin = min(P0_MARGIN_MAX, margin * P0_MARGIN_STEP)
        elif self.p0_miss_share < P0_MISS_LOW:
            margin = max(1.0, margin / P0_MARGIN_STEP)
        self._p0_margin = (margin, now)

    def remove(self, key: str) -> None:
        """The request finished, failed, was shed or went away (or started: ``started``)."""
        e = self._queued.pop(key, None)
        if e is not None:
            self._num_tokens -= e.num_tokens
            self._drain[e.priority].remove(key, self._clock())
