"""Property tests: invariants every routing policy keeps, for any replica state."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.gateway.config import PolicyName, ReplicaConfig
from sluice.gateway.policies import RouteRequest, make_policy
from sluice.gateway.prom import ReplicaLoad
from sluice.gateway.replica import Replica
from tests.gateway.conftest import FakeClock, gateway_config

_CFG = gateway_config(["http://x:1"], prefix_affinity={"chunk_chars": 8})

replica_state = st.tuples(
    st.integers(0, 5000),  # inflight tokens
    st.integers(0, 40),  # inflight requests
    st.floats(0.1, 8.0),  # weight
    st.floats(0.0, 1.0),  # cpu utilisation
)


def _build(states: list[tuple[int, int, float, float]]) -> list[Replica]:
    reps = []
    for i, (tokens, n, weight, cpu) in enumerate(states):
        r = Replica.build(
            ReplicaConfig(url=f"http://r{i}:80", weight=weight),
            model="m", version="v1", health=_CFG.health, breaker=_CFG.breaker, clock=FakeClock(),
        )
        r.inflight_tokens, r.num_inflight = tokens, n
        r.load = ReplicaLoad(cpu_utilization=cpu)
        reps.append(r)
    return reps


@settings(max_examples=60, deadline=None)
@given(st.lists(replica_state, min_size=1, max_size=8), st.sampled_from(list(PolicyName)), st.text(max_size=80))
def test_every_policy_picks_one_of_the_candidates(states, name, prompt) -> None:
    reps = _build(states)
    policy = make_policy(name, _CFG, rng=random.Random(0))
    for _ in range(3):
        d = policy.choose(reps, RouteRequest("m", prompt, 10))
        assert d.replica in reps, f"{name.value} chose a replica outside the candidate list"


@settings(max_examples=60, deadline=None)
@given(st.lists(replica_state, min_size=1, max_size=8))
def test_least_load_never_picks_a_more_loaded_replica(states) -> None:
    reps = _build(states)
    d = make_policy("least_load", _CFG, rng=random.Random(1)).choose(reps, RouteRequest("m", "", 10))
    best = min(r.inflight_tokens / r.weight for r in reps)
    assert d.replica.inflight_tokens / d.replica.weight == best, "least_load must pick a minimum of tokens/weight"


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5))
def test_round_robin_is_exactly_fair_over_full_cycles(n, cycles) -> None:
    reps = _build([(0, 0, 1.0, 0.0)] * n)
    policy = make_policy("round_robin", _CFG)
    counts = Counter(policy.choose(reps, RouteRequest("m", "", 1)).replica.url for _ in range(n * cycles))
    assert set(counts.values()) == {cycles}, f"equal weights must share exactly: {counts}"
