"""AdmissionController: a bounded queue that sheds the lowest class first (pure)."""

from __future__ import annotations

import pytest

from sluice.errors import OverloadedError
from sluice.server.admission import AdmissionController
from sluice.types import Priority


def test_admits_until_the_request_bound_then_rejects_same_class() -> None:
    a = AdmissionController(max_queued_requests=2, max_queued_tokens=10_000)
    assert a.admit("r1", Priority.P1, 10).shed == [] and a.admit("r2", Priority.P1, 10).shed == []
    with pytest.raises(OverloadedError) as e:
        a.admit("r3", Priority.P1, 10)
    assert e.value.status_code == 429 and e.value.retry_after > 0
    assert a.num_queued == 2, "a rejected request must not take a slot"


def test_token_bound_counts_prompt_plus_max_tokens() -> None:
    a = AdmissionController(max_queued_requests=100, max_queued_tokens=100)
    a.admit("r1", Priority.P1, 60)
    with pytest.raises(OverloadedError):
        a.admit("r2", Priority.P1, 41)
    a.remove("r1")
    assert a.num_queued_tokens == 0
    assert a.admit("r2", Priority.P1, 100).shed == []


def test_a_single_request_over_the_token_bound_is_rejected_outright() -> None:
    a = AdmissionController(max_queued_requests=100, max_queued_tokens=100)
    with pytest.raises(OverloadedError, match="max-queued-tokens"):
        a.admit("big", Priority.P0, 101)


def test_higher_class_sheds_newest_of_lowest_class() -> None:
    a = AdmissionController(max_queued_requests=3, max_queued_tokens=10_000)
    a.admit("p1-old", Priority.P1, 1)
    a.admit("p2-old", Priority.P2, 1)
    a.admit("p2-new", Priority.P2, 1)
    assert a.admit("p0", Priority.P0, 1).shed == ["p2-new"], "the newest request of the lowest class goes first"
    assert a.admit("p1", Priority.P1, 1).shed == ["p2-old"], "P1 may shed P2"
    with pytest.raises(OverloadedError):
        a.admit("p1-again", Priority.P1, 1)  # only P0/P1 left: a P1 cannot shed its own class


def test_shedding_is_all_or_nothing() -> None:
    a = AdmissionController(max_queued_requests=10, max_queued_tokens=100)
    a.admit("p0", Priority.P0, 80)
    a.admit("p2", Priority.P2, 20)
    with pytest.raises(OverloadedError):
        a.admit("p1", Priority.P1, 90)  # shedding p2 frees 20, not enough: nothing is shed
    assert a.num_queued == 2, "a failed admission must not shed anyone"


def test_remove_is_idempotent() -> None:
    a = AdmissionController(1, 10)
    a.admit("r", Priority.P1, 5)
    a.remove("r")
    a.remove("r")
    assert a.num_queued == 0 and a.num_queued_tokens == 0
