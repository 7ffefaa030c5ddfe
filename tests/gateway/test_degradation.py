"""Graded degradation, pure parts: levels follow a scripted load on a fake clock
with hysteresis (no flapping), the max_tokens cap, shedding order and plans."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sluice.gateway.config import DegradationConfig, DegradationPolicyName
from sluice.gateway.degradation import (
    DegradationLevel,
    GradedDegradation,
    LevelState,
    NoDegradation,
    cap_max_tokens,
    make_degradation,
    pressure,
    should_shed,
    step_level,
)
from sluice.gateway.pool import ModelLoad
from sluice.types import Priority

L = DegradationLevel
CFG = DegradationConfig()


def _load(*, waiting: float = 0, tokens: int = 0, routable: int = 1, p95: float | None = None) -> ModelLoad:
    return ModelLoad(
        num_replicas=routable,
        num_routable=routable,
        num_waiting=waiting,
        num_running=0,
        num_inflight=0,
        inflight_tokens=tokens,
        p95_ttft_s=p95,
    )


def _run(script: list[tuple[float, float]], config: DegradationConfig = CFG, dt: float = 0.5) -> list[tuple[float, L]]:
    """Feed (duration_s, score) segments every ``dt``; returns (time, level) after each reading."""
    state, t, out = LevelState(), 0.0, []
    for duration, score in script:
        end = t + duration
        while t < end - 1e-9:
            state = step_level(state, score, t, config)
            out.append((t, state.level))
            t += dt
    return out


def _changes(trace: list[tuple[float, L]]) -> list[tuple[float, L]]:
    return [(t, lv) for i, (t, lv) in enumerate(trace) if i == 0 or trace[i - 1][1] != lv]


def test_levels_rise_one_by_one_under_sustained_overload_and_fall_back_in_reverse() -> None:
    trace = _run([(5, 0.3), (60, 1.6), (80, 0.2)])
    changes = _changes(trace)
    levels = [lv for _, lv in changes]
    assert levels == [L.NORMAL, L.CAP_TOKENS, L.FALLBACK, L.SHED, L.FALLBACK, L.CAP_TOKENS, L.NORMAL], (
        f"levels must climb 0-1-2-3 under overload and come down 3-2-1-0 after it: {changes}"
    )
    t1 = changes[1][0]
    assert t1 - 5 <= CFG.rise_s[0] + 0.5, f"level 1 must react within seconds, took {t1 - 5:.1f}s"
    t2 = changes[2][0]
    assert t2 - t1 >= CFG.rise_s[1], "level 2 needs tens of seconds of sustained overload"


def test_a_score_hovering_around_a_threshold_does_not_flap() -> None:
    # alternates just above enter[0] and just below it, but above exit[0]
    script = [(0.5, 0.85 if i % 2 else 0.75) for i in range(400)]
    trace = _run([(3, 0.9), *script])
    changes = _changes(trace)
    assert [lv for _, lv in changes] == [L.NORMAL, L.CAP_TOKENS], (
        f"once in level 1, a score between exit and enter must hold the level, not flap: {changes}"
    )


def test_short_spikes_do_not_raise_the_level() -> None:
    spikes = [(0.5, 1.5), (1.5, 0.3)] * 50  # half a second over, 1.5 s under
    trace = _run(spikes)
    assert all(lv is L.NORMAL for _, lv in trace), "spikes shorter than rise_s[0] must not degrade service"


def test_a_dip_during_overload_resets_the_rise_timer() -> None:
    trace = _run([(10, 1.1), (0.5, 0.5), (10, 1.1)])
    # level 1 after ~1 s; level 2 needs 15 s above enter[1] without a dip
    assert max(lv for _, lv in trace) is L.CAP_TOKENS, "a dip must restart the dwell time before level 2"


def test_pressure_is_the_worst_of_queue_tokens_and_ttft() -> None:
    p = pressure(_load(waiting=8, tokens=8192, routable=2, p95=3.0), CFG)
    assert p.queue == pytest.approx(0.5) and p.tokens == pytest.approx(0.25)
    assert p.ttft == pytest.approx(1.5) and p.score == pytest.approx(1.5), "p95 TTFT 3 s vs a 2 s contract is 1.5"
    assert pressure(_load(), CFG).score == 0.0
    assert pressure(_load(p95=9.0), CFG, p95_ttft_s=1.0).ttft == pytest.approx(0.5), "an explicit p95 wins"


@pytest.mark.parametrize(
    ("max_tokens", "load", "expected"),
    [(256, 0.0, 256), (256, 0.5, 128), (256, 0.8, 51), (256, 5.0, 51), (40, 0.9, 16), (10, 0.9, 10)],
)
def test_cap_formula(max_tokens: int, load: float, expected: int) -> None:
    assert cap_max_tokens(max_tokens, load, CFG) == expected, (
        "cap must be max(16, max_tokens * (1 - min(0.8, load))) and never raise the request's own max_tokens"
    )


def test_shedding_order_p2_then_p1_then_p0_only_when_alone() -> None:
    busy = {Priority.P0: 3, Priority.P1: 2, Priority.P2: 1}
    only_p0 = {Priority.P0: 5, Priority.P1: 0, Priority.P2: 0}
    assert not should_shed(L.FALLBACK, Priority.P2, 5.0, busy, CFG), "nothing is shed below level 3"
    assert should_shed(L.SHED, Priority.P2, 1.2, busy, CFG), "p2 goes first at level 3"
    assert not should_shed(L.SHED, Priority.P1, 1.2, busy, CFG), "p1 is kept while shedding p2 suffices"
    assert should_shed(L.SHED, Priority.P1, 1.6, busy, CFG), "p1 goes when the score passes shed_p1_score"
    assert not should_shed(L.SHED, Priority.P0, 3.0, busy, CFG), "p0 is never shed while p1/p2 are in flight"
    assert not should_shed(L.SHED, Priority.P0, 1.6, only_p0, CFG)
    assert should_shed(L.SHED, Priority.P0, 3.0, only_p0, CFG), "p0 goes only when nothing else is left"


def test_graded_policy_plans_by_level_and_reports_changes() -> None:
    t = [0.0]
    changes = []
    cfg = DegradationConfig(rise_s=(0.0, 0.0, 0.0), fall_s=0.0)
    pol = GradedDegradation(cfg, clock=lambda: t[0], on_change=changes.append)
    assert pol.plan("m", Priority.P2, 256, True).level is L.NORMAL
    overloaded = _load(tokens=int(0.9 * cfg.tokens_per_replica))  # score 0.9: level 1
    assert pol.observe("m", overloaded, None) is not None and pol.level("m") is L.CAP_TOKENS
    plan = pol.plan("m", Priority.P1, 256, True)
    assert plan.max_tokens is not None and 16 <= plan.max_tokens < 256, f"level 1 must cap max_tokens: {plan}"
    assert not plan.use_fallback and not plan.shed
    assert pol.plan("m", Priority.P1, None, True).max_tokens is None, "no max_tokens in the request: nothing to cap"
    t[0] += 1
    pol.observe("m", _load(tokens=int(1.1 * cfg.tokens_per_replica)), None)
    assert pol.level("m") is L.FALLBACK
    assert pol.plan("m", Priority.P1, 256, True).use_fallback, "level 2 moves p1 to the fallback"
    assert pol.plan("m", Priority.P2, 256, True).use_fallback, "level 2 moves p2 to the fallback"
    assert not pol.plan("m", Priority.P0, 256, True).use_fallback, "p0 keeps the primary at level 2"
    assert not pol.plan("m", Priority.P1, 256, False).use_fallback, "no fallback configured: stay"
    t[0] += 1
    pol.observe("m", _load(tokens=int(1.3 * cfg.tokens_per_replica)), None)
    assert pol.level("m") is L.SHED
    shed = pol.plan("m", Priority.P2, 256, True)
    assert shed.shed and shed.retry_after_s > 0, "level 3 sheds p2 with a Retry-After"
    assert not pol.plan("m", Priority.P0, 256, True).shed
    assert [c.new for c in changes] == [L.CAP_TOKENS, L.FALLBACK, L.SHED]
    assert "score" in changes[-1].reason and changes[-1].old is L.FALLBACK, "a change must say why"
    assert pol.level("other") is L.NORMAL, "levels are per model"


def test_p0_is_shed_only_when_no_lower_class_is_in_flight() -> None:
    cfg = DegradationConfig(rise_s=(0.0, 0.0, 0.0))
    pol = GradedDegradation(cfg, clock=lambda: 0.0)
    for _ in range(3):
        pol.observe("m", _load(tokens=int(3 * cfg.tokens_per_replica)), None)
    assert pol.level("m") is L.SHED
    pol.add_request("m", Priority.P2)
    assert not pol.plan("m", Priority.P0, 64, False).shed, "a p2 still in flight must protect p0"
    pol.finish_request("m", Priority.P2)
    assert pol.plan("m", Priority.P0, 64, False).shed


def test_off_policy_never_degrades_and_config_rejects_inverted_hysteresis() -> None:
    off = make_degradation(DegradationConfig(policy=DegradationPolicyName.OFF))
    assert isinstance(off, NoDegradation)
    assert off.observe("m", _load(tokens=10**9), None) is None and off.plan("m", Priority.P2, 99, True).level is L.NORMAL
    with pytest.raises(ValidationError, match="hysteresis"):
        DegradationConfig(enter=(0.8, 1.0, 1.2), exit=(0.9, 0.8, 1.0))
    with pytest.raises(ValidationError, match="rise"):
        DegradationConfig(enter=(1.0, 0.8, 1.2), exit=(0.5, 0.6, 1.0))


def test_too_few_ttft_samples_give_no_ttft_signal() -> None:
    from sluice.gateway.pool import ReplicaPool
    from tests.gateway.conftest import FakeClock, gateway_config

    clock = FakeClock()
    pool = ReplicaPool(gateway_config(["http://127.0.0.1:1"]), clock=clock)
    for s in (0.1, 0.1, 9.0):
        pool.record_ttft("m", s)
    assert pool.p95_ttft("m", window_s=10, min_samples=5) is None, "a p95 of 3 samples is just their max"
    for _ in range(2):
        pool.record_ttft("m", 0.1)
    assert pool.p95_ttft("m", window_s=10, min_samples=5) == 9.0
    clock.advance(11)
    assert pool.p95_ttft("m", window_s=10) is None, "samples older than the window do not count"
