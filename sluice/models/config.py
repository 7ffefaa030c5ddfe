"""Model architecture description shared by the loader and the forward pass.

One ``ModelConfig`` covers every decoder sluice serves: one layer structure
with per-architecture options (see NOTE(arch-options)), read from a HF
``config.json`` (or the HF-style dict ``files.gguf_hf_config`` makes of a
GGUF's metadata).

    llama, mistral   RMSNorm, rotary, GQA, SwiGLU (llama3/linear/yarn/dynamic rope scaling)
    qwen2            + bias on q/k/v
    qwen3            + RMSNorm of q and k per head
    phi3             fused qkv and gate_up in the checkpoint, partial rotary, longrope
    gemma2, gemma3   norms stored as w - 1, GeGLU, embeddings scaled by sqrt(hidden),
                     sandwich norms, soft-capping, sliding-window layers between global ones
    qwen3_moe        qwen3 attention + mixture-of-experts MLP (softmax, top-k, renormalised)
    olmoe            q/k RMSNorm over all heads + MoE (softmax, top-k)
    mixtral          llama attention + MoE (top-k of the softmax, renormalised)
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
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text decoder (text_config) only
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "MixtralForCausalLM": "mixtral",
}
_MODEL_TYPES = {"gemma3_text": "gemma3", **{a: a for a in set(SUPPORTED_ARCHITECTURES.values())}}
_MOE = ("qwen3_moe", "olmoe", "mixtral")

# NOTE(arch-options): an architecture is a set of options on the one decoder
# (models/llama.py), not a class of its own: every option is tested against
# transformers' own model class on a tiny random model (tests/models/test_archs.py).


@dataclass
class ModelConfig:
    arch: str  # a value of SUPPORTED_ARCHITECTURES
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
    # ---- per-architecture options (NOTE(arch-options)); the defaults are Llama's
    qk_norm: str = "none"  # 'none' | 'head' (RMSNorm over head_dim: qwen3, gemma3) | 'all' (over all heads: olmoe)
    norm_offset: bool = False  # gemma: HF checkpoints store RMSNorm weights as w - 1 (GGUF files already hold w)
    sandwich_norms: bool = False  # gemma2/3: norms on the attention and MLP outputs too (pre/post feedforward)
    hidden_act: str = "silu"  # 'silu' (SwiGLU) | 'gelu_tanh' (GeGLU)
    embed_scale: float = 1.0  # gemma: sqrt(hidden)
    attn_softcap: float | None = None  # gemma2: cap * tanh(scores / cap)
    final_softcap: float | None = None  # gemma2: the same on the logits
    query_scale: float | None = None  # attention score scale; None: head_dim ** -0.5
    clip_qkv: float | None = None  # olmoe: clamp q/k/v to [-c, c]
    sliding_window: int | None = None  # keys at distance < window are seen, in the layers marked sliding
    layer_types: list[str] = field(default_factory=list)  # per layer 'full_attention' | 'sliding_attention'
    rope_local_theta: float | None = None  # gemma3: sliding layers' rope base (and no scaling)
    partial_rotary_factor: float = 1.0  # phi3/phi4-mini: rotary over the first fraction of head_dim
    # ---- mixture of experts (num_experts 0: a dense MLP in every layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    moe_layers: list[bool] = field(default_factory=list)  # per layer: MoE (True) or dense MLP

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = _MODEL_TYPES.get(cfg.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: sluice serves "
                f"{', '.join(sorted(set(SUPPORTED_ARCHITECTURES.values())))}"
            )
        if isinstance(cfg.get("text_config"), dict):  # Gemma3ForConditionalGeneration: the text decoder
            outer = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "model_type")}
            cfg = {**outer, **cfg["text_config"], "architectures": archs}
        num_heads = int(_req(cfg, "num_attention_heads"))
        hidden = int(_req(cfg, "hidden_size"))
        eos = cfg.get("eos_token_id")
        eos_ids = [int(e) for e in eos] if isinstance(eos, list) else ([int(eos)] if eos is not None else [])
        rope_theta, rope_scaling, local_theta, partial = _rope(cfg, arch)
        num_layers = int(_req(cfg, "num_hidden_layers"))
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        is_gemma = arch in ("gemma2", "gemma3")
        out = cls(
            arch=arch,
            vocab_size=int(_req(cfg, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", is_gemma)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm={"qwen3": "head", "qwen3_moe": "head", "gemma3": "head", "olmoe": "all"}.get(arch, "none"),
            norm_offset=is_gemma and not cfg.get("_gguf", False),
            sandwich_norms=is_gemma,
            hidden_act="gelu_tanh" if is_gemma else "silu",
            embed_scale=math.sqrt(hidden) if is_gemma else 1.0,
            attn_softcap=_opt_float(cfg.get("attn_logit_softcapping")) if arch == "gemma2" else None,
            final_softcap=_opt_float(cfg.get("final_logit_softcapping")) if is_gemma else None,
            query_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5 if is_gemma else None,
            clip_qkv=_opt_float(cfg.get("clip_qkv")),
            rope_local_theta=local_theta,
            partial_rotary_factor=partial,
        )
        out._set_windows(cfg)
        if arch in _MOE:
            out._set_moe(cfg)
        return out

    def _set_windows(self, cfg: dict[str, Any]) -> None:
        window = cfg.get("sliding_window")
        if self.arch in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            window = None  # their configs name a window they do not use
        types = cfg.get("layer_types")
        if not window:
            self.layer_types = ["full_attention"] * self.num_layers
            return
        if not types:
            every = {"gemma2": 2, "gemma3": int(cfg.get("sliding_window_pattern") or 6)}.get(self.arch)
            if every is not None:  # HF's own defaults: the every-th layer is global
                types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(self.num_layers)]
            elif self.arch in ("qwen2", "qwen3", "qwen3_moe"):
                first = int(cfg.get("max_window_layers") or 0)
                types = ["sliding_attention" if i >= first else "full_attention" for i in range(self.num_layers)]
            else:  # mistral, phi3, mixtral: every layer
                types = ["sliding_attention"] * self.num_layers
        if len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries, expected num_hidden_layers={self.num_layers}")
        self.sliding_window, self.layer_types = int(window), [str(t) for t in types]

    def _set_moe(self, cfg: dict[str, Any]) -> None:
        n = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        k = int(cfg.get("num_experts_per_tok") or 0)
        if n <= 0 or not 0 < k <= n:
            raise ValueError(f"{self.arch}: num_experts={n} and num_experts_per_tok={k} do not make a mixture of experts")
        self.num_experts, self.num_experts_per_tok = n, k
        self.moe_intermediate_size = int(cfg.get("moe_intermediate_size") or self.intermediate_size)
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", self.arch == "mixtral")) or self.arch == "mixtral"
        dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
        step = int(cfg.get("decoder_sparse_step") or 1)
        self.moe_layers = [i not in dense and (i + 1) % step == 0 for i in range(self.num_layers)]

    # ---------------------------------------------------------------- per layer

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window) and self.layer_types[layer] == "sliding_attention"

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_plain(self) -> bool:
        """The Llama layer exactly: what the fused C++ layer ops (ops.cpp attn_in / mlp) compute."""
        return (self.qk_norm == "none" and not self.sandwich_norms and self.hidden_act == "silu"
                and self.attn_softcap is None and self.query_scale is None and self.clip_qkv is None
                and self.rotary_dim == self.head_dim)  # fmt: skip

    # ---------------------------------------------------------------- sizes

    def num_parameters(self, active: bool = False) -> int:
        """Weights of the model; ``active``: those one token runs through (top-k experts of each MoE layer)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        norms = h * (4 if self.sandwich_norms else 2)
        norms += {"head": 2 * self.head_dim, "all": q + kv}.get(self.qk_norm, 0)
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.attention_bias else 0)
        for i in range(self.num_layers):
            if self.is_moe(i):
                experts = self.num_experts_per_tok if active else self.num_experts
                mlp = self.num_experts * h + experts * 3 * h * self.moe_intermediate_size
            else:
                mlp = 3 * h * self.intermediate_size
            total += norms + attn + mlp
        return total

    # ---------------------------------------------------------------- rotary

    def rope_inv_freq(self, local: bool = False) -> list[float]:
        """Inverse frequencies over ``rotary_dim``, with the configured scaling applied
        (``local``: gemma3's sliding layers, their own base and no scaling)."""
        dim = self.rotary_dim
        theta = self.rope_local_theta if local and self.rope_local_theta else self.rope_theta
        inv = [1.0 / (theta ** (i / dim)) for i in range(0, dim, 2)]
        rs = None if local else self.rope_scaling
        if not rs:
            return inv
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "linear":
            f = float(rs["factor"])
            return [x / f for x in inv]
        if kind == "llama3":
            return _llama3(inv, rs)
        if kind == "freq_factors":  # a GGUF's rope_freqs tensor (llama.cpp's form of llama3 scaling)
            if len(rs["factors"]) != len(inv):
                raise ValueError(f"rope_freqs has {len(rs['factors'])} factors, expected rotary_dim/2 = {len(inv)}")
            return [x / float(f) for x, f in zip(inv, rs["factors"])]
        if kind == "yarn":
            return _yarn(inv, rs, dim, theta, self.max_position_embeddings)
        if kind == "dynamic":
            return inv  # NOTE(dynamic-rope): scaled per position past the trained context, see rope_tables
        if kind == "longrope":  # phi3: the short factors inside the trained context (long ones: rope_tables)
            return self.longrope_inv_freq("short_factor")
        raise ValueError(f"unsupported rope_scaling type {kind!r}: use linear, llama3, yarn, dynamic or longrope")

    def longrope_inv_freq(self, which: str) -> list[float]:
        rs = self.rope_scaling or {}
        factors = [float(f) for f in rs[which]]
        dim = self.rotary_dim
        if len(factors) != dim // 2:
            raise ValueError(f"rope_scaling.{which} has {len(factors)} factors, expected rotary_dim/2 = {dim // 2}")
        return [1.0 / (f * self.rope_theta ** (i / dim)) for f, i in zip(factors, range(0, dim, 2))]

    def rope_original_context(self) -> int:
        rs = self.rope_scaling or {}
        return int(rs.get("original_max_position_embeddings") or self.max_position_embeddings)

    def rope_attention_factor(self) -> float:
        """yarn's and longrope's cos/sin multiplier (1.0 otherwise)."""
        rs = self.rope_scaling
        kind = rs.get("rope_type", rs.get("type")) if rs else None
        if rs and kind == "longrope":
            if rs.get("attention_factor") is not None:
                return float(rs["attention_factor"])
            factor = float(rs.get("factor") or self.max_position_embeddings / self.rope_original_context())
            return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.rope_original_context()))
        if not rs or kind != "yarn":
            return 1.0
        if rs.get("attention_factor") is not None:
            return float(rs["attention_factor"])
        factor = float(rs["factor"])
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all:
            return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
        return _yarn_mscale(factor)


def _req(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"config field {key!r} is missing")
    return cfg[key]


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _rope(cfg: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None, float | None, float]:
    """(theta, scaling, gemma3's local theta, partial rotary factor) from either config layout
    (transformers < 5: rope_theta / rope_scaling; >= 5: rope_parameters, per layer type for gemma3)."""
    rope_theta = cfg.get("rope_theta")
    rope_scaling = cfg.get("rope_scaling")
    local_theta = cfg.get("rope_local_base_freq")
    partial = float(cfg.get("partial_rotary_factor") or 1.0)
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        if isinstance(params.get("full_attention"), dict):  # per layer type (gemma3)
            local = params.get("sliding_attention") or {}
            local_theta = local.get("rope_theta", local_theta)
            params = params["full_attention"]
        rope_theta = params.get("rope_theta", rope_theta)
        partial = float(params.get("partial_rotary_factor") or partial)
        if params.get("rope_type", "default") != "default":
            rope_scaling = params
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        rope_scaling = None
    if rope_scaling and cfg.get("original_max_position_embeddings") and "original_max_position_embeddings" not in rope_scaling:
        rope_scaling = {**rope_scaling, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    if arch == "gemma3":
        rope_theta = rope_theta or 1_000_000.0
        local_theta = float(local_theta or 10_000.0)
    else:
        local_theta = None
    return float(rope_theta or 10000.0), rope_scaling, local_theta, partial


def _llama3(inv: list[float], rs: dict[str, Any]) -> list[float]:
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(inv: list[float], rs: dict[str, Any], dim: int, base: float, max_pos: int) -> list[float]:
    """transformers' ``_compute_yarn_parameters``: interpolate the low frequencies, keep the high ones."""
    factor = float(rs["factor"])
    old_ctx = float(rs.get("original_max_position_embeddings") or max_pos)
    beta_fast, beta_slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)
    truncate = bool(rs.get("truncate", True))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(inv):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation = 1 - ramp
        out.append((f / factor) * (1 - extrapolation) + f * extrapolation)
    return out
