"""The engine on a CUDA device, against transformers on the same device (skipped where there is none).

``benchmarks/cuda_check.py``'s correctness protocol: 8 prompts with chunked prefill, 17 greedy
tokens each, the engine's logits at every step against transformers' full recomputation, and two
seeded sampled requests through every sampler path that must draw the same tokens.  It found two
CPU-only assumptions (NOTE(cuda-weights) in ``sluice/models/loader.py``: a checkpoint's Linears
stayed on the CPU; the sampler's random draws mixed CUDA tensors with CPU generators).  CI has no
GPU: this runs where one is (docs/engine.md, "The engine on CUDA").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_greedy_tokens_and_seeded_sampling_on_cuda(tiny_models: dict[str, Path], arch: str) -> None:
    from benchmarks.cuda_check import LOGIT_TOL, correctness

    r = correctness(tiny_models[arch], "cuda")
    assert r["tokens_equal"] == r["prompts"], r
    assert r["max_logit_diff"] <= LOGIT_TOL, r
    assert r["sampled_seeded_equal"], r
