"""FakeEngineCore in-process: the real engine's request validation, and final outputs built like the engine's."""

from __future__ import annotations

import pytest

from sluice.engine.config import EngineConfig
from sluice.engine.protocol import EngineOutput, EngineRequest, SamplingParams
from sluice.engine.validation import validate_request
from sluice.errors import InvalidRequestError
from sluice.server.testing import EOS, FakeEngineCore


def _engine(**kw: object) -> FakeEngineCore:
    return FakeEngineCore(EngineConfig(model="fake"), **kw)  # type: ignore[arg-type]


def _drain(engine: FakeEngineCore) -> list[EngineOutput]:
    outs: list[EngineOutput] = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


@pytest.mark.parametrize(
    ("prompt", "sampling"),
    [
        ([], SamplingParams()),
        ([1, EOS + 1], SamplingParams()),
        ([1] * 512, SamplingParams()),
        ([1] * 500, SamplingParams(max_tokens=13)),
    ],
)
def test_rejects_exactly_what_the_engine_validation_rejects(prompt: list[int], sampling: SamplingParams) -> None:
    engine = _engine()
    with pytest.raises(InvalidRequestError) as expected:
        validate_request(prompt, sampling, engine.model_info)
    with pytest.raises(type(expected.value)) as got:
        engine.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt, sampling=sampling))
    assert (got.value.message, got.value.param) == (expected.value.message, expected.value.param)
    assert not engine.has_unfinished_requests(), "a rejected request leaves no trace"


def test_a_request_runs_to_max_tokens_with_timings() -> None:
    engine = _engine()
    engine.add_request(EngineRequest(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=3)))
    outs = _drain(engine)
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1]
    last = outs[-1]
    assert last.finished and last.finish_reason == "length" and last.num_generated_tokens == 3
    assert last.timings is not None and last.timings.finished is not None
    assert engine.num_free_blocks == engine.num_blocks, "a finished request frees its blocks"


def test_abort_gives_one_final_output_and_frees_the_blocks() -> None:
    engine = _engine()
    engine.add_request(EngineRequest(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=50)))
    engine.step()
    engine.abort(["r"])
    (out,) = _drain(engine)
    assert (out.request_id, out.new_token_ids, out.finished, out.finish_reason) == ("r", [], True, "abort")
    assert out.num_generated_tokens == 1 and out.timings is not None and out.timings.finished is not None
    assert engine.num_free_blocks == engine.num_blocks
