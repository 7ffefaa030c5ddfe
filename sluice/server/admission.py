"""Admission control: predicted time to first token against the class's target, lowest class shed first (pure).

A request is *queued* from admission until its first output arrives (the engine has scheduled and
prefilled it).  ``admit`` decides at once, never by timing out:

1. Predicted wait (``sluice.server.slo``): from the engine's last stats, the
   requests sent since, and the measured step time, predict the new request's
   TTFT.  Over its class's target, the newest queued requests of strictly
   lower classes (for P1 only those queued a moment ago, NOTE(young-victims))
   are shed (lowest class first) if that brings it within target; otherwise the
   new request gets 429 with a ``Retry-After`` of the predicted excess, jittered.
   A class whose target is derived (``--slo`` not given for it) is held to it
   only while another class shares the engine (NOTE(lone-class)); every
   request is refused past the longest wait a client waits (``max_queue_wait``,
   code ``wait_too_long``).
2. A hard bound in requests (``max_queued_requests``) and tokens
   (``max_queued_tokens``: prompt + max_tokens), shed the same way: the
   last line of defence when the engine has not been measured yet.

NOTE(lone-class): a derived target (NOTE(auto-slo) in ``slo``) binds only
while another class is active beside the request's (for P1/P2 a higher class,
for P0 a lower one; active: queued here, in the engine, or admitted in the
last ``ACTIVE_WINDOW_S``).  Derived from an idle engine's TTFT, a lone class's
target protects nobody, and refusing a load the engine can work through turns
into resent requests from clients that do not back off (issue 57).  A class
alone is queued and served, and refused only past ``max_queue_wait`` (90 s:
past the 60 s at which common proxies give up, since a queued request whose
client leaves is aborted before it costs engine time) or by the hard bounds;
it then carries ``max_queue_wait`` to the engine as its target, so the engine
does not cap its steps for a 2-s target (NOTE(step-cap)).  In a mix the derived
targets order the classes as before, and P0 keeps the target its protection
at 3x load is measured on.  Targets given with ``--slo`` bind always.  The
runs behind this are in docs/benchmarks.md, "Closed loop on default flags".

NOTE(measured-ceiling): for a P1 or P2 request whose derived target does not
bind, the longest wait is judged on the class's queue as measured
(NOTE(class-drain): the oldest queued request's age, and the queue over its
drain rate), not on the model, which charges a wave of arrivals the prefill
of the whole backlog and overpredicts a locust ramp by up to 10x.  P0 (whose
queue drains in express steps) and explicit targets keep the model.

NOTE(shed-lowest-first): a P0 burst is never turned away while P2 work waits; shedding newest-first
keeps the oldest P2 requests' queueing investment.  Shedding is all or nothing: if shedding every
lower-class request would not make room, nobody is shed.

NOTE(young-victims): to make room for a P1 request by its prediction, only
lower-class requests queued less than ``SHED_MAX_AGE_S`` are shed: one that has
waited longer keeps its place (it is served, perhaps late), because a 429 after
seconds of queueing wastes the wait and comes too late for a retry elsewhere
(a shed request is answered within ~50 ms).  If the young ones do not make
room, the P1 request is refused at once.  A P0 request may still shed any
queued lower-class request (NOTE(shed-lowest-first)), as may the hard bound.

NOTE(higher-arrivals): the prediction counts what is queued now, but while a
request of class c waits, requests of higher classes keep arriving and are
served first: a lower-class request admitted on today's queue is later shed
from the queue (a slow 429) or misses its target.  So the prediction of class
c is divided by ``1 - rho``, where ``rho`` is the admitted arrival rate of the
classes above c over the engine's capacity: the wait of a preemptive priority
queue.  The capacity is the work the engine does per second of engine
work (time with requests in the engine, between its stats messages; all
exponentially weighted over ``RATE_WINDOW_S``), in requests, not the completion rate itself: on a
lightly loaded engine that only echoes the arrivals, and a P1 request after a few P0 ones would see
``rho`` = 1 on an idle engine.  NOTE(work-rate): the work is the tokens its
steps ran (prompt and generated; the nested express steps' too, where P0
prefills run mid-step), over a mean request's (its prompt plus its output); completions per busy second were the measure before, but a batch
that drains finishes requests whose work was done earlier: after a closed loop
of 128 ended, they counted 29 requests/s on an engine that did 13, and for the
first seconds of the surge that followed ``rho`` was half the truth.  The arrival rate is the larger of its 5-s
average and a 1-s one (``FAST_RATE_WINDOW_S``): a surge of higher-class
traffic counts within a second, not after five (a step from all-P2 traffic to
2x load admitted P2 requests for 2 s, and they all expired), while a fall is
remembered for five.  With ``rho`` near 1 the higher classes take
the whole engine and the request is refused at once.  P0 has nothing above it.

NOTE(express-share): with express steps (the engine's NOTE(express-step)) a
P0's prefill runs in a step of its own, outside the normal steps' token budget,
and P0's recent peak of slots is kept free for it (NOTE(trunk-reservation) in
the scheduler): P0 takes from a lower class's wait the engine time of those
steps and of its decode rows in the normal steps, ``step_time(0, 1) + b x
prompt`` and ``(b + c)`` a generated token after the first (the measured step
model), times its arrival rate.  Its share of the work rate, counted before,
overstates that where the steps are small: a step of a few rows is mostly its
fixed cost, so the engine does few tokens a second, and a P0 that only adds
rows to steps that run anyway reads as a large share.  With 4 slots, a
64-token budget and SmolLM2 (4.5 ms + 0.47 ms a token) most P1 requests, which
the queue alone predicted within 1-25%, were predicted 1.3-2x by a ``rho`` of
0.26-0.50 from P0 alone; by the express share it is 0.08-0.20
(docs/benchmarks.md, "TTFT prediction error").  P1 and P2 above a class still
count by their work share: they share the normal steps' budget and slots.

NOTE(surge-onset): a 1-s average still takes a second to see a surge: a
quarter second into a step from an idle engine to 5x load it showed a fifth of
the arrivals, and P1/P2 requests admitted then on a ``rho`` of 0.2-0.5 all
expired 10 s later (two in three of the slow 429s of a 5x step on a 2-core
EPYC).  So a request admitted while nothing is in flight (no request queued
here, none in the engine) starts a busy period: the 1-s averages restart from
zero, and until they have filled they are read as the mean rate since the
period began (divided by the weight they have filled), once the period is
``ONSET_MIN_S`` old.  Before that its arrivals are a burst, not yet a rate,
and are read as they are: reading a wave of 8 requests sent at once as 32 a
second (8 over a quarter second) stretched the predictions of the P2s in it
tenfold, on an engine that served them within a second.  A surge from load
already in flight is seen by the 1-s average as before.

NOTE(refused-above): shedding goes lowest class first, so while a higher class is being refused for
its predicted wait (within ``REFUSED_ABOVE_S``), a lower-class request is refused too, whatever its
own prediction says: the higher classes alone fill the engine, and a lower-class request admitted in
a gap of the queue is pushed back behind them until it is overdue.

NOTE(overdue): the prediction is a mean; a lower-class request admitted on it
can still be pushed back by the higher classes' arrivals for far longer (P2
served after 30-60 s at 2-3x load, some past a client's 60 s timeout).  A
queued request of a class below P0 that has waited ``OVERDUE_FACTOR`` times its
class's target without a first token has missed its target for good; it is
shed (429, ``code: expired``, a jittered ``Retry-After``) rather than left to
take engine time from requests that can still make theirs, or to hang until
the client gives up.  P0 is never shed this way.  ``overdue`` sweeps the queue
at most every ``OVERDUE_SWEEP_S``.  A started request that a higher class
preempted and left without output is the server's to shed (NOTE(stalled) in
``serving``).

NOTE(class-drain): the prediction models the engine; what it cannot see is how
the engine's share actually falls to a class over time (the higher classes'
arrivals are only a mean, NOTE(higher-arrivals)).  At 2x load, with P0 and P1
taking the whole engine, P2 requests admitted on the model started at 0.5/s and
three in four of them expired after 10 s (slow 429s).  So each class below P0
also measures its own queue.  A new request starts behind the ones queued of
its class (FIFO within a class), so it waits at least as long as the oldest
of them has (the sojourn time, as in CoDel: it sees a starved class at once),
and at least ``(queued + 1) / drain``, the *drain rate* being first outputs per
second of time the class had requests queued (both exponentially weighted over
``RATE_WINDOW_S``; no start in the window counts as one; it counts once the class has been backlogged
``DRAIN_MIN_BACKLOG_S`` (``admission_rates``), weighted, so that a burst on an idle server is judged
by the model alone).  The prediction is the largest of the three.  P0 keeps the model only: its
express steps start the queued P0s together, which a per-request rate would overstate.

NOTE(p0-margin): P0's prediction is a model of the engine's express steps,
and it holds while they can take P0's prefills as they come.  Past that (at 5x
load P0 alone is about the engine's capacity, and express steps may take only
part of the engine's time) P0s queue behind normal steps the model does not
see: on a 2-core Sapphire Rapids at 5x, P0s admitted on it got their first
token at 0.3 s p99 against a 56 ms target, a third of them late, and each late
one took engine time from one that could have been on time.  So the
controller checks its P0 decisions: it keeps the share of admitted P0s whose
first token came past the target (exponentially weighted, ``P0_MISS_WEIGHT`` a
sample), and while that share is over ``P0_MISS_HIGH`` each P0 start multiplies
P0's predictions by ``P0_MARGIN_STEP`` (up to ``P0_MARGIN_MAX``); under
``P0_MISS_LOW`` each divides them back, down to 1.  The margin also fades back
to 1 with time (``P0_MARGIN_DECAY_S``): a margin that refuses every P0 gets no
more starts to learn from, and must not outlast the overload that set it.
Where P0 is within target (its misses a few in a hundred) the margin stays 1
and nothing changes.  At 5x on that machine P0 attainment went from 38-50% to 52-58%, and P0's TTFT
p99 from 0.30-0.58 s to 0.23-0.27 s; a tighter margin (5% / 2%) gained 4 more points at 5x but cost
about one at 3x (docs/benchmarks.md).

NOTE(retry-jitter): a shed wave told "retry in 2 s" comes back as one burst 2 s later and is shed
again.  ``Retry-After`` is the predicted excess wait times U(1, 1.5), plus U(0, 1) s, so retries
spread over the time the queue needs to drain.  The header is whole seconds rounded up, never less.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sluice.engine.protocol import EngineStats
from sluice.errors import OverloadedError
from sluice.server.admission_rates import RATE_WINDOW_S, ClassDrain, Rate
from sluice.server.slo import EngineLoad, SloTargets, predict_ttft, unloaded_ttft
from sluice.types import Priority

__all__ = ["AdmissionController", "Decision"]

_EWMA = 0.1  # weight of a new sample in the measured means
FAST_RATE_WINDOW_S = 1.0  # ... of the higher classes' arrival rate seen rising (NOTE(higher-arrivals))
ONSET_MIN_S = 0.25  # a busy period's arrivals count as a rate once it is this old (NOTE(surge-onset))
SHED_MAX_AGE_S = 0.02  # a queued request older than this is shed only for P0 or the hard bound (NOTE(young-victims))
OVERDUE_FACTOR = 2.0  # a queued P1/P2 request is shed after this many times its target (NOTE(overdue))
OVERDUE_SWEEP_S = 0.05  # the overdue sweep runs at most this often
REFUSED_ABOVE_S = 1.0  # a higher class refused this recently: a lower class is refused (NOTE(refused-above))
ACTIVE_WINDOW_S = RATE_WINDOW_S  # a class admitted this recently is active beside another (NOTE(lone-class))
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
        self._admitted_at = [float("-inf") for _ in Priority]  # last admission by class (NOTE(lone-class))
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
            # a P0's prefill in an express step of its own, then a decode row a token in the normal steps
            p0 = load.step_time(0, 1) + load.step_time_per_token * self.mean_prompt_tokens
            p0 += max(0.0, self.mean_output_tokens - 1.0) * (load.step_time_per_token + load.step_time_per_seq)
            shares[0] = lam[0] / observed * p0
        return shares, [x / observed for x in lam]

    def drain_wait(self, priority: int, load: EngineLoad | None = None) -> float:
        """A new request's wait behind its class's queue, measured (NOTE(class-drain)); 0 for P0.

        NOTE(idle-drain): the measured drain says how fast the class got its starts
        while higher classes took the engine.  With none of the class queued and no
        higher class running, waiting or queued (``load``), nothing is ahead of a new
        request and an old drain no longer applies: the model decides.  Without this,
        one stall (a request that waited 4 s while the engine started its profiler)
        left a backlog and no start, and every request of the class was refused for
        the ~4 s it took to decay, while the engine sat idle.
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

        NOTE(gps-arrivals): P0 goes before fairness (its tight targets make it
        behind at once, NOTE(behind-first) in the request queue; its express
        steps and reserved slots are its own), so its share of the engine
        stretches the wait as under strict priority (NOTE(higher-arrivals)).
        The classes between P0 and this one share with it by their WFQ
        weights: what they are sent while it waits joins their backlog, and
        the queue model lets them go first only up to their weight's share
        of this class's own work (prefill tokens, and slot starts for a
        class waiting for a slot: ``predict_ttft`` under ``wfq``).  So their
        arrivals over the predicted wait are added to the load, and the
        prediction is taken again until the wait settles (the shares cap it).
        Stretching by their share as well counted their backlog twice, once
        in the queue and once in the stretch: on the prediction protocol's
        waves P2 was predicted at 2-4x what it got once WFQ shared the slots.
        The arrivals pay the queue model's costs, though, where the stretch
        charges their measured share of the engine's work; while those classes
        are not backlogged their shares do not bind, and the queue model's
        slot costs (a slot limit it holds constant) overstated the wait by up
        to 1.5x.  So the prediction is the smaller of the two: the strict
        stretch bounds it (WFQ never gives a class less than strict priority
        does), the shares tighten it where they bind (docs/benchmarks.md, "TTFT
        prediction error").
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
        self._admitted_at[priority] = now
        self._drain[priority].add(key, now)
        self._admitted[priority].tick(now)
        self._admitted_fast[priority].tick(now)
        return Decision([e.key for e in victims], predicted, target)

    @property
    def is_idle(self) -> bool:
        """Nothing queued, and the engine's last stats showed no request in it (or none came yet)."""
        return not self._queued and (self._stats is None or not _has_work(self._stats))

    def is_active(self, priority: int, load: EngineLoad, now: float) -> bool:
        """Whether the class has requests queued here or in the engine, or was admitted in the last
        ``ACTIVE_WINDOW_S`` (NOTE(lone-class))."""
        return bool(load.num_running_by_priority[priority] or load.num_waiting_by_priority[priority]
                    or self._drain[priority].queued or now - self._admitted_at[priority] < ACTIVE_WINDOW_S)  # fmt: skip

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
