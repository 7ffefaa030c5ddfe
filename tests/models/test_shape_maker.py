"""The benchmark shape maker's MoE shape loads as llama.cpp would write it and serves its experts quantized."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import make_llama1b_gguf  # noqa: E402


def test_qwen3moe_shape_loads_with_quantized_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.models.attention import masked_attention
    from sluice.models.loader import load_model, resolve_model

    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    [path] = make_llama1b_gguf.main(["--shape", "qwen3moe-tiny", "--types", "q4_0", "--out", str(tmp_path)])
    shape = make_llama1b_gguf.SHAPES["qwen3moe-tiny"]
    model = load_model(resolve_model(str(path)), torch.float32, quantization="auto")
    cfg = model.cfg
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "qwen3_moe", shape.experts, shape.experts_used, shape.intermediate)
    assert cfg.norm_topk_prob, "qwen3moe renormalises its top-k (NOTE(gguf-moe-norm))"
    experts = [ex for layer in model.layers for ex in layer.moe.experts]
    assert len(experts) == shape.layers * shape.experts and all(ex.gate_up.is_quantized for ex in experts)
    att = lambda layer, q, k, v, **o: masked_attention(q, k, v, scale=cfg.head_dim**-0.5, **o)  # noqa: E731
    logits = model.compute_logits(model(torch.tensor([10, 20, 30]), torch.arange(3), att))
    assert logits.shape == (3, cfg.vocab_size) and torch.isfinite(logits).all()
    assert cfg.num_parameters(active=True) < cfg.num_parameters()


def test_the_qwen3moe_shape_is_qwen3_30b_a3b_with_fewer_layers() -> None:
    s = make_llama1b_gguf.SHAPES["qwen3moe"]
    assert (s.hidden, s.heads, s.kv_heads, s.head_dim, s.experts, s.intermediate, s.experts_used) == (
        2048, 32, 4, 128, 128, 768, 8)
