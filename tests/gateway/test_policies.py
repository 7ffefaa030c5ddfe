"""Routing policies: pure choices over replica state."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from sluice.gateway.config import PolicyName, ReplicaConfig, WeightedConfig
from sluice.gateway.policies import (
    LeastLoadPolicy,
    RouteRequest,
    WeightedPolicy,
    dynamic_weight,
    make_policy,
    prefix_hashes,
)
from sluice.gateway.prom import ReplicaLoad
from sluice.gateway.replica import Replica
from tests.gateway.conftest import FakeClock, gateway_config


def _replicas(n: int, clock: FakeClock, weights: list[float] | None = None) -> list[Replica]:
    cfg = gateway_config(["http://x:1"])
    return [
        Replica.build(
            ReplicaConfig(url=f"http://r{i}:80", weight=(weights[i] if weights else 1.0)),
            model="m",
            version="v1",
            health=cfg.health,
            breaker=cfg.breaker,
            clock=clock,
        )
        for i in range(n)
    ]


def _req(text: str = "", tokens: int = 100) -> RouteRequest:
    return RouteRequest("m", text, tokens)


def test_round_robin_cycles_by_weight(clock: FakeClock) -> None:
    reps = _replicas(3, clock, weights=[1, 1, 2])
    policy = make_policy("round_robin", gateway_config(["http://x:1"]))
    picks = [policy.choose(reps, _req()).replica.url for _ in range(8)]
    counts = Counter(picks)
    assert counts == {"http://r0:80": 2, "http://r1:80": 2, "http://r2:80": 4}, f"weights 1:1:2 -> {counts}"
    assert all(a != b for a, b in zip(picks, picks[1:], strict=False) if a != "http://r2:80"), (
        "smooth round robin must interleave, not send bursts to one replica"
    )


def test_least_load_prefers_fewest_outstanding_tokens(clock: FakeClock) -> None:
    reps = _replicas(3, clock)
    reps[0].inflight_tokens, reps[1].inflight_tokens, reps[2].inflight_tokens = 500, 100, 300
    policy = LeastLoadPolicy(random.Random(0))
    assert policy.choose(reps, _req()).replica is reps[1], "the replica with the fewest tokens must win"
    reps[2].config = ReplicaConfig(url=reps[2].url, weight=4.0)  # 300 / 4 = 75 per unit of weight
    assert policy.choose(reps, _req()).replica is reps[2], "outstanding tokens count per unit of weight"


def test_least_load_ties_use_power_of_two_choices(clock: FakeClock) -> None:
    reps = _replicas(2, clock)
    reps[0].num_inflight = 5  # same tokens, more pending requests
    policy = LeastLoadPolicy(random.Random(0))
    picks = Counter(policy.choose(reps, _req()).replica.url for _ in range(20))
    assert picks == {"http://r1:80": 20}, f"ties must go to the replica with fewer pending requests: {picks}"
    even = _replicas(4, clock)
    spread = Counter(policy.choose(even, _req()).replica.url for _ in range(400))
    assert len(spread) == 4 and min(spread.values()) > 50, f"equal replicas must share ties: {spread}"


def test_weighted_formula_and_period(clock: FakeClock) -> None:
    reps = _replicas(2, clock)
    reps[0].load = ReplicaLoad(cpu_utilization=0.0, memory_used=0.0)
    reps[1].load = ReplicaLoad(cpu_utilization=1.0, memory_used=1.0)
    reps[1].num_inflight = 64  # pending == capacity -> 0.1 floor
    cfg = WeightedConfig()
    assert dynamic_weight(reps[0], cfg) == pytest.approx(1.0)
    assert dynamic_weight(reps[1], cfg) == pytest.approx(0.3 * 0.1), "0.4*0 + 0.3*0 + 0.3*max(0.1, 0)"
    policy = WeightedPolicy(cfg, clock)
    picks = Counter(policy.choose(reps, _req()).replica.url for _ in range(103))
    assert picks["http://r1:80"] == 3, f"weights 1 : 0.03 must give ~100:3, got {picks}"
    reps[1].load = ReplicaLoad(cpu_utilization=0.0, memory_used=0.0)
    reps[1].num_inflight = 0
    clock.advance(4.0)
    assert policy.weights(reps)[1] == pytest.approx(0.03), "weights must not change before period_s"
    clock.advance(1.0)
    assert policy.weights(reps)[1] == pytest.approx(1.0), "weights must be recomputed every period_s"


def test_prefix_affinity_sticks_to_the_prefix_holder(clock: FakeClock) -> None:
    reps = _replicas(4, clock)
    policy = make_policy(PolicyName.PREFIX_AFFINITY, gateway_config(["http://x:1"], prefix_affinity={"chunk_chars": 16}))
    system = "You are a helpful assistant. " * 4
    first = policy.choose(reps, _req(system + "question one"))
    assert first.reason == "miss", "an unseen prefix must go to the fallback policy"
    for i in range(10):
        d = policy.choose(reps, _req(system + f"question {i} " * 3))
        assert d.replica is first.replica and d.reason == "affinity", "a shared prefix must stick to its replica"
    other = policy.choose(reps, _req("a completely different prompt " * 3))
    assert other.reason == "miss"


def test_prefix_affinity_leaves_an_overloaded_replica(clock: FakeClock) -> None:
    reps = _replicas(2, clock)
    policy = make_policy("prefix_affinity", gateway_config(["http://x:1"], prefix_affinity={"chunk_chars": 16, "balance_abs": 4}))
    text = "shared prefix shared prefix shared prefix"
    home = policy.choose(reps, _req(text)).replica
    home.num_inflight = 4  # pending 4 > 0 + 4? no: stays
    assert policy.choose(reps, _req(text)).replica is home, "a load within the bound keeps affinity"
    home.num_inflight = 9
    home.inflight_tokens = 10_000
    d = policy.choose(reps, _req(text))
    assert d.replica is not home and d.reason == "balance", "an overloaded prefix holder must be bypassed"


def test_prefix_hashes_are_chained() -> None:
    a = prefix_hashes("abcdefgh" * 4, 8, 10)
    b = prefix_hashes("abcdefgh" * 2 + "XXXXXXXX" + "abcdefgh", 8, 10)
    assert len(a) == 4 and a[:2] == b[:2] and a[2:] != b[2:], "hash i must cover the whole prefix up to chunk i"
    assert prefix_hashes("short", 8, 10) == [], "a prompt shorter than a chunk has no prefix"
    assert len(prefix_hashes("x" * 1000, 8, 5)) == 5, "max_chunks bounds the work per request"


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest", gateway_config(["http://x:1"]))
