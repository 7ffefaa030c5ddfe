"""Write a tiny HF Llama model as a GGUF file the way llama.cpp's converter does (names, q/k row
permutation, block-quantized matrices), for loader tests that need a whole GGUF model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py's q/k permutation (rotate-half -> interleaved rope)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, idx, rest = hf.split(".", 3)
    return f"blk.{idx}.{NAMES[rest]}"


def write_tiny_gguf(hf_dir: Path, path: Path, linear_type: str = "Q8_0", embed_type: str = "Q8_0") -> Path:
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    w = GGUFWriter(str(path), "llama")
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for key, val in {
        "llama.block_count": cfg["num_hidden_layers"],
        "llama.embedding_length": cfg["hidden_size"],
        "llama.feed_forward_length": cfg["intermediate_size"],
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv,
        "llama.context_length": cfg["max_position_embeddings"],
        "llama.vocab_size": cfg["vocab_size"],
    }.items():
        w.add_uint32(key, int(val))
    w.add_float32("llama.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    w.add_float32("llama.rope.freq_base", float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    for hf, arr in sd.items():
        arr = arr.astype(np.float32)
        if hf.endswith("q_proj.weight"):
            arr = permute(arr, heads)
        elif hf.endswith("k_proj.weight"):
            arr = permute(arr, kv)
        qtype = embed_type if hf in ("model.embed_tokens.weight", "lm_head.weight") else linear_type
        if arr.ndim == 2 and qtype != "F32":
            t = GGMLQuantizationType[qtype]
            w.add_tensor(gguf_name(hf), quants.quantize(arr, t), raw_dtype=t)
        else:
            w.add_tensor(gguf_name(hf), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
