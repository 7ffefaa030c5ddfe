"""Canary judgement on scripted windows, and the rollout manager's automatic and
manual paths (pure, fake clock, no sockets)."""

from __future__ import annotations

import pytest

from sluice.errors import InvalidRequestError, ModelNotFoundError
from sluice.gateway.config import RolloutConfig
from sluice.gateway.pool import ReplicaPool
from sluice.gateway.rollout import RolloutManager, VersionWindow, WindowStats, judge
from tests.gateway.conftest import FakeClock, gateway_config

CFG = RolloutConfig()


def _w(n: int, n5xx: int = 0, nsuccess: int | None = None, p99: float | None = 0.2) -> WindowStats:
    return WindowStats(n, n5xx, n - n5xx if nsuccess is None else nsuccess, p99)


@pytest.mark.parametrize(
    ("canary", "stable", "rollback", "why"),
    [
        (_w(100, 5), _w(100), False, "exactly 5% 5xx is within the threshold"),
        (_w(100, 6), _w(100), True, "6% 5xx is above 5%"),
        (_w(100, p99=2.5), _w(100), True, "p99 2.5 s is above 2 s"),
        (_w(100, p99=1.9), _w(100, p99=0.1), False, "p99 under 2 s passes even if slower than stable"),
        (_w(100, 0, 85), _w(100, 0, 99), True, "85% success vs 99% stable is 14 points worse"),
        (_w(100, 0, 90), _w(100, 0, 99), False, "9 points worse is within 10"),
        (_w(100, 0, 80), _w(5, 0, 5), False, "a stable version with too little traffic is no baseline"),
        (_w(9, 9), _w(100), False, "below min_requests nothing is judged"),
        (_w(10, 9), None, True, "a failing canary is rolled back even with no stable traffic"),
    ],
)
def test_judge_on_scripted_windows(canary: WindowStats, stable: WindowStats | None, rollback: bool, why: str) -> None:
    verdict = judge(canary, stable, CFG)
    assert verdict.rollback is rollback, why
    assert bool(verdict.reasons) is rollback, "a rollback must carry its reasons, a pass none"


def test_version_window_slides_and_computes_p99() -> None:
    clock = FakeClock()
    w = VersionWindow(10.0, clock)
    for i in range(100):
        w.record(is_5xx=i < 3, success=i >= 3, ttfb_s=i / 100)
    s = w.stats()
    assert (s.num_requests, s.num_5xx, s.num_success) == (100, 3, 97)
    assert s.p99_s == pytest.approx(0.98), "p99 of 0.00..0.99 is the 99th value"
    clock.advance(11)
    w.record(is_5xx=False, success=True, ttfb_s=None)
    assert w.stats() == WindowStats(1, 0, 1, None), "samples older than the window must drop out"


def _manager(clock: FakeClock, **cfg: object) -> tuple[RolloutManager, ReplicaPool, list]:
    config = gateway_config(
        [],
        models={
            "m": {
                "versions": [
                    {"name": "stable", "share": 90, "replicas": ["http://127.0.0.1:1"]},
                    {"name": "canary", "share": 10, "replicas": ["http://127.0.0.1:2"]},
                ]
            }
        },
    )
    pool = ReplicaPool(config, clock=clock)
    events: list = []
    mgr = RolloutManager(RolloutConfig(**cfg), pool, clock=clock, wall_clock=lambda: 1.7e9, on_event=events.append)
    return mgr, pool, events


def test_a_canary_returning_5xx_is_rolled_back_within_one_window() -> None:
    clock = FakeClock()
    mgr, pool, events = _manager(clock)
    for _ in range(50):
        mgr.record_attempt("m", "stable", status=200, ok=True, ttfb_s=0.1)
        clock.advance(0.1)
    for i in range(12):
        ev = mgr.record_attempt("m", "canary", status=503 if i % 3 == 0 else 200, ok=i % 3 != 0, ttfb_s=0.1)
        clock.advance(0.1)
        if ev is not None:
            break
    assert ev is not None and ev.action == "rollback", "a canary with 33% 5xx must be rolled back"
    assert i < 12 and clock.t - 1000 < CFG.window_s, "the rollback must come within one window"
    assert pool.version("m", "canary").share == 0, "a rolled back canary gets no new traffic"
    assert pool.version("m", "stable").share == 90
    assert ev.shares_before == {"stable": 90, "canary": 10} and ev.shares_after == {"stable": 90, "canary": 0}
    assert any("5xx" in r for r in ev.reasons) and ev.canary is not None and ev.canary.num_5xx >= 3
    assert events == [ev] and mgr.num_rollbacks("m", "canary") == 1
    view = mgr.describe()
    assert view["events"][0]["reasons"] == list(ev.reasons) and view["events"][0]["time"] == 1.7e9  # type: ignore[index]
    assert view["models"]["m"]["versions"]["canary"]["share"] == 0  # type: ignore[index]
    assert mgr.record_attempt("m", "canary", status=503, ok=False, ttfb_s=0.1) is None, "share 0: nothing to roll back"


def test_the_stable_version_is_never_rolled_back_and_auto_rollback_can_be_off() -> None:
    clock = FakeClock()
    mgr, pool, _ = _manager(clock)
    for _ in range(30):
        assert mgr.record_attempt("m", "stable", status=500, ok=False, ttfb_s=0.1) is None
    assert pool.version("m", "stable").share == 90, "the stable version is the baseline, never a canary"
    off, pool2, _ = _manager(clock, auto_rollback=False)
    for _ in range(30):
        assert off.record_attempt("m", "canary", status=500, ok=False, ttfb_s=0.1) is None
    assert pool2.version("m", "canary").share == 10, "auto_rollback: false must only observe"


def test_a_slow_canary_is_rolled_back_on_p99() -> None:
    clock = FakeClock()
    mgr, pool, _ = _manager(clock, judge_interval_s=0)
    for _ in range(20):
        mgr.record_attempt("m", "canary", status=200, ok=True, ttfb_s=3.0)
    assert pool.version("m", "canary").share == 0, "p99 3 s must roll the canary back"
    assert "p99" in mgr.events[-1].reasons[0]


def test_set_shares_by_hand_validates_all_or_nothing() -> None:
    clock = FakeClock()
    mgr, pool, events = _manager(clock)
    ev = mgr.set_shares("m", {"stable": 50, "canary": 50})
    assert mgr.shares("m") == {"stable": 50, "canary": 50} and ev.action == "set_shares" and events == [ev]
    bad = [({"nope": 1}, "no version"), ({"canary": -1}, ">= 0"), ({"canary": "x"}, ">= 0"),
           ({"stable": 0, "canary": 0}, "share > 0"), ({}, "at least one")]
    for shares, msg in bad:
        with pytest.raises(InvalidRequestError, match=msg):
            mgr.set_shares("m", shares)  # type: ignore[arg-type]
        assert mgr.shares("m") == {"stable": 50, "canary": 50}, f"a rejected update {shares} must change nothing"
    with pytest.raises(ModelNotFoundError):
        mgr.set_shares("other", {"v1": 1})


def test_re_enabling_a_rolled_back_canary_starts_a_fresh_window() -> None:
    clock = FakeClock()
    mgr, pool, _ = _manager(clock, judge_interval_s=0)
    for _ in range(10):
        mgr.record_attempt("m", "canary", status=500, ok=False, ttfb_s=0.1)
    assert pool.version("m", "canary").share == 0
    mgr.set_shares("m", {"canary": 10})
    assert mgr.window("m", "canary").num_requests == 0, "old failures must not roll back a fixed canary at once"
    assert mgr.record_attempt("m", "canary", status=200, ok=True, ttfb_s=0.1) is None
    assert pool.version("m", "canary").share == 10
