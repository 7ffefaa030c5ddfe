"""The engine's logits and greedy tokens equal HuggingFace transformers' on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.cuda_check import DECODE_STEPS, PROMPT_LENS, hf_reference, make_prompts
from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineRequest, SamplingParams


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_and_greedy_tokens_match_transformers(tiny_models: dict[str, Path], arch: str, backend: str) -> None:
    model_dir = tiny_models[arch]
    engine = EngineCore(
        model=str(model_dir),
        dtype="float32",
        attention_backend=backend,
        max_num_batched_tokens=64,  # forces chunked prefill of the 70- and 100-token prompts
        max_num_seqs=8,
        kv_cache_memory=4 << 20,
    )
    engine.runner.capture_logits = True
    prompts = make_prompts(engine.model_info.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p, sampling=params))

    got_logits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    got_tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    saw_chunked_step = False
    while engine.has_unfinished_requests():
        outs = engine.step()
        sampled = [o for o in outs if o.new_token_ids]
        if len(sampled) < 8 and any(len(v) == 0 for v in got_tokens.values()):
            saw_chunked_step = True
        assert engine.runner.last_logits is not None
        for row, o in enumerate(sampled):
            i = int(o.request_id)
            got_logits[i].append(engine.runner.last_logits[row])
            got_tokens[i].extend(o.new_token_ids)
    assert saw_chunked_step, "the token budget should have split some prefills over several steps"

    ref_logits, ref_tokens = hf_reference(model_dir, prompts)
    for i in range(len(prompts)):
        assert len(got_logits[i]) == DECODE_STEPS + 1
        for step, (a, b) in enumerate(zip(got_logits[i], ref_logits[i])):
            diff = (a - b).abs().max().item()
            assert diff <= 1e-3, f"prompt {i} (len {PROMPT_LENS[i]}) step {step}: max |logit diff| {diff:.2e} > 1e-3"
        assert got_tokens[i] == ref_tokens[i], f"prompt {i}: greedy tokens differ from transformers"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"


def test_bfloat16_logits_stay_close_to_float32(tiny_llama: Path) -> None:
    prompts = make_prompts(49152)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        engine = EngineCore(model=str(tiny_llama), dtype=dtype, kv_cache_memory=4 << 20)
        assert engine.model_info.dtype == dtype
        engine.runner.capture_logits = True
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p, sampling=params))
        engine.step()
        logits[dtype] = engine.runner.last_logits
    a, b = logits["float32"], logits["bfloat16"]
    assert a is not None and b is not None and torch.isfinite(b).all()
    rel = ((a - b).abs().max() / a.abs().max()).item()
    assert rel < 0.05, f"bf16 logits drift {rel:.3f} of the logit range from fp32"
    assert (a.argmax(-1) == b.argmax(-1)).all(), "bf16 should pick the same top token on peaked logits"


def test_cpu_default_dtype_is_float32(tiny_llama: Path) -> None:
    engine = EngineCore(model=str(tiny_llama), kv_cache_memory=1 << 20)
    assert engine.model_info.dtype == "float32", "fp32 is the CPU default (batch-invariant, see model_runner)"
