"""The new architectures through the engine: chunked prefills and decodes over the paged KV cache (both
attention backends) give transformers' logits and greedy tokens, past the sliding windows of gemma2 (interleaved) and mistral (every layer) too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from arch_factory import hf_model, make_arch_dir

from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineRequest, SamplingParams

PROMPT_LENS = [5, 17, 40]  # 40 > the 32-token budget: a chunked prefill; all > gemma2's window of 6
DECODE_STEPS = 6


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> tuple[list[list[torch.Tensor]], list[list[int]]]:
    hf = hf_model(model_dir)
    all_logits, all_tokens = [], []
    with torch.no_grad():
        for p in prompts:
            ids, steps, toks = list(p), [], []
            for _ in range(DECODE_STEPS + 1):
                logits = hf(torch.tensor([ids])).logits[0, -1]
                steps.append(logits)
                toks.append(int(logits.argmax()))
                ids.append(toks[-1])
            all_logits.append(steps)
            all_tokens.append(toks)
    return all_logits, all_tokens


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
@pytest.mark.parametrize("arch", ["gemma2", "mistral", "qwen3_moe"])
def test_engine_logits_and_greedy_tokens_match_transformers(tmp_path: Path, arch: str, backend: str) -> None:
    model_dir = make_arch_dir(tmp_path / arch, arch)
    engine = EngineCore(model=str(model_dir), dtype="float32", attention_backend=backend,
                        max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory=1 << 20)  # fmt: skip
    engine.runner.capture_logits = True
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p, sampling=params))
    got_logits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    got_tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.new_token_ids]
        assert engine.runner.last_logits is not None or not outs
        for row, o in enumerate(outs):
            got_logits[int(o.request_id)].append(engine.runner.last_logits[row])  # type: ignore[index]
            got_tokens[int(o.request_id)].extend(o.new_token_ids)
    ref_logits, ref_tokens = hf_greedy(model_dir, prompts)
    for i in range(len(prompts)):
        for step, (a, b) in enumerate(zip(got_logits[i], ref_logits[i])):
            diff = (a - b).abs().max().item()
            assert diff <= 1e-3, f"{arch} {backend} prompt {i} step {step}: max |logit diff| {diff:.2e}"
        assert got_tokens[i] == ref_tokens[i], f"{arch} {backend} prompt {i}: greedy tokens differ from transformers"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"
