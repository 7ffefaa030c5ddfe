"""Simulation: 100 fake replicas with scripted capacities and failures, 10k requests.

No sockets: the gateway's own pool, routing policy, breakers, retry rule and
autoscaler decision run on a fake clock over a discrete-event model where each
replica serves any number of requests at once, each for ``SERVICE_S``.  With
``least_load`` (outstanding tokens per unit of weight, weight = capacity) a
replica's share of the traffic must be within 20% of its capacity's share;
breakers must isolate the failing replicas; the autoscaler's decisions must stay
inside their bounds and cooldowns.
"""

from __future__ import annotations

import heapq
import random

from sluice.gateway.autoscale import ScaleState, decide
from sluice.gateway.breaker import BreakerState
from sluice.gateway.config import AutoscaleConfig, DegradationConfig
from sluice.gateway.degradation import pressure
from sluice.gateway.policies import RouteRequest, make_policy
from sluice.gateway.pool import ReplicaPool
from sluice.gateway.replica import Replica
from tests.gateway.conftest import FakeClock, gateway_config

NUM_REPLICAS = 100
NUM_REQUESTS = 10_000
RATE = 100.0  # requests per second, evenly spaced
SERVICE_S = 8.0  # every request holds its replica this long (~800 in flight, ~3.5 per unit of weight)
TOKENS = 100  # outstanding tokens per request
FAIL_ALWAYS = set(range(0, 100, 20))  # 0, 20, 40, 60, 80: fail every request from the start
FAIL_LATER = set(range(10, 100, 20))  # 10, 30, 50, 70, 90: fail from FAIL_AT on
FAIL_AT = 40.0
CAPACITIES = [(1, 2, 4)[i % 3] for i in range(NUM_REPLICAS)]  # scripted: 1x, 2x, 4x replicas


def _failing(i: int, t: float) -> bool:
    return i in FAIL_ALWAYS or (i in FAIL_LATER and t >= FAIL_AT)


def test_100_replicas_10k_requests_spread_isolate_and_scale_within_bounds() -> None:
    clock = FakeClock(0.0)
    urls = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(NUM_REPLICAS)]
    replicas_cfg = [{"url": u, "weight": c, "capacity": 16 * c} for u, c in zip(urls, CAPACITIES, strict=True)]
    cfg = gateway_config(
        [],
        models={"m": {"versions": [{"name": "v1", "replicas": replicas_cfg}]}},
        policy="least_load",
        breaker={"window_s": 10.0, "min_requests": 5, "open_s": 5.0},
        retry={"max_attempts": 3},
    )
    pool = ReplicaPool(cfg, clock=clock, rng=random.Random(0))
    policy = make_policy(cfg.policy, cfg, rng=random.Random(1), clock=clock)
    index = {r.url: i for i, r in enumerate(pool.replicas())}
    version = pool.version("m", "v1")

    served = [0] * NUM_REPLICAS  # successful requests per replica
    attempts_after_trip = [0] * NUM_REPLICAS  # attempts a failing replica got after its first trip
    tripped_at: dict[int, float] = {}
    events: list[tuple[float, int, str, Replica | None]] = []  # (time, seq, kind, replica)
    seq = 0
    num_ok = num_failed_requests = 0

    scale_cfg = AutoscaleConfig(model_path="m", min_replicas=60, max_replicas=102, up_cooldown_s=30, down_cooldown_s=60)
    scale_state, desired, scale_changes = ScaleState(), NUM_REPLICAS, []
    load_cfg = DegradationConfig(tokens_per_replica=TOKENS * 5)
    next_scale_t = 0.0

    def dispatch(t: float) -> bool:
        """One client request with the gateway's retry rule; True when some replica served it."""
        nonlocal seq
        tried: set[str] = set()
        for _ in range(cfg.retry.max_attempts):
            candidates = [r for r in version.routable() if r.url not in tried]
            if not candidates:
                return False
            replica = policy.choose(candidates, RouteRequest("m", "", TOKENS)).replica
            tried.add(replica.url)
            i = index[replica.url]
            if i in tripped_at:
                attempts_after_trip[i] += 1
            replica.add_request(TOKENS)
            if _failing(i, t):  # fails fast, before the first byte: retried elsewhere
                replica.finish_request(TOKENS)
                replica.breaker.record(False, 0.01)
                if replica.breaker.state is BreakerState.OPEN and i not in tripped_at:
                    tripped_at[i] = t
                continue
            seq += 1
            heapq.heappush(events, (t + SERVICE_S, seq, "done", replica))
            served[i] += 1
            return True
        return False

    for n in range(NUM_REQUESTS):
        t = n / RATE
        while events and events[0][0] <= t:
            te, _, _, replica = heapq.heappop(events)
            clock.t = te
            assert replica is not None
            replica.finish_request(TOKENS)
            replica.breaker.record(True, SERVICE_S)
        clock.t = t
        if dispatch(t):
            num_ok += 1
        else:
            num_failed_requests += 1
        if t >= next_scale_t:
            # the autoscaler reads the same load figures as in the gateway; its decisions
            # are applied to a virtual replica count (the simulated fleet stays at 100)
            score = pressure(pool.model_load("m"), load_cfg).score * NUM_REPLICAS / desired
            d = decide(desired, score, t, scale_state, scale_cfg)
            if d.desired != desired:
                scale_changes.append((t, desired, d.desired))
            scale_state, desired = d.state, d.desired
            next_scale_t = t + 5.0

    assert num_ok / NUM_REQUESTS >= 0.999, (
        f"failures before the first byte must be retried on healthy replicas: {num_failed_requests} lost"
    )

    # --- routing spreads load within 20% of ideal -------------------------------------
    healthy = [i for i in range(NUM_REPLICAS) if i not in FAIL_ALWAYS | FAIL_LATER]
    total = sum(served[i] for i in healthy)
    cap_total = sum(CAPACITIES[i] for i in healthy)
    worst = max(abs(served[i] / (total * CAPACITIES[i] / cap_total) - 1) for i in healthy)
    assert worst <= 0.2, f"a healthy replica's share must be within 20% of its capacity's share, worst {worst:.1%}"

    # --- breakers isolate the failing replicas ----------------------------------------
    for i in FAIL_ALWAYS | FAIL_LATER:
        assert i in tripped_at, f"replica {i} fails every request: its breaker must open"
    late = [tripped_at[i] - FAIL_AT for i in FAIL_LATER]
    assert max(late) < cfg.breaker.window_s, f"a replica failing mid-run must be isolated within a window: {late}"
    leaked = sum(attempts_after_trip[i] for i in FAIL_ALWAYS | FAIL_LATER)
    assert leaked <= 0.01 * NUM_REQUESTS, (
        f"after tripping, failing replicas may see only half-open probes, not traffic: {leaked} attempts"
    )
    for i in FAIL_ALWAYS:
        assert served[i] == 0

    # --- autoscaler decisions within bounds and cooldowns -----------------------------
    assert all(scale_cfg.min_replicas <= to <= scale_cfg.max_replicas for _, _, to in scale_changes), scale_changes
    ups = [t for t, a, b in scale_changes if b > a]
    assert all(b - a >= scale_cfg.up_cooldown_s for a, b in zip(ups, ups[1:], strict=False)), scale_changes
    assert [to for _, _, to in scale_changes] == [101, 102], (
        f"an overloaded fleet (score ~1.8) must grow one step per cooldown and stop at max_replicas: {scale_changes}"
    )
