"""Llama with each ``rope_scaling`` HF configs use (llama3, linear, yarn, dynamic) equals transformers'
logits on a tiny random model; dynamic past its trained context keeps one rotation per position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from arch_factory import hf_model, make_arch_dir, reference_attention

from sluice.models.config import ModelConfig
from sluice.models.llama import rope_tables
from sluice.models.loader import load_model, resolve_model

SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 16,
                    "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}  # fmt: skip


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("name", list(SCALINGS))
def test_llama_rope_scaling_matches_transformers(tmp_path: Path, name: str) -> None:
    # 40 positions: past the 16-token original context of llama3/yarn; dynamic is compared inside its
    # trained context (64), where transformers does not rescale
    d = make_arch_dir(tmp_path / name, "llama", max_position_embeddings=64,
                      rope_parameters={"rope_theta": 10000.0, **SCALINGS[name]})  # fmt: skip
    model = load_model(resolve_model(str(d)), torch.float32)
    assert model.cfg.rope_scaling is not None and model.cfg.rope_scaling["rope_type"] == SCALINGS[name]["rope_type"]
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf_model(d)(ids[None]).logits[0]
    got = model.compute_logits(model(ids, torch.arange(40), reference_attention(model.cfg.head_dim**-0.5)))
    diff = (got - ref).abs().max().item()
    assert diff <= 1e-3, f"{name}: max |logit diff| {diff:.2e}"


def test_dynamic_rope_past_the_context_rotates_each_position_once() -> None:
    cfg = ModelConfig(arch="llama", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=16, max_position_embeddings=32,
                      rope_scaling={"rope_type": "dynamic", "factor": 2.0})  # fmt: skip
    plain = ModelConfig(**{**cfg.__dict__, "rope_scaling": None})
    cos, _ = rope_tables(cfg, 64)
    cos0, _ = rope_tables(plain, 64)
    assert torch.equal(cos[:32], cos0[:32]), "inside the trained context: the unscaled rotations"
    assert not torch.allclose(cos[40:], cos0[40:]), "past it: a larger base (NTK), slower rotations"
    assert torch.equal(rope_tables(cfg, 48)[0], cos[:48]), "a position's rotation does not depend on the table size"


def test_phi3_longrope_with_partial_rotary_matches_transformers(tmp_path: Path) -> None:
    # Phi-3.5/Phi-4-mini's layout: longrope factors over a rotary fraction of each head, inside the
    # trained context (32 here; NOTE(dynamic-rope) for past it)
    rot = int(16 * 0.75)
    g = torch.Generator().manual_seed(1)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 32,
            "short_factor": (1 + torch.rand(rot // 2, generator=g)).tolist(),
            "long_factor": (2 + 4 * torch.rand(rot // 2, generator=g)).tolist()}  # fmt: skip
    d = make_arch_dir(tmp_path / "phi3", "phi3", max_position_embeddings=128, original_max_position_embeddings=32,
                      rope_parameters=rope)
    model = load_model(resolve_model(str(d)), torch.float32)
    assert model.cfg.rotary_dim == rot and model.cfg.rope_attention_factor() > 1.0
    ids = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf_model(d)(ids[None]).logits[0]
    got = model.compute_logits(model(ids, torch.arange(30), reference_attention(model.cfg.head_dim**-0.5)))
    assert (got - ref).abs().max().item() <= 1e-3
    cos, _ = rope_tables(model.cfg, 64)
    short = ModelConfig(**{**model.cfg.__dict__, "max_position_embeddings": 32})
    assert not torch.allclose(cos[40:], rope_tables(short, 64)[0][40:]), "past the trained context: the long factors"


@pytest.mark.parametrize("name", ["llama3", "longrope"])
def test_gguf_rope_factor_tensors_equal_the_hf_folder(tmp_path: Path, name: str) -> None:
    """llama.cpp stores llama3 scaling as ``rope_freqs.weight`` and phi3's longrope as ``rope_factors_*``."""
    from arch_factory import write_arch_gguf

    if name == "llama3":
        d = make_arch_dir(tmp_path / name, "llama", max_position_embeddings=64,
                          rope_parameters={"rope_theta": 10000.0, **SCALINGS["llama3"]})  # fmt: skip
    else:
        g = torch.Generator().manual_seed(1)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                "short_factor": (1 + torch.rand(8, generator=g)).tolist(), "long_factor": (2 + torch.rand(8, generator=g)).tolist()}  # fmt: skip
        d = make_arch_dir(tmp_path / name, "phi3", max_position_embeddings=128, original_max_position_embeddings=32,
                          rope_parameters=rope)  # fmt: skip
    gguf_path = write_arch_gguf(d, tmp_path / f"{name}.gguf", "F32")
    ids = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(4))
    logits = []
    for src in (d, gguf_path):
        m = load_model(resolve_model(str(src)), torch.float32)
        logits.append(m.compute_logits(m(ids, torch.arange(30), reference_attention(m.cfg.head_dim**-0.5))))
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-4, f"{name}: the GGUF's rope factors give other logits"
