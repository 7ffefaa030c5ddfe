"""Canary rollouts: traffic shares between a model's versions, and automatic rollback.

A model's *stable* version is its first listed one; every other version with a
share > 0 is a *canary*.  Each attempt sent to a replica is recorded in its
version's sliding window (``VersionWindow``).  ``judge`` (pure) compares a
canary's window with the stable one's::

    rollback if  5xx rate            > max_5xx_rate       (default 5%)
             or  p99 time to first byte > max_p99_s       (default 2 s)
             or  success rate        < stable's - max_success_drop   (default 10 points)

once the canary has ``min_requests`` attempts in the window.  A rollback sets the
canary's share to 0 at once (in-flight requests finish; new ones go to the other
versions) and is kept as a ``RolloutEvent`` with the figures behind it, logged,
exported as metrics and shown at ``GET /admin/rollout``.  ``set_shares`` is the
manual path (``POST /admin/rollout``): shares change in place, no restart, no
dropped request.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

from sluice.errors import InvalidRequestError
from sluice.gateway.config import RolloutConfig
from sluice.gateway.pool import ReplicaPool

__all__ = [
    "WindowStats",
    "Verdict",
    "VersionWindow",
    "RolloutEvent",
    "judge",
    "RolloutManager",
]

log = logging.getLogger("sluice.gateway.rollout")


@dataclass(frozen=True)
class WindowStats:
    num_requests: int  # attempts in the window
    num_5xx: int  # 5xx answers, connection errors, timeouts, broken streams
    num_success: int  # 2xx, stream completed
    p99_s: float | None  # p99 time to first byte (None: no sample)

    @property
    def rate_5xx(self) -> float:
        return self.num_5xx / self.num_requests if self.num_requests else 0.0

    @property
    def success_rate(self) -> float:
        return self.num_success / self.num_requests if self.num_requests else 1.0

    def as_dict(self) -> dict[str, float | int | None]:
        return {**asdict(self), "rate_5xx": round(self.rate_5xx, 4), "success_rate": round(self.success_rate, 4)}


@dataclass(frozen=True)
class Verdict:
    rollback: bool
    reasons: tuple[str, ...] = ()


def judge(canary: WindowStats, stable: WindowStats | None, config: RolloutConfig) -> Verdict:
    """Is the canary worse than allowed (pure)?"""
    if canary.num_requests < config.min_requests:
        return Verdict(False)
    reasons = []
    if canary.rate_5xx > config.max_5xx_rate:
        reasons.append(f"5xx rate {canary.rate_5xx:.1%} > {config.max_5xx_rate:.1%}")
    if canary.p99_s is not None and canary.p99_s > config.max_p99_s:
        reasons.append(f"p99 {canary.p99_s:.3f}s > {config.max_p99_s:.3f}s")
    # NOTE(success-baseline): the success rate is judged against the stable
    # version only when it has enough traffic of its own to be a baseline.
    if stable is not None and stable.num_requests >= config.min_requests:
        floor = stable.success_rate - config.max_success_drop
        if canary.success_rate < floor - 1e-12:
            reasons.append(
                f"success rate {canary.success_rate:.1%} < stable {stable.success_rate:.1%} "
                f"- {config.max_success_drop:.0%}"
            )
    return Verdict(bool(reasons), tuple(reasons))


class VersionWindow:
    """Attempts of one version over the last ``window_s`` seconds."""

    def __init__(self, window_s: float, clock: Callable[[], float], max_samples: int = 100_000):
        self._window_s = window_s
        self._clock = clock
        # (t, is_5xx, success, ttfb); bounded so a very busy version costs fixed memory
        self._samples: deque[tuple[float, bool, bool, float | None]] = deque(maxlen=max_samples)

    def record(self, *, is_5xx: bool, success: bool, ttfb_s: float | None) -> None:
        now = self._clock()
        self._samples.append((now, is_5xx, success, ttfb_s))
        if self._samples[0][0] < now - self._window_s:
            self._evict(now)

    def _evict(self, now: float) -> None:
        horizon = now - self._window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()

    def clear(self) -> None:
        self._samples.clear()

    def stats(self) -> WindowStats:
        self._evict(self._clock())
        lat = sorted(s[3] for s in self._samples if s[3] is not None)
        p99 = lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)] if lat else None
        return WindowStats(
            num_requests=len(self._samples),
            num_5xx=sum(s[1] for s in self._samples),
            num_success=sum(s[2] for s in self._samples),
            p99_s=p99,
        )


@dataclass(frozen=True)
class RolloutEvent:
    at: float  # gateway clock (monotonic)
    time: float  # wall clock, seconds since the epoch
    model: str
    version: str
    action: str  # "rollback" | "set_shares"
    shares_before: dict[str, float]
    shares_after: dict[str, float]
    reasons: tuple[str, ...] = ()
    canary: WindowStats | None = None
    stable: WindowStats | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "time": self.time,
            "model": self.model,
            "version": self.version,
            "action": self.action,
            "shares_before": self.shares_before,
            "shares_after": self.shares_after,
            "reasons": list(self.reasons),
            "canary": self.canary.as_dict() if self.canary else None,
            "stable": self.stable.as_dict() if self.stable else None,
        }


@dataclass
class _Tracked:
    window: VersionWindow
    judged_at: float = -math.inf
    num_rollbacks: int = 0


@dataclass
class RolloutManager:
    """Owns the canary windows and rollout history of every model in a pool."""

    config: RolloutConfig
    pool: ReplicaPool
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    on_event: Callable[[RolloutEvent], None] | None = None
    events: deque[RolloutEvent] = field(init=False)
    _tracked: dict[tuple[str, str], _Tracked] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.config.max_events)

    def stable_version(self, model: str) -> str:
        return self.pool.versions(model)[0].name

    def _track(self, model: str, version: str) -> _Tracked:
        key = (model, version)
        t = self._tracked.get(key)
        if t is None:
            t = self._tracked[key] = _Tracked(VersionWindow(self.config.window_s, self.clock))
        return t

    def window(self, model: str, version: str) -> WindowStats:
        return self._track(model, version).window.stats()

    def num_rollbacks(self, model: str, version: str) -> int:
        return self._track(model, version).num_rollbacks

    def shares(self, model: str) -> dict[str, float]:
        return {v.name: v.share for v in self.pool.versions(model)}

    # ---- automatic path -----------------------------------------------------------

    def record_attempt(
        self, model: str, version: str, *, status: int | None, ok: bool, ttfb_s: float | None
    ) -> RolloutEvent | None:
        """One attempt at a replica of ``version``: ``status`` None when no answer came."""
        versions = self.pool.versions(model)
        if len(versions) < 2:
            return None  # NOTE(single-version): nothing to compare, nothing to roll back
        is_5xx = status is None or status >= 500 or not ok
        success = ok and status is not None and 200 <= status < 300
        tracked = self._track(model, version)
        tracked.window.record(is_5xx=is_5xx, success=success, ttfb_s=ttfb_s)
        if not self.config.auto_rollback or version == versions[0].name:
            return None
        now = self.clock()
        if now - tracked.judged_at < self.config.judge_interval_s and not is_5xx:
            return None
        tracked.judged_at = now
        return self.check(model, version)

    def check(self, model: str, version: str) -> RolloutEvent | None:
        """Judge one canary now; roll it back if it is worse than allowed."""
        v = self.pool.version(model, version)
        if v.share <= 0:
            return None
        canary = self.window(model, version)
        stable_name = self.stable_version(model)
        stable = self.window(model, stable_name) if stable_name != version else None
        verdict = judge(canary, stable, self.config)
        if not verdict.rollback:
            return None
        before = self.shares(model)
        self.pool.set_share(model, version, 0.0)
        self._track(model, version).num_rollbacks += 1
        event = RolloutEvent(
            at=self.clock(),
            time=self.wall_clock(),
            model=model,
            version=version,
            action="rollback",
            shares_before=before,
            shares_after=self.shares(model),
            reasons=verdict.reasons,
            canary=canary,
            stable=stable,
        )
        log.error("rolled back %s version %s (share %s -> 0): %s", model, version, before[version], "; ".join(verdict.reasons))
        self._emit(event)
        return event

    # ---- manual path ---------------------------------------------------------------

    def set_shares(self, model: str, shares: Mapping[str, float]) -> RolloutEvent:
        """Set some versions' shares at once (validated first: all or nothing)."""
        versions = {v.name for v in self.pool.versions(model)}  # 404 for an unknown model
        if not shares:
            raise InvalidRequestError("'shares' must name at least one version", param="shares")
        for name, share in shares.items():
            if name not in versions:
                raise InvalidRequestError(
                    f"model {model!r} has no version {name!r} (versions: {', '.join(sorted(versions))})",
                    param="shares",
                )
            if isinstance(share, bool) or not isinstance(share, int | float) or not math.isfinite(share) or share < 0:
                raise InvalidRequestError(f"share of {name!r} must be a number >= 0, got {share!r}", param="shares")
        before = self.shares(model)
        after = {**before, **{k: float(v) for k, v in shares.items()}}
        if sum(after.values()) <= 0:
            raise InvalidRequestError("at least one version needs a share > 0", param="shares")
        for name, share in shares.items():
            self.pool.set_share(model, name, float(share))
            if share > 0 and before[name] == 0:
                # a re-enabled canary starts a fresh window: its old failures are history
                self._track(model, name).window.clear()
        event = RolloutEvent(
            at=self.clock(),
            time=self.wall_clock(),
            model=model,
            version=",".join(shares),
            action="set_shares",
            shares_before=before,
            shares_after=self.shares(model),
        )
        log.warning("traffic shares of %s set by hand: %s -> %s", model, before, event.shares_after)
        self._emit(event)
        return event

    def _emit(self, event: RolloutEvent) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def describe(self) -> dict[str, object]:
        """JSON view for ``GET /admin/rollout``."""
        models: dict[str, object] = {}
        for model in self.pool.models:
            stable = self.stable_version(model)
            models[model] = {
                "stable": stable,
                "versions": {
                    v.name: {
                        "share": v.share,
                        "role": "stable" if v.name == stable else "canary",
                        "num_rollbacks": self.num_rollbacks(model, v.name),
                        "window": self.window(model, v.name).as_dict(),
                    }
                    for v in self.pool.versions(model)
                },
            }
        return {
            "config": self.config.model_dump(),
            "models": models,
            "events": [e.as_dict() for e in self.events],
        }
