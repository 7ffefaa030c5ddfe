"""Reading checkpoint files: GGUF metadata and tensors, HF safetensors and config.json.

An unreadable or corrupt file raises ``ModelLoadError`` naming the file and
what is wrong.  ``sluice.models.quant`` reads the same files without
dequantizing; ``sluice.models.loader`` builds the model from either.
"""

from __future__ import annotations

import json
import re
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
    "canonical_names",
]

# GGUF general.architecture (as llama.cpp writes it) -> the HF architecture; "llama" with experts is mixtral
_GGUF_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
_MODEL_TYPE = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
# NOTE(gguf-moe-norm): llama.cpp renormalises the top-k weights of qwen3moe and mixtral, not of olmoe
# (files that carry {arch}.expert_weights_norm say so themselves)
_GGUF_NORM_TOPK = {"qwen3moe": True, "llama": True, "olmoe": False}


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

    def opt(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    heads = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    layers = int(req("block_count"))
    rot = opt("rope.dimension_count")
    head_dim = int(opt("attention.key_length") or (rot if rot and arch != "phi3" else hidden // heads))
    vocab = opt("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens", []))
    experts = int(opt("expert_count", 0) or 0)
    hf_arch = "MixtralForCausalLM" if arch == "llama" and experts else _GGUF_ARCH[arch]
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": "mixtral" if hf_arch == "MixtralForCausalLM" else _MODEL_TYPE.get(arch, arch),
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(opt("feed_forward_length", 0) or 0),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(opt("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(opt("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(opt("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(opt("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        "_gguf": True,  # gemma: llama.cpp's converter already added the norms' +1 (ModelConfig.norm_offset)
    }
    if rot and int(rot) != head_dim:
        cfg["partial_rotary_factor"] = int(rot) / head_dim
    stype = opt("rope.scaling.type")
    factor = float(opt("rope.scaling.factor", 1.0) or 1.0)
    if stype == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif stype == "yarn":
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": factor,
                               "original_max_position_embeddings": int(opt("rope.scaling.original_context_length", 0) or cfg["max_position_embeddings"])}  # fmt: skip
    by_name = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in by_name:  # llama3 scaling as llama.cpp stores it: a divisor per frequency
        cfg["rope_scaling"] = {"rope_type": "freq_factors", "factors": _floats(by_name["rope_freqs.weight"])}
    if "rope_factors_long.weight" in by_name and "rope_factors_short.weight" in by_name:  # phi3 longrope
        cfg["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": _floats(by_name["rope_factors_long.weight"]),
            "short_factor": _floats(by_name["rope_factors_short.weight"]),
            "original_max_position_embeddings": int(opt("rope.scaling.original_context_length", 0) or 4096),
        }
        if opt("rope.scaling.attn_factor") is not None:
            cfg["rope_scaling"]["attention_factor"] = float(opt("rope.scaling.attn_factor"))
    if arch in ("gemma2", "gemma3"):
        # NOTE(gguf-gemma-scale): GGUF has no query_pre_attn_scalar; llama.cpp scales by hidden/heads for
        # the 27B models (46 and 62 layers) and by head_dim otherwise, and so do we
        big = layers == (46 if arch == "gemma2" else 62)
        cfg["query_pre_attn_scalar"] = hidden // heads if big else head_dim
        cfg["sliding_window"] = opt("attention.sliding_window")
        cfg["attn_logit_softcapping"] = opt("attn_logit_softcapping")
        cfg["final_logit_softcapping"] = opt("final_logit_softcapping")
        if arch == "gemma3":
            pattern = opt("attention.sliding_window_pattern", 6) or 6
            if isinstance(pattern, list):  # newer files: one flag per layer, true where the window applies
                cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
            else:
                cfg["sliding_window_pattern"] = int(pattern)
            cfg["rope_local_base_freq"] = float(opt("rope.freq_base_swa", 10000.0) or 10000.0)
    elif opt("attention.sliding_window"):
        cfg["sliding_window"] = opt("attention.sliding_window")
    if experts:
        cfg["num_experts"] = experts
        cfg["num_experts_per_tok"] = int(req("expert_used_count"))
        cfg["moe_intermediate_size"] = int(opt("expert_feed_forward_length", 0) or cfg["intermediate_size"])
        cfg["norm_topk_prob"] = bool(opt("expert_weights_norm", _GGUF_NORM_TOPK.get(arch, False)))
    return cfg


def _floats(tensor: Any) -> list[float]:
    import numpy as np

    return [float(x) for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    # (E, rows, cols) stacks of every expert's matrix: "{}" is the expert's index
    "ffn_gate_exps.weight": "mlp.experts.{}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{}.down_proj.weight",
}
_GGUF_ARCH_LAYER_NAMES = {
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},  # phi3's fused gate_up, as llama.cpp stores it
    "gemma2": {"post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
}  # fmt: skip
_GGUF_ARCH_LAYER_NAMES["gemma3"] = _GGUF_ARCH_LAYER_NAMES["gemma2"]


def gguf_hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor (``arch``: its general.architecture); expert stacks name ``{}``."""
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
    sub = _GGUF_ARCH_LAYER_NAMES.get(arch, {}).get(rest) or _GGUF_LAYER_NAMES.get(rest)
    old = _OLD_EXPERT.match(rest)
    if old is not None:  # older mixtral files: one 2D tensor per expert, blk.N.ffn_gate.E.weight
        sub = f"mlp.experts.{old[2]}.{old[1]}_proj.weight"
    return None if sub is None else f"model.layers.{idx}.{sub}"


_OLD_EXPERT = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")


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
    permute = cfg["model_type"] in ("llama", "mistral", "mixtral")
    arch = gguf_field(reader, "general.architecture", "llama")
    for t in reader.tensors:
        hf = gguf_hf_name(t.name, arch)
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
        if "{}" in hf:  # an expert stack (E, rows, cols): one matrix per expert
            sd.update({hf.format(e): torch.from_numpy(np.ascontiguousarray(arr[e])) for e in range(arr.shape[0])})
        else:
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
    return canonical_names(sd)


_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def canonical_names(sd: dict[str, Any]) -> dict[str, Any]:
    """HF names as the decoder reads them, whatever the checkpoint's layout:

    - mixtral's ``block_sparse_moe.gate`` / ``experts.N.w1|w3|w2`` -> ``mlp.gate`` / ``experts.N.gate|up|down_proj``;
    - experts stacked in 3D tensors (``mlp.experts.gate_up_proj`` (E, 2I, H), ``mlp.experts.down_proj`` (E, H, I),
      as transformers 5 holds them) -> one matrix per expert;
    - a multimodal gemma3's text decoder (``model.language_model.*``, ``language_model.model.*``) -> ``model.*``.
    """
    if not any(("experts" in k or "block_sparse_moe" in k or "language_model" in k) for k in sd):
        return sd
    out: dict[str, Any] = {}
    for k, v in sd.items():
        k = k.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
        if k.startswith("language_model.lm_head."):
            k = k.removeprefix("language_model.")
        k = k.replace(".block_sparse_moe.", ".mlp.")
        parts = k.split(".")
        if len(parts) > 3 and parts[-4] == "experts" and parts[-2] in _MIXTRAL_EXPERT:
            parts[-2] = _MIXTRAL_EXPERT[parts[-2]]
            k = ".".join(parts)
        if k.endswith("mlp.experts.gate_up_proj") and getattr(v, "dim", lambda: 0)() == 3:
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{k[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = v[e, :half].contiguous()
                out[f"{k[: -len('gate_up_proj')]}{e}.up_proj.weight"] = v[e, half:].contiguous()
            continue
        if k.endswith("mlp.experts.down_proj") and getattr(v, "dim", lambda: 0)() == 3:
            for e in range(v.shape[0]):
                out[f"{k[: -len('down_proj')]}{e}.down_proj.weight"] = v[e].contiguous()
            continue
        out[k] = v
    return out


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


