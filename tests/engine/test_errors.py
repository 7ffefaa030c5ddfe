"""Bad input gets a clear error type and message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineRequest, SamplingParams
from sluice.errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
)
from sluice.models.loader import resolve_model


@pytest.fixture(scope="module")
def small_ctx_engine(tiny_llama: Path) -> EngineCore:
    return EngineCore(model=str(tiny_llama), max_model_len=64, kv_cache_memory=2 << 20)


def test_prompt_filling_the_context_is_rejected_naming_the_limit(small_ctx_engine: EngineCore) -> None:
    with pytest.raises(ContextLengthError, match="maximum context length is 64 tokens; the prompt has 80"):
        small_ctx_engine.add_request(
            EngineRequest(request_id="long", prompt_token_ids=[5] * 80, sampling=SamplingParams())
        )


def test_prompt_plus_max_tokens_over_the_context_is_rejected(small_ctx_engine: EngineCore) -> None:
    with pytest.raises(ContextLengthError, match=r"plus max_tokens \(40\)"):
        small_ctx_engine.add_request(
            EngineRequest(request_id="l2", prompt_token_ids=[5] * 30, sampling=SamplingParams(max_tokens=40))
        )


def test_request_larger_than_the_whole_kv_cache_is_rejected_up_front(tiny_llama: Path) -> None:
    engine = EngineCore(model=str(tiny_llama), kv_cache_memory=4 * 2 * 2 * 16 * 2 * 16 * 4)  # 4 blocks
    assert engine.block_manager.num_blocks == 4
    with pytest.raises(ContextLengthError, match="the KV cache holds 64 tokens"):
        engine.add_request(EngineRequest(request_id="big", prompt_token_ids=[5] * 60, sampling=SamplingParams(max_tokens=10)))
    assert not engine.has_unfinished_requests()


def test_out_of_vocab_and_empty_prompts_are_rejected_without_trace(small_ctx_engine: EngineCore) -> None:
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        small_ctx_engine.add_request(EngineRequest(request_id="v", prompt_token_ids=[10**7], sampling=SamplingParams()))
    with pytest.raises(InvalidRequestError, match="empty"):
        small_ctx_engine.add_request(EngineRequest(request_id="e", prompt_token_ids=[], sampling=SamplingParams()))
    assert not small_ctx_engine.has_unfinished_requests(), "rejected requests must leave no trace"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"temperature": -0.5}, "temperature must be in"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": -3}, "top_k must be"),
        ({"min_p": 1.5}, "min_p must be in"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 50}, "logprobs must be in"),
        ({"n": 0}, "n must be >= 1"),
    ],
)
def test_bad_sampling_values_are_rejected_naming_the_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_unknown_model_path_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_corrupt_gguf_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        EngineCore(model=str(bad))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not a gguf file")
    with pytest.raises(ModelLoadError, match="cannot read GGUF file .*junk.gguf"):
        EngineCore(model=str(junk))


def test_cli_reports_one_readable_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "generate", "hi", "--model", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "not found" in lines[0], f"expected one readable error line, got: {proc.stderr!r}"
