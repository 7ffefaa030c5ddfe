"""The offline API: prompts as text or ids, n > 1, stop strings, chat, streaming, priorities."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sluice import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), kv_cache_memory=8 << 20)


def test_generate_text_and_token_prompts(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a, b = llm.generate(["hello world", llm.tokenizer.encode("hello world")], sp)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    assert a.text == llm.tokenizer.decode(a.token_ids)
    assert a.finish_reason == "length"
    t = a.timings
    assert t is not None and t.arrival <= t.first_scheduled <= t.first_token <= t.finished  # type: ignore[operator]


def test_n_completions_differ_and_are_reproducible(llm: LLM) -> None:
    sp = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=10, ignore_eos=True)
    first = llm.generate("once upon", sp)[0]
    again = llm.generate("once upon", sp)[0]
    assert len(first.outputs) == 3
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1, "n samples should not all be identical"


def test_stop_string_cuts_the_text(llm: LLM) -> None:
    base = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    out = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[: base.text.index(stop)], "text ends right before the stop string"
    assert llm.engine.block_manager.num_used_blocks == 0, "stopping early frees the request's blocks"


def test_stream_yields_the_same_text(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    whole = llm.generate("stream me", sp)[0].text
    assert "".join(llm.stream("stream me", sp)) == whole


def test_chat_applies_template_and_priority_list(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "hi"}], sp)[0]
    expected = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=False)
    assert out.prompt_token_ids == expected
    outs = llm.generate(["a", "b"], sp, priority=["p0", "p2"])
    assert len(outs) == 2
    with pytest.raises(ValueError, match="invalid priority"):
        llm.generate(["a"], sp, priority="urgent")


def test_cli_generate_streams(tiny_llama: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "generate", "hello", "--model", str(tiny_llama), "--max-tokens", "6"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "the completion is printed"


def test_engine_leaves_ieee_subnormals_alone(llm: LLM) -> None:
    llm.generate("x", SamplingParams(max_tokens=2))
    tiny = torch.tensor([1e-40], dtype=torch.float32) * 1.0
    assert tiny.item() != 0.0, "flush-to-zero must not leak out of the engine's forward pass"
