"""Reading checkpoint files: GGUF metadata and tensors, HF safetensors and config.json.

An unreadable or corrupt file raises ``ModelLoadError`` naming the file and
what is wrong.  ``sluice.models.quant`` reads the same files without
dequantizing; ``sluice.models.loader`` builds the model from either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sluice.errors import ModelLoadError
from sluice.models.source import ModelSource, model_cache_root

__all__ = [
    "gguf_reader",
    "gguf_field",
    "gguf_hf_config",
    "gguf_hf_name",
    "unpermute",
    "load_gguf_state_dict",
    "load_hf_state_dict",
    "load_model_config",
]

_GGUF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def gguf_reader(path: Path) -> Any:
    try:
        import gguf

        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError / struct errors / IndexError on bad files
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e} (corrupt or truncated?)") from e


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:
        return default


def gguf_hf_config(reader: Any, path: Path) -> dict[str, Any]:
    arch = gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCH:
        raise ModelLoadError(f"GGUF file {path}: unsupported architecture {arch!r} (supported: {', '.join(_GGUF_ARCH)})")

    def req(key: str) -> Any:
        v = gguf_field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"GGUF file {path}: missing metadata key {arch}.{key}")
        return v

    names = {t.name for t in reader.tensors}
    heads = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    vocab = gguf_field(reader, f"{arch}.vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens", []))
    cfg: dict[str, Any] = {
        "architectures": [_GGUF_ARCH[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(gguf_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(gguf_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    }
    stype = gguf_field(reader, f"{arch}.rope.scaling.type")
    if stype == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(gguf_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    return cfg


def gguf_hf_name(name: str) -> str | None:
    table = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in table:
        return table[name]
    if not name.startswith("blk."):
        return None
    _, idx, rest = name.split(".", 2)
    sub = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }.get(rest)
    return None if sub is None else f"model.layers.{idx}.{sub}"


def unpermute(w: Any, n_head: int) -> Any:
    # NOTE(gguf-rope): llama.cpp's converter permutes q/k rows so that its
    # interleaved rope works; undo it to get HF's rotate-half layout.
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def load_gguf_state_dict(reader: Any, path: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    from gguf import quants

    sd: dict[str, Any] = {}
    permute = cfg["model_type"] in ("llama", "mistral")
    for t in reader.tensors:
        hf = gguf_hf_name(t.name)
        if hf is None:
            continue
        try:
            arr = quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"GGUF file {path}: cannot dequantize tensor {t.name} ({t.tensor_type.name}): {e}") from e
        arr = np.array(arr.reshape(tuple(reversed([int(x) for x in t.shape]))), dtype=np.float32)
        if permute and hf.endswith("q_proj.weight"):
            arr = unpermute(arr, cfg["num_attention_heads"])
        elif permute and hf.endswith("k_proj.weight"):
            arr = unpermute(arr, cfg["num_key_value_heads"])
        sd[hf] = torch.from_numpy(np.ascontiguousarray(arr))
    return sd


# ---------------------------------------------------------------- HF directory


def load_hf_state_dict(folder: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {folder} has no *.safetensors weights")
    sd: dict[str, Any] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read weights {f}: {e} (corrupt or truncated?)") from e
    return sd


def load_model_config(source: ModelSource) -> dict[str, Any]:
    """The HF-style config dict of a model (from config.json, or from GGUF metadata)."""
    if source.kind == "gguf":
        cfg_file = model_cache_root(source) / "config.json"
        if cfg_file.is_file():
            try:
                return json.loads(cfg_file.read_text())  # type: ignore[no-any-return]
            except (OSError, ValueError):
                pass
        return gguf_hf_config(gguf_reader(source.path), source.path)
    cfg_path = source.path / "config.json"
    try:
        return json.loads(cfg_path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e


