"""Errors cross the ZeroMQ boundary as a typed ``EngineError`` and come back as the same class."""

from __future__ import annotations

import msgspec
import pytest

from sluice.engine.protocol import EngineError, EngineOutput
from sluice.errors import (
    ContextLengthError,
    InvalidRequestError,
    OverloadedError,
    ServiceUnavailableError,
    SluiceError,
)
from sluice.server.engine_client import engine_error


@pytest.mark.parametrize(
    "err",
    [ContextLengthError("prompt is 900 tokens, the limit is 512"), InvalidRequestError("top_p must be in (0, 1]", param="top_p"),
     OverloadedError("queue full", retry_after=2.5), ServiceUnavailableError("draining", retry_after=1.0)],
)  # fmt: skip
def test_an_engine_rejection_round_trips_through_msgpack_with_its_class(err: SluiceError) -> None:
    out = EngineOutput(request_id="r", new_token_ids=[], finished=True, error=EngineError.from_exception(err))
    back = engine_error(msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=EngineOutput))
    assert type(back) is type(err), "the rebuilt error must have the class (and so the HTTP status) of the original"
    assert (back.message, back.code, back.param) == (err.message, err.code, err.param)
    assert getattr(back, "retry_after", None) == getattr(err, "retry_after", None)
