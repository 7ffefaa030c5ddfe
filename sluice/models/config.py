"""Model architecture description shared by the loader and the forward pass.

One ``ModelConfig`` covers the Llama family we serve: Llama 2/3 (incl. llama3
rope scaling), SmolLM/SmolLM2, Mistral and Qwen2 (bias on q/k/v).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelConfig:
    arch: str  # 'llama' | 'mistral' | 'qwen2'
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            mt = cfg.get("model_type")
            if mt in ("llama", "mistral", "qwen2"):
                arch = mt
            else:
                raise ValueError(
                    f"unsupported architecture {archs or mt!r}: sluice serves "
                    f"{', '.join(SUPPORTED_ARCHITECTURES)}"
                )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = [int(e) for e in eos] if isinstance(eos, list) else ([int(eos)] if eos is not None else [])
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 layout
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def rope_inv_freq(self) -> list[float]:
        """Inverse frequencies, with llama3 / linear scaling applied when configured."""
        dim = self.head_dim
        inv = [1.0 / (self.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
        rs = self.rope_scaling
        if not rs:
            return inv
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "linear":
            f = float(rs["factor"])
            return [x / f for x in inv]
        if kind == "llama3":
            factor = float(rs["factor"])
            low = float(rs.get("low_freq_factor", 1.0))
            high = float(rs.get("high_freq_factor", 4.0))
            old_ctx = float(rs.get("original_max_position_embeddings", 8192))
            low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
            out = []
            for f in inv:
                wavelen = 2 * math.pi / f
                if wavelen < high_wavelen:
                    out.append(f)
                elif wavelen > low_wavelen:
                    out.append(f / factor)
                else:
                    smooth = (old_ctx / wavelen - low) / (high - low)
                    out.append((1 - smooth) * f / factor + smooth * f)
            return out
        raise ValueError(f"unsupported rope_scaling type {kind!r}: use linear or llama3")
