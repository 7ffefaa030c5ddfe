"""Graded degradation: as a model's load rises, serve less, then cheaper, then fewer.

    level 0  NORMAL      nothing changes
    level 1  CAP_TOKENS  max_tokens capped for p2, then p1: max(16, max_tokens * (1 - min(0.8, load)))
    level 2  FALLBACK    p1/p2 go to the model's lighter fallback version; p0 keeps the primary
    level 3  SHED        429 + Retry-After: p2 first, then p1; p0 only when both are shed too

The load of a model is one score, 1.0 = "at capacity" (``Pressure``).  With
sluice replicas it is their *predicted-wait signal*: each replica exports, per
class, the TTFT it predicts for a new request and the class's target
(``sluice_predicted_ttft_seconds`` / ``sluice_slo_ttft_target_seconds``); the
ratio at the replica where a new request would go (the lowest) is the class's
pressure, and the worst class's is the score.  So the gateway acts on what is
about to happen, before measured TTFTs go bad: level 1 from half the target,
level 2 from 0.8 of it, level 3 when the replicas would refuse the request
anyway (``slo_enter``).  At level 3 a class is shed while its own predicted
TTFT is over target and every lower class is shed too, so p0 is never shed
while a lower class is admitted.

Replicas that export no prediction (vLLM, any OpenAI server) fall back to the
worst of three measured ratios: waiting requests vs ``queue_per_replica`` x
routable replicas, in-flight tokens vs ``tokens_per_replica`` x routable
replicas, and p95 time to first token vs the contract's ``ttft_target_s``
(thresholds ``enter`` / ``exit``).

Levels move one step at a time with hysteresis (``step_level``, pure): up to
level k+1 once the score has stayed >= ``enter[k]`` for ``rise_s[k]``, down from
level k once it has stayed < ``exit[k-1]`` for ``fall_s``.  ``exit < enter``, so a
score hovering at a threshold does not flap.  Level 1 reacts in about a second,
levels 2 and 3 after tens of seconds of sustained overload.

``make_degradation(config)`` builds the policy (``graded`` or ``off``); the
gateway asks it for a ``Plan`` per request and feeds it the pool's load figures.
"""

from __future__ import annotations

import abc
import enum
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice.gateway.config import DegradationConfig, DegradationPolicyName
from sluice.gateway.pool import ModelLoad
from sluice.types import Priority

__all__ = [
    "DegradationLevel",
    "Pressure",
    "LevelState",
    "LevelChange",
    "Plan",
    "pressure",
    "step_level",
    "cap_max_tokens",
    "should_shed",
    "DegradationPolicy",
    "GradedDegradation",
    "NoDegradation",
    "make_degradation",
]

log = logging.getLogger("sluice.gateway.degradation")


class DegradationLevel(enum.IntEnum):
    NORMAL = 0
    CAP_TOKENS = 1
    FALLBACK = 2
    SHED = 3


@dataclass(frozen=True)
class Pressure:
    """Load of one model as ratios to capacity (1.0 = full)."""

    queue: float  # waiting requests / (queue_per_replica * routable replicas)
    tokens: float  # in-flight tokens / (tokens_per_replica * routable replicas)
    ttft: float  # p95 TTFT / ttft_target_s (0 with no samples)
    # predicted TTFT / target per class p0..p2 at the best replica; None: no replica exports the signal
    predicted: tuple[float, float, float] | None = None
    # seconds a new request of each class is predicted to wait past its target (0: within it)
    excess_s: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def is_predicted(self) -> bool:
        return self.predicted is not None

    @property
    def score(self) -> float:
        if self.predicted is not None:
            return max(self.predicted)
        return max(self.queue, self.tokens, self.ttft)

    def ratio(self, priority: Priority) -> float:
        """The class's own pressure (the score when replicas give no per-class prediction)."""
        return self.score if self.predicted is None else self.predicted[priority]

    def describe(self) -> str:
        if self.predicted is not None:
            per = ", ".join(f"p{c} {r:.2f}" for c, r in enumerate(self.predicted))
            return f"score {self.score:.2f} (predicted TTFT / target: {per})"
        return f"score {self.score:.2f} (queue {self.queue:.2f}, tokens {self.tokens:.2f}, ttft {self.ttft:.2f})"


def pressure(load: ModelLoad, config: DegradationConfig, p95_ttft_s: float | None = None) -> Pressure:
    """The pressure of a model from the pool's load figures (pure).

    ``p95_ttft_s`` overrides the pool's (longer-window) p95 when given.
    """
    # NOTE(no-replica): with nothing routable the capacity of one replica is the
    # denominator; the 503 path, not degradation, handles a model with no replica.
    n = max(1, load.num_routable)
    ttft = p95_ttft_s if p95_ttft_s is not None else load.p95_ttft_s
    predicted = excess = None
    if load.slo_by_priority is not None:
        slo = load.slo_by_priority
        predicted = tuple(pred / target if target > 0 else 0.0 for pred, target in slo)
        excess = tuple(max(0.0, pred - target) if target > 0 else 0.0 for pred, target in slo)
    return Pressure(
        queue=load.num_waiting / (config.queue_per_replica * n),
        tokens=load.inflight_tokens / (config.tokens_per_replica * n),
        ttft=(ttft or 0.0) / config.ttft_target_s,
        predicted=predicted,  # type: ignore[arg-type]
        excess_s=excess or (0.0, 0.0, 0.0),  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class LevelState:
    level: DegradationLevel = DegradationLevel.NORMAL
    changed_at: float = -math.inf  # clock time of the last level change
    above_since: float | None = None  # score >= enter[level] (next level's threshold) since
    below_since: float | None = None  # score < exit[level - 1] (this level's exit) since


@dataclass(frozen=True)
class LevelChange:
    model: str
    old: DegradationLevel
    new: DegradationLevel
    score: float
    reason: str
    at: float  # clock time


def step_level(
    state: LevelState, score: float, now: float, config: DegradationConfig, *, is_predicted: bool = False
) -> LevelState:
    """The next level state for one load reading (pure, one level per call at most).

    ``is_predicted``: the score is the replicas' predicted-wait ratio (thresholds ``slo_enter`` / ``slo_exit``).
    """
    enter, exit_ = (config.slo_enter, config.slo_exit) if is_predicted else (config.enter, config.exit)
    level = state.level
    above_since = state.above_since
    below_since = state.below_since
    if level < DegradationLevel.SHED and score >= enter[level]:
        above_since = now if above_since is None else above_since
        if now - above_since >= config.rise_s[level]:
            return LevelState(DegradationLevel(level + 1), now, None, None)
    else:
        above_since = None
    if level > DegradationLevel.NORMAL and score < exit_[level - 1]:
        below_since = now if below_since is None else below_since
        if now - below_since >= config.fall_s:
            return LevelState(DegradationLevel(level - 1), now, None, None)
    else:
        below_since = None
    return LevelState(level, state.changed_at, above_since, below_since)


def cap_max_tokens(max_tokens: int, load: float, config: DegradationConfig) -> int:
    """Level 1's cap: ``max(16, max_tokens * (1 - min(0.8, load)))``, never above the request."""
    capped = max(config.min_max_tokens, int(max_tokens * (1.0 - min(config.max_cut, max(0.0, load)))))
    return min(max_tokens, capped)


def should_shed(
    level: DegradationLevel,
    priority: Priority,
    score: float,
    num_inflight_by_priority: dict[Priority, int],
    config: DegradationConfig,
    predicted: tuple[float, float, float] | None = None,
) -> bool:
    """Level 3's admission (pure): p2 first, then p1, p0 last.

    With the predicted-wait signal a class is shed while its own predicted TTFT
    is at least ``slo_enter[2]`` x its target *and every lower class is shed
    too*; without it, p1 from ``shed_p1_score`` and p0 from ``shed_p0_score``.
    """
    if level < DegradationLevel.SHED:
        return False
    if predicted is not None:
        # NOTE(p0-last): monotone by construction: shedding class c needs every
        # class below it shed, so p0 is never shed while p1 or p2 is admitted.
        return all(predicted[k] >= config.slo_enter[2] for k in range(int(priority), len(predicted)))
    if priority is Priority.P2:
        return True
    if priority is Priority.P1:
        return score >= config.shed_p1_score
    # NOTE(p0-last): p0 is shed only when the model is far past capacity and no
    # lower class is left to make room by shedding.
    others = num_inflight_by_priority.get(Priority.P1, 0) + num_inflight_by_priority.get(Priority.P2, 0)
    return score >= config.shed_p0_score and others == 0


@dataclass(frozen=True)
class Plan:
    """What degradation does to one request."""

    level: DegradationLevel
    max_tokens: int | None = None  # new max_tokens to send upstream; None: unchanged
    use_fallback: bool = False  # route to the model's fallback version
    shed: bool = False  # answer 429 now
    retry_after_s: float = 0.0  # with ``shed``


class DegradationPolicy(abc.ABC):
    """Per-model degradation state; one instance per gateway."""

    name: DegradationPolicyName

    @abc.abstractmethod
    def observe(self, model: str, load: ModelLoad, p95_ttft_s: float | None) -> LevelChange | None:
        """Feed one load reading; returns the level change it caused, if any."""

    @abc.abstractmethod
    def level(self, model: str) -> DegradationLevel: ...

    def is_observation_due(self, model: str) -> bool:
        """Should the caller read the model's load and ``observe`` it now?"""
        return False

    @abc.abstractmethod
    def plan(self, model: str, priority: Priority, max_tokens: int | None, has_fallback: bool) -> Plan: ...

    def add_request(self, model: str, priority: Priority) -> None:  # noqa: B027 - optional hook
        pass

    def finish_request(self, model: str, priority: Priority) -> None:  # noqa: B027 - optional hook
        pass


class NoDegradation(DegradationPolicy):
    name = DegradationPolicyName.OFF

    def observe(self, model: str, load: ModelLoad, p95_ttft_s: float | None) -> LevelChange | None:
        return None

    def level(self, model: str) -> DegradationLevel:
        return DegradationLevel.NORMAL

    def plan(self, model: str, priority: Priority, max_tokens: int | None, has_fallback: bool) -> Plan:
        return Plan(DegradationLevel.NORMAL)


@dataclass
class _ModelState:
    state: LevelState = field(default_factory=LevelState)
    pressure: Pressure = field(default_factory=lambda: Pressure(0.0, 0.0, 0.0))
    observed_at: float = -math.inf
    inflight_by_priority: dict[Priority, int] = field(default_factory=lambda: dict.fromkeys(Priority, 0))
    changes: deque[LevelChange] = field(default_factory=lambda: deque(maxlen=32))


class GradedDegradation(DegradationPolicy):
    name = DegradationPolicyName.GRADED

    def __init__(
        self,
        config: DegradationConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[LevelChange], None] | None = None,
        rng: random.Random | None = None,
    ):
        self.config = config
        self._clock = clock
        self._on_change = on_change
        self._rng = rng or random.Random()
        self._by_model: dict[str, _ModelState] = {}

    def _model(self, model: str) -> _ModelState:
        st = self._by_model.get(model)
        if st is None:
            st = self._by_model[model] = _ModelState()
        return st

    def is_observation_due(self, model: str) -> bool:
        return self._clock() - self._model(model).observed_at >= self.config.eval_interval_s

    def observe(self, model: str, load: ModelLoad, p95_ttft_s: float | None) -> LevelChange | None:
        st = self._model(model)
        now = self._clock()
        st.observed_at = now
        st.pressure = pressure(load, self.config, p95_ttft_s)
        new = step_level(st.state, st.pressure.score, now, self.config, is_predicted=st.pressure.is_predicted)
        old = st.state.level
        st.state = new
        if new.level == old:
            return None
        direction = "rose" if new.level > old else "fell"
        change = LevelChange(model, old, new.level, st.pressure.score, f"{direction}: {st.pressure.describe()}", now)
        st.changes.append(change)
        log.warning(
            "degradation level of %s %s %d -> %d: %s", model, direction, int(old), int(new.level), st.pressure.describe()
        )
        if self._on_change is not None:
            self._on_change(change)
        return change

    def level(self, model: str) -> DegradationLevel:
        return self._model(model).state.level

    def pressure(self, model: str) -> Pressure:
        return self._model(model).pressure

    def changes(self, model: str) -> list[LevelChange]:
        return list(self._model(model).changes)

    def plan(self, model: str, priority: Priority, max_tokens: int | None, has_fallback: bool) -> Plan:
        st = self._model(model)
        level = st.state.level
        if level is DegradationLevel.NORMAL:
            return Plan(level)
        p = st.pressure
        score = p.score
        if should_shed(level, priority, score, st.inflight_by_priority, self.config, p.predicted):
            # NOTE(retry-jitter): the predicted excess wait (at least retry_after_s),
            # spread x U(1, 1.5) + U(0, 1) s so a shed wave does not return as one burst
            base = max(self.config.retry_after_s, p.excess_s[priority])
            return Plan(level, shed=True, retry_after_s=base * self._rng.uniform(1.0, 1.5) + self._rng.uniform(0.0, 1.0))
        capped = None
        if max_tokens is not None and self._trims(p, priority):
            # NOTE(cap-load): the "load" of the cap formula is the model's load score
            # itself (1.0 = full), so at level 1 the cut is 60-80%: enough to drain
            # the in-flight tokens within seconds, and the 16-token floor keeps answers useful.
            cap = cap_max_tokens(max_tokens, score, self.config)
            capped = cap if cap < max_tokens else None
        use_fallback = level >= DegradationLevel.FALLBACK and has_fallback and priority is not Priority.P0
        return Plan(level, max_tokens=capped, use_fallback=use_fallback)

    def _trims(self, p: Pressure, priority: Priority) -> bool:
        """Level 1+ caps max_tokens: never p0; p2 always; p1 once its own predicted ratio reaches ``slo_enter[0]``."""
        if priority is Priority.P0:
            return False
        if priority is Priority.P1 and p.predicted is not None:
            return p.predicted[Priority.P1] >= self.config.slo_enter[0]
        return True

    def add_request(self, model: str, priority: Priority) -> None:
        self._model(model).inflight_by_priority[priority] += 1

    def finish_request(self, model: str, priority: Priority) -> None:
        counts = self._model(model).inflight_by_priority
        counts[priority] = max(0, counts[priority] - 1)


def make_degradation(
    config: DegradationConfig,
    *,
    clock: Callable[[], float] = time.monotonic,
    on_change: Callable[[LevelChange], None] | None = None,
    rng: random.Random | None = None,
) -> DegradationPolicy:
    if config.policy is DegradationPolicyName.OFF:
        return NoDegradation()
    return GradedDegradation(config, clock=clock, on_change=on_change, rng=rng)
