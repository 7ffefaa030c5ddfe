"""Tiny random models of every architecture, as HF folders (transformers' own classes) and as GGUF files
(written the way llama.cpp's converter writes them: its tensor names from the ``gguf`` package's own
name map, q/k rows permuted for llama-family models, gemma norms stored as w + 1, experts stacked in
3D tensors, block-quantized matrices).

    d = make_arch_dir(tmp, "qwen3")                     # config.json + model.safetensors
    g = write_arch_gguf(d, tmp / "m.gguf", "Q8_0")      # same weights
    ref = hf_logits(d, ids)                             # (T, vocab) from transformers
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["ARCHS", "make_arch_dir", "write_arch_gguf", "hf_model", "reference_attention"]

_BASE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "initializer_range": 0.2,
}

# arch -> (transformers config class, model class, GGUF arch, extra config)
ARCHS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "llama", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", "llama", {"sliding_window": 6}),  # every layer sliding
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", {"head_dim": 32}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "phi3", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "gemma2", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6, "tie_word_embeddings": True,
        "attn_logit_softcapping": 5.0, "final_logit_softcapping": 8.0, "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6, "num_hidden_layers": 6, "tie_word_embeddings": True,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3moe", {
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", "olmoe", {
        "num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "norm_topk_prob": False}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "llama", {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
}


# NOTE(router-scale): router logits of std ~ 8 over the normed hidden state: clear winners, so that
# fp32 rounding never flips a choice between sluice and transformers, while the top-k weights stay
# smooth enough that a quantized model's small activation error moves them only a little.
ROUTER_SCALE = 1.0


def make_arch_dir(path: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    import transformers

    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg_cls, model_cls, _, extra = ARCHS[arch]
    config = getattr(transformers, cfg_cls)(**{**_BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    with torch.no_grad():  # norms around 1 (gemma: around 0, stored as w - 1) so every layer matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if arch.startswith("gemma") else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "gate" in name and p.dim() == 2 and p.shape[0] == getattr(config, "num_experts", getattr(config, "num_local_experts", -1)):
                p.copy_(ROUTER_SCALE * torch.randn_like(p))  # NOTE(router-scale)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def reference_attention(scale: float) -> Any:
    """An ``AttentionFn`` for one sequence from position 0, with the options of models/attention.py."""
    from sluice.models.attention import masked_attention

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
        opts = {"scale": scale, **options}
        return masked_attention(q, k, v, **opts)

    return attend


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_arch_gguf(hf_dir: Path, path: Path, linear_type: str = "Q8_0", embed_type: str = "F32") -> Path:
    """The HF folder's weights as llama.cpp's converter would write them (see the module doc)."""
    from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map, quants
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    garch = ARCHS[model_type.removesuffix("_text")][2]
    sd = load_file(str(hf_dir / "model.safetensors"))
    n_layers = cfg["num_hidden_layers"]
    tmap = get_tensor_name_map(getattr(MODEL_ARCH, garch.upper()), n_layers)
    w = GGUFWriter(str(path), garch)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    u32 = {
        "block_count": n_layers, "embedding_length": cfg["hidden_size"], "attention.head_count": heads,
        "attention.head_count_kv": kv, "context_length": cfg["max_position_embeddings"], "vocab_size": cfg["vocab_size"],
        "attention.key_length": head_dim, "attention.value_length": head_dim,
        "rope.dimension_count": int(head_dim * ((cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0)),
    }
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        u32 |= {"expert_count": experts, "expert_used_count": cfg["num_experts_per_tok"]}
        if cfg.get("moe_intermediate_size"):
            u32["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    u32["feed_forward_length"] = cfg["intermediate_size"]
    if cfg.get("sliding_window"):
        u32["attention.sliding_window"] = cfg["sliding_window"]
    for key, val in u32.items():
        w.add_uint32(f"{garch}.{key}", int(val))
    w.add_float32(f"{garch}.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    rp = cfg.get("rope_parameters") or {}
    rp = rp.get("full_attention", rp)
    w.add_float32(f"{garch}.rope.freq_base", float(rp.get("rope_theta", 10000.0)))
    if rp.get("rope_type") == "linear":
        w.add_string(f"{garch}.rope.scaling.type", "linear")
        w.add_float32(f"{garch}.rope.scaling.factor", float(rp["factor"]))
    dim = u32["rope.dimension_count"]
    if rp.get("rope_type") == "llama3":  # llama.cpp's converter: a divisor per frequency, as a tensor
        w.add_tensor("rope_freqs.weight", _llama3_factors(rp, dim, float(rp.get("rope_theta", 10000.0))))
    if rp.get("rope_type") == "longrope":  # phi3's converter
        orig = int(cfg.get("original_max_position_embeddings") or rp["original_max_position_embeddings"])
        scale = cfg["max_position_embeddings"] / orig
        w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], np.float32))
        w.add_uint32(f"{garch}.rope.scaling.original_context_length", orig)
        w.add_float32(f"{garch}.rope.scaling.attn_factor", math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            w.add_float32(f"{garch}.{key}", float(cfg[key]))
    is_gemma = garch.startswith("gemma")

    stacks: dict[str, list[np.ndarray]] = {}
    for hf, arr in sd.items():
        arr = arr.astype(np.float32)
        if is_gemma and hf.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp's gemma converters store the norms' +1
        if garch == "llama" and hf.endswith("q_proj.weight"):
            arr = _permute(arr, heads)
        elif garch == "llama" and hf.endswith("k_proj.weight"):
            arr = _permute(arr, kv)
        hf = hf.replace("block_sparse_moe", "mlp").replace(".w1.", ".gate_proj.").replace(".w3.", ".up_proj.").replace(".w2.", ".down_proj.")
        parts = hf.split(".")
        if "experts" in parts:  # model.layers.L.mlp.experts.E.gate_proj.weight -> one 3D stack per layer and kind
            e = parts.index("experts")
            stacks.setdefault(".".join(parts[:e + 1] + parts[e + 2:]), []).append((int(parts[e + 1]), arr))  # type: ignore[arg-type]
            continue
        _add(w, tmap, hf, arr, embed_type if "embed" in hf or hf.startswith("lm_head") else linear_type, quants, GGMLQuantizationType)
    for name, items in stacks.items():
        arr = np.stack([a for _, a in sorted(items, key=lambda t: t[0])])
        _add(w, tmap, name, arr, linear_type, quants, GGMLQuantizationType)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama3_factors(rp: dict[str, Any], dim: int, base: float) -> np.ndarray:
    factor, low, high = float(rp["factor"]), float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0))
    old = float(rp.get("original_max_position_embeddings", 8192))
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _add(w: Any, tmap: Any, hf: str, arr: np.ndarray, qtype: str, quants: Any, types: Any) -> None:
    name = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise KeyError(f"gguf's name map has no tensor for {hf}")
    if arr.ndim >= 2 and qtype != "F32" and "norm" not in hf and not hf.endswith("mlp.gate.weight"):
        t = types[qtype]
        w.add_tensor(name, quants.quantize(arr, t), raw_dtype=t)
    else:
        w.add_tensor(name, arr)
