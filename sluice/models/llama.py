"""The Llama-family forward pass, written for the paged engine.

One call handles a *flattened* variable-length batch: the prefill chunks and
decode tokens of many sequences are concatenated into ``T`` tokens with no
padding between them.  Attention reads and writes the paged KV cache through an
``AttentionBackend`` (sluice/engine/attention.py) using the metadata the model
runner builds (slot mapping, block tables, query start offsets).

Covers Llama 2/3 (llama3 rope scaling), SmolLM/SmolLM2, Mistral and Qwen2
(q/k/v bias): RMSNorm, rotary embeddings (HF "rotate half" layout), grouped-query
attention, SwiGLU MLP, optionally tied embeddings.

Weights are fused at load time: q/k/v into one ``qkv`` matrix and gate/up into
one ``gate_up`` matrix, so a layer runs 4 GEMMs over the whole batch.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from sluice.models.config import ModelConfig

__all__ = ["LlamaForCausalLM", "AttentionFn"]


class AttentionFn(Protocol):
    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # (T, num_heads, head_dim)
        k: torch.Tensor,  # (T, num_kv_heads, head_dim), new tokens only
        v: torch.Tensor,  # (T, num_kv_heads, head_dim)
    ) -> torch.Tensor:  # (T, num_heads, head_dim)
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # NOTE(numerics): normalise in float32 like HF, then scale in the serving dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (T, H, D); cos/sin: (T, 1, D) with the halves duplicated (HF layout)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.eps = cfg.rms_norm_eps

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_norm = p(h)
        self.post_attn_norm = p(h)
        self.qkv = p(self.q_size + 2 * self.kv_size, h)
        self.qkv_bias = p(self.q_size + 2 * self.kv_size) if cfg.attention_bias else None
        self.o_proj = p(h, self.q_size)
        self.gate_up = p(2 * cfg.intermediate_size, h)
        self.down = p(h, cfg.intermediate_size)

    def forward(
        self,
        idx: int,
        x: torch.Tensor,  # (T, hidden)
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
    ) -> torch.Tensor:
        t = x.shape[0]
        hs = rms_norm(x, self.input_norm, self.eps)
        qkv = F.linear(hs, self.qkv, self.qkv_bias)  # (T, q + 2kv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        attn = attention(idx, q, k, v).reshape(t, self.q_size)
        x = x + F.linear(attn, self.o_proj)
        hs = rms_norm(x, self.post_attn_norm, self.eps)
        gate, up = F.linear(hs, self.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down)


class LlamaForCausalLM(nn.Module):
    rope_cos: torch.Tensor  # (max_positions, head_dim), buffer
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, max_positions: int = 8192):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head: nn.Parameter | None = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        )
        self.max_positions = max_positions
        self.build_rope()

    def build_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables, e.g. after loading onto a meta-built model."""
        inv_freq = torch.tensor(self.cfg.rope_inv_freq(), dtype=torch.float32, device=device)
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, head_dim)
        self.register_buffer("rope_cos", emb.cos().to(self.dtype), persistent=False)
        self.register_buffer("rope_sin", emb.sin().to(self.dtype), persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64
        positions: torch.Tensor,  # (T,) int64
        attention: AttentionFn,
    ) -> torch.Tensor:  # (T, hidden), final-normed
        x = F.embedding(input_ids, self.embed)
        cos = self.rope_cos[positions].unsqueeze(1)  # (T, 1, D)
        sin = self.rope_sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(i, x, cos, sin, attention)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, vocab) fp32
        w = self.embed if self.lm_head is None else self.lm_head
        return F.linear(hidden, w).float()

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights (``model.layers.0.self_attn.q_proj.weight`` ...), fusing q/k/v and gate/up."""
        missing: list[str] = []

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = sd.get(name)
            if t is None and required:
                missing.append(name)
            return t

        def put(param: torch.Tensor, value: torch.Tensor | None, name: str) -> None:
            if value is None:
                return
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"weight {name}: shape {tuple(value.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(value.to(self.dtype))

        put(self.embed, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put(self.norm, take("model.norm.weight"), "model.norm.weight")
        if self.lm_head is not None:
            head = take("lm_head.weight", required=False)
            if head is None:  # some checkpoints tie without saying so
                head = sd.get("model.embed_tokens.weight")
            put(self.lm_head, head, "lm_head.weight")
        for i, module in enumerate(self.layers):
            layer = cast(DecoderLayer, module)
            pre = f"model.layers.{i}."
            put(layer.input_norm, take(pre + "input_layernorm.weight"), pre + "input_layernorm.weight")
            put(layer.post_attn_norm, take(pre + "post_attention_layernorm.weight"), pre + "post_attention_layernorm.weight")
            parts = [take(pre + f"self_attn.{n}_proj.weight") for n in "qkv"]
            if all(p is not None for p in parts):
                put(layer.qkv, torch.cat(parts, 0), pre + "self_attn.qkv")  # type: ignore[arg-type]
            if layer.qkv_bias is not None:
                biases = [take(pre + f"self_attn.{n}_proj.bias") for n in "qkv"]
                if all(b is not None for b in biases):
                    put(layer.qkv_bias, torch.cat(biases, 0), pre + "self_attn.qkv.bias")  # type: ignore[arg-type]
            put(layer.o_proj, take(pre + "self_attn.o_proj.weight"), pre + "self_attn.o_proj.weight")
            gu = [take(pre + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
            if all(g is not None for g in gu):
                put(layer.gate_up, torch.cat(gu, 0), pre + "mlp.gate_up")  # type: ignore[arg-type]
            put(layer.down, take(pre + "mlp.down_proj.weight"), pre + "mlp.down_proj.weight")
        if missing:
            shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            raise ValueError(f"missing weights: {shown}")

    def extra_repr(self) -> str:
        c: Any = self.cfg
        return f"arch={c.arch}, layers={c.num_layers}, hidden={c.hidden_size}, heads={c.num_heads}/{c.num_kv_heads}"
