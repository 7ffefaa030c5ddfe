"""Health tracking and the retry budget: pure, fake clock."""

from __future__ import annotations

from sluice.gateway.config import HealthConfig, RetryConfig
from sluice.gateway.health import HealthState, HealthTracker
from sluice.gateway.retry import RetryBudget
from tests.gateway.conftest import FakeClock


def test_replica_goes_down_after_consecutive_failures_and_comes_back(clock: FakeClock) -> None:
    h = HealthTracker(HealthConfig(unhealthy_after=2, healthy_after=2, interval_s=1.0), clock=clock)
    assert h.is_up, "replicas start in rotation"
    h.record_probe(False, "boom")
    assert h.is_up, "one failed probe must not take a replica out"
    h.record_probe(True)
    h.record_probe(False, "boom")
    assert h.is_up, "failures must be consecutive"
    h.record_connect_failure("refused")
    assert h.state is HealthState.DOWN and h.last_error == "refused", "2 consecutive failures take it out"
    assert h.retry_after() == 1.0, "a down replica says when the next probe is due"
    h.record_probe(True)
    assert not h.is_up, "one good probe is not enough with healthy_after=2"
    h.record_probe(True)
    assert h.is_up and h.last_error is None, "healthy_after good probes bring it back"


def test_probe_schedule(clock: FakeClock) -> None:
    h = HealthTracker(HealthConfig(interval_s=2.0), clock=clock)
    assert h.is_probe_due(), "the first probe is due at once"
    h.record_probe(True)
    clock.advance(1.9)
    assert not h.is_probe_due()
    clock.advance(0.1)
    assert h.is_probe_due(), "a probe is due every interval_s"


def test_retry_budget_caps_extra_load(clock: FakeClock) -> None:
    b = RetryBudget(RetryConfig(budget_ratio=0.2, min_retries_per_s=0.0, budget_window_s=10.0), clock=clock)
    for _ in range(100):
        b.record_request()
    spent = sum(b.try_spend() for _ in range(50))
    assert spent == 20, f"100 requests allow 20 retries (20% extra load), got {spent}"
    clock.advance(11.0)
    assert not b.try_spend(), "with no recent requests and no floor, no retry is allowed"
    b.record_request()
    assert not b.try_spend(), "one request gives 0.2 of a retry: not enough"


def test_retry_budget_floor_for_quiet_gateways(clock: FakeClock) -> None:
    b = RetryBudget(RetryConfig(budget_ratio=0.2, min_retries_per_s=0.5, budget_window_s=10.0), clock=clock)
    b.record_request()
    spent = sum(b.try_spend() for _ in range(10))
    assert spent == 5, f"the floor allows min_retries_per_s x window = 5 retries, got {spent}"
