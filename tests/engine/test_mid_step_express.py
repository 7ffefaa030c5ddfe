"""NOTE(mid-step-express): a P0 arriving while a step runs gets its first token from an
express step nested between two of that step's layers; nothing in flight is disturbed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import sluice.engine.core as core
from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineOutput, EngineRequest, SamplingParams
from sluice.engine.step_model import StepTimeModel
from sluice.engine.step_planner import EXPRESS_GAIN

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
P2_PROMPTS = {f"p2-{i}": [300 + 7 * i + j for j in range(9 + 3 * i)] for i in range(6)}
P0_PROMPTS = {"p0-a": [50 + j for j in range(12)], "p0-b": [90 + j for j in range(20)]}


def _engine(model: Path, **kw: object) -> EngineCore:
    args: dict[str, object] = {"model": str(model), "dtype": "float32", "kv_cache_memory": 8 << 20,
                               "max_num_batched_tokens": 512, "max_num_seqs": 16}  # fmt: skip
    args.update(kw)
    return EngineCore(**args)  # type: ignore[arg-type]


def _known_rates(engine: EngineCore) -> None:
    """A step-time model where an express step pays (the real steps' times vary with the machine)."""
    engine.step_model = StepTimeModel()
    for n, q in ((16, 16), (200, 4), (12, 12), (64, 2)) * 4:
        engine.step_model.observe(n, 0.002 + 0.0001 * n + 0.001 * q, q)  # 2 ms + 0.1 ms / token + 1 ms / seq


def _p0(rid: str) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=P0_PROMPTS[rid], sampling=GREEDY, priority=0, ttft_target=0.5)


def _run_to_end(engine: EngineCore, tokens: dict[str, list[int]], outputs: list[EngineOutput]) -> None:
    while engine.has_unfinished_requests():
        outputs += engine.step()
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)


def _reference(model: Path) -> dict[str, list[int]]:
    """Every request alone in an engine with nothing nested: the tokens each must get."""
    engine = _engine(model, express_mid_step=False)
    tokens: dict[str, list[int]] = {}
    for rid, prompt in P2_PROMPTS.items():
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, priority=2))
    for rid in P0_PROMPTS:
        engine.add_request(_p0(rid))
    _run_to_end(engine, tokens, [])
    return tokens


def test_a_p0_arriving_mid_step_gets_its_first_token_before_the_step_ends(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core, "MID_STEP_POLL_S", 0.0)  # look at every layer boundary
    expected = _reference(tiny_llama)
    engine = _engine(tiny_llama)
    for rid, prompt in P2_PROMPTS.items():
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, priority=2))
    outputs: list[EngineOutput] = []
    for _ in range(3):
        outputs += engine.step()
    _known_rates(engine)
    arrivals = [["p0-a", "p0-b"]]  # both come in during the first layer of the next step
    published: list[tuple[int, list[EngineOutput]]] = []  # (outer step number, outputs)
    polls = 0

    def take_arrivals() -> None:
        nonlocal polls
        polls += 1
        for rid in arrivals.pop() if arrivals else []:
            engine.add_request(_p0(rid))

    engine.set_arrivals(take_arrivals, lambda outs: published.append((engine.planner.num_steps, outs)))
    free_before = engine.block_manager.num_free_blocks
    tokens_before = engine.make_stats().num_batched_tokens_total
    step_outs = engine.step()
    assert polls >= 1 and engine.num_mid_step_express == 1, "the P0s ran nested in the decode step"
    stats = engine.make_stats()
    assert stats.num_batched_tokens == len(P2_PROMPTS), "the outer step: one decode per P2"
    assert stats.num_batched_tokens_total - tokens_before == len(P2_PROMPTS) + sum(map(len, P0_PROMPTS.values())), (
        "the work the engine did counts the nested step's prefills too (NOTE(work-rate) in admission)"
    )
    ((step_no, early),) = published
    assert step_no == 3 and sorted(o.request_id for o in early) == ["p0-a", "p0-b"], (
        "their first tokens were published while the fourth step was still running"
    )
    assert all(o.num_generated_tokens == 1 and len(o.new_token_ids) == 1 for o in early)
    assert sorted(o.request_id for o in step_outs) == sorted(P2_PROMPTS), "the outer step still decoded every P2"
    assert engine.block_manager.num_free_blocks < free_before, "the P0s hold blocks of their own"
    outputs += [o for _, outs in published for o in outs] + step_outs
    tokens: dict[str, list[int]] = {}
    _run_to_end(engine, tokens, outputs)
    assert tokens == expected, "nesting changes no request's tokens"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "no block leaks"


def test_no_nested_step_without_a_waiting_p0_or_past_the_express_share(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core, "MID_STEP_POLL_S", 0.0)
    engine = _engine(tiny_llama)
    for rid, prompt in P2_PROMPTS.items():
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, priority=2))
    engine.step()
    _known_rates(engine)
    published: list[list[EngineOutput]] = []
    engine.set_arrivals(lambda: None, published.append)
    engine.step()
    assert engine.num_mid_step_express == 0 and not published, "no P0 waiting: the step runs through"
    engine.planner.express_time = [0.75, 1.0]  # express steps took 75% of the recent time (EXPRESS_SHARE)
    engine.set_arrivals(lambda: engine.add_request(_p0("p0-a")) if not engine.scheduler.requests.get("p0-a") else None,
                        published.append)  # fmt: skip
    engine.step()
    assert engine.num_mid_step_express == 0 and not published, "express steps took their share: the P0 waits for the step"
    engine.planner.express_time = [0.0, 1.0]
    outs = engine.step()
    assert "p0-a" in {o.request_id for o in outs}, "at the next step boundary it starts as usual"


def test_a_nested_step_never_preempts_the_step_in_flight(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "MID_STEP_POLL_S", 0.0)
    engine = _engine(tiny_llama, max_num_seqs=6)  # every slot held by the six P2s
    for rid, prompt in P2_PROMPTS.items():
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, priority=2))
    engine.step()
    _known_rates(engine)
    published: list[list[EngineOutput]] = []
    engine.set_arrivals(lambda: engine.add_request(_p0("p0-a")) if "p0-a" not in engine.scheduler.requests else None,
                        published.append)  # fmt: skip
    outs = engine.step()
    assert not published and engine.num_mid_step_express == 0, "no free slot: nothing nested, nobody preempted mid-step"
    assert sorted(o.request_id for o in outs) == sorted(P2_PROMPTS) and engine.scheduler.num_preemptions == 0
    outs = engine.step()  # at the boundary the P0 takes a slot from a P2 (NOTE(take-from-lower))
    assert "p0-a" in {o.request_id for o in outs} and engine.scheduler.num_preemptions == 1


def test_mid_step_the_p0_nests_even_where_a_boundary_would_give_it_a_normal_step(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core, "MID_STEP_POLL_S", 0.0)
    engine = _engine(tiny_llama)
    engine.add_request(EngineRequest(request_id="p2-0", prompt_token_ids=P2_PROMPTS["p2-0"], sampling=GREEDY, priority=2))
    engine.step()
    _known_rates(engine)
    m, n = engine.step_model, len(P0_PROMPTS["p0-a"])
    assert m.predict(n + 1, 2) <= EXPRESS_GAIN * m.predict(n, 1), "at a boundary: a normal step (one decode beside it)"
    published: list[list[EngineOutput]] = []
    engine.set_arrivals(lambda: engine.add_request(_p0("p0-a")) if "p0-a" not in engine.scheduler.requests else None,
                        published.append)  # fmt: skip
    engine.step()
    assert engine.num_mid_step_express == 1 and [o.request_id for o in published[0]] == ["p0-a"], (
        "mid-step the alternative is the rest of the running step: it nests"
    )


def test_a_nested_steps_time_and_tokens_count_once_and_as_nested(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE(step-kinds) in core: the engine's time and tokens by kind of step, the nested step out of the normal one."""
    monkeypatch.setattr(core, "MID_STEP_POLL_S", 0.0)
    engine = _engine(tiny_llama)
    for rid, prompt in P2_PROMPTS.items():
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, priority=2))
    for _ in range(3):
        engine.step()
    before = engine.make_stats()
    assert before.steps_by_kind == [3, 0, 0] and before.busy_seconds_by_kind[1:] == [0.0, 0.0]
    assert before.batched_tokens_by_kind[0] == before.num_batched_tokens_total
    _known_rates(engine)
    arrivals = [["p0-a", "p0-b"]]

    def take_arrivals() -> None:
        for rid in arrivals.pop() if arrivals else []:
            engine.add_request(_p0(rid))

    engine.set_arrivals(take_arrivals, lambda outs: None)
    t0 = time.monotonic()
    engine.step()
    wall = time.monotonic() - t0
    s = engine.make_stats()
    assert s.steps_by_kind == [4, 0, 1], "one normal step, and one express step nested in it"
    assert s.batched_tokens_by_kind[2] == sum(map(len, P0_PROMPTS.values()))
    assert s.batched_tokens_by_kind[0] - before.batched_tokens_by_kind[0] == len(P2_PROMPTS), "the decodes only"
    assert sum(s.batched_tokens_by_kind) == s.num_batched_tokens_total
    normal = s.busy_seconds_by_kind[0] - before.busy_seconds_by_kind[0]
    nested = s.busy_seconds_by_kind[2]
    assert normal > 0.0 and nested > 0.0
    assert normal + nested <= wall, "the nested step's seconds are not counted in the normal step around it too"
