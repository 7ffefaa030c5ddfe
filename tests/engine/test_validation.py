"""The one request validation (engine core, fake engine core, server pre-check): limits and messages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice.engine.config import ModelInfo
from sluice.engine.protocol import SamplingParams
from sluice.engine.validation import validate_prompt, validate_request
from sluice.errors import ContextLengthError, InvalidRequestError


def _info(max_model_len: int = 64, vocab_size: int = 100, num_blocks: int = 16) -> ModelInfo:
    return ModelInfo(
        name="m", path="m", max_model_len=max_model_len, vocab_size=vocab_size, eos_token_ids=(1,),
        dtype="float32", device="cpu", num_blocks=num_blocks, block_size=16, attention_backend="torch",
    )


def test_a_request_within_every_limit_passes() -> None:
    validate_request([5] * 30, SamplingParams(max_tokens=34), _info(), priority=0)


@pytest.mark.parametrize(
    ("prompt", "error", "param", "message"),
    [
        ([], InvalidRequestError, "prompt", "prompt must not be empty"),
        ([5, 100], InvalidRequestError, "prompt", r"token ids must be in \[0, 100\), got 100"),
        ([-1, 5], InvalidRequestError, "prompt", "got -1"),
        ([5] * 64, ContextLengthError, "prompt", "maximum context length is 64 tokens; the prompt has 64"),
    ],
)
def test_bad_prompts_name_the_prompt(prompt: list[int], error: type, param: str, message: str) -> None:
    with pytest.raises(error, match=message) as e:
        validate_prompt(prompt, _info())
    assert e.value.param == param, "the error must name the offending parameter"


def test_prompt_plus_max_tokens_over_the_context_names_both_and_the_fix() -> None:
    with pytest.raises(ContextLengthError, match=r"plus max_tokens \(40\).*at most 34") as e:
        validate_request([5] * 30, SamplingParams(max_tokens=40), _info())
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"


def test_a_request_larger_than_the_whole_kv_cache_is_rejected() -> None:
    with pytest.raises(ContextLengthError, match="the KV cache holds 64 tokens"):
        validate_request([5] * 30, SamplingParams(max_tokens=40), _info(max_model_len=512, num_blocks=4))


def test_invalid_priority() -> None:
    with pytest.raises(InvalidRequestError, match="invalid priority 3") as e:
        validate_request([5], SamplingParams(), _info(), priority=3)
    assert e.value.param == "priority"


def test_sampling_values_are_checked_again() -> None:
    sp = SamplingParams()
    sp.top_p = 0.0  # e.g. a struct changed after construction
    with pytest.raises(InvalidRequestError, match="top_p"):
        validate_request([5], sp, _info())


def test_validation_imports_no_torch() -> None:
    code = "import sys, sluice.engine.validation, sluice.engine.stop; assert 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"the server imports these modules, so they must stay torch-free: {proc.stderr}"
