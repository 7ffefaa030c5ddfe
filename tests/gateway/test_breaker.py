"""Adaptive circuit breaker: pure, driven by a fake clock."""

from __future__ import annotations

from sluice.gateway.breaker import BreakerState, CircuitBreaker, linear_slope
from sluice.gateway.config import BreakerConfig
from tests.gateway.conftest import FakeClock


def _breaker(clock: FakeClock, **kw: object) -> CircuitBreaker:
    cfg = BreakerConfig(**{"window_s": 10.0, "num_buckets": 10, "min_requests": 10, **kw})  # type: ignore[arg-type]
    return CircuitBreaker(cfg, sustainable_qps=10.0, clock=clock)


def _feed(b: CircuitBreaker, clock: FakeClock, n: int, fail_every: int, latency: float = 0.05, dt: float = 0.1) -> None:
    for i in range(n):
        b.record(ok=(fail_every == 0 or i % fail_every != 0), latency_s=latency)
        clock.advance(dt)


def test_idle_healthy_replica_needs_a_clear_failure_rate(clock: FakeClock) -> None:
    b = _breaker(clock)
    # 10 calls over 10 s at 1 qps (10% of sustainable), flat latency, no KV pressure: score ~0.03
    for i in range(10):
        b.record(ok=i % 3 != 0, latency_s=0.05)  # 4/10 = 40% failures
        clock.advance(1.0)
    assert b.score() < 0.1, f"an idle replica with flat latency must score low, got {b.score():.3f}"
    assert b.state is BreakerState.CLOSED, "40% failures must not trip an idle healthy replica (threshold ~50%)"
    for _ in range(4):
        b.record(ok=False, latency_s=0.05)
    assert b.state is BreakerState.OPEN, "a clear majority of failures must trip the breaker"


def test_stressed_replica_trips_earlier(clock: FakeClock) -> None:
    calm, stressed = _breaker(clock), _breaker(clock)
    stressed.kv_cache_usage = 1.0
    for i in range(40):  # 10 qps = the sustainable rate; stressed replica's p99 climbs
        calm.record(ok=i % 5 != 0, latency_s=0.05)
        stressed.record(ok=i % 5 != 0, latency_s=0.05 + 0.02 * i)
        clock.advance(0.1)
    assert stressed.threshold() < calm.threshold(), (
        f"load + rising latency + KV pressure must lower the trip threshold "
        f"({stressed.threshold():.3f} vs {calm.threshold():.3f})"
    )
    assert stressed.state is BreakerState.OPEN, "20% failures must trip a saturated, slowing replica"
    assert calm.state is BreakerState.CLOSED, "20% failures must not trip a calm replica with flat latency"


def test_score_components_follow_their_inputs(clock: FakeClock) -> None:
    b = _breaker(clock, w_qps=1.0, w_latency_slope=0.0, w_memory=0.0)
    _feed(b, clock, 50, fail_every=0, dt=0.1)  # 10 qps on a 10 qps replica
    assert b.qps_score() > 0.9, f"running at the sustainable rate must give qps score ~1, got {b.qps_score()}"
    m = _breaker(clock, w_qps=0.0, w_latency_slope=0.0, w_memory=1.0)
    m.kv_cache_usage = 0.7
    assert abs(m.score() - 0.7) < 1e-9, "with only the memory weight, the score is the KV usage"
    assert abs(linear_slope([0, 1, 2, 3], [1, 3, 5, 7]) - 2.0) < 1e-9, "least-squares slope of a line"
    assert linear_slope([1.0], [5.0]) == 0.0, "one point has no slope"


def test_open_half_open_closed_cycle(clock: FakeClock) -> None:
    b = _breaker(clock, open_s=5.0, half_open_probes=2, min_requests=4)
    _feed(b, clock, 4, fail_every=1)
    assert b.state is BreakerState.OPEN and not b.can_route(), "an open breaker must refuse traffic"
    assert 0 < b.retry_after() <= 5.0, f"retry_after must say when probing starts, got {b.retry_after()}"
    clock.advance(5.0)
    assert b.state is BreakerState.HALF_OPEN, "after open_s the breaker must half-open"
    b.on_dispatch()
    b.on_dispatch()
    assert not b.can_route(), "half-open must let only half_open_probes requests through at once"
    b.record(ok=True, latency_s=0.01)
    b.record(ok=True, latency_s=0.01)
    assert b.state is BreakerState.CLOSED, "enough successful probes must close the breaker"


def test_failed_probe_reopens_with_backoff(clock: FakeClock) -> None:
    b = _breaker(clock, open_s=2.0, max_open_s=5.0, min_requests=4)
    _feed(b, clock, 4, fail_every=1)
    clock.advance(2.0)
    b.on_dispatch()
    b.record(ok=False, latency_s=0.01)
    assert b.state is BreakerState.OPEN, "a failed half-open probe must reopen the breaker"
    assert b.retry_after() == 4.0, f"open time must double after a failed probe, got {b.retry_after()}"
    clock.advance(4.0)
    b.on_dispatch()
    b.record(ok=False, latency_s=0.01)
    assert b.retry_after() == 5.0, "the backoff must be capped at max_open_s"


def test_window_forgets_old_failures(clock: FakeClock) -> None:
    b = _breaker(clock, min_requests=5)
    for _ in range(4):
        b.record(ok=False, latency_s=0.01)
    clock.advance(11.0)
    assert b.window_counts() == (0, 0), "calls older than the window must be forgotten"
    b.record(ok=False, latency_s=0.01)
    assert b.state is BreakerState.CLOSED, "old failures must not count towards a trip"


def test_slow_calls_count_as_failures(clock: FakeClock) -> None:
    b = _breaker(clock, slow_call_s=1.0, min_requests=4)
    for _ in range(4):
        b.record(ok=True, latency_s=2.0)
    assert b.state is BreakerState.OPEN, "successes slower than slow_call_s must count as failures"
