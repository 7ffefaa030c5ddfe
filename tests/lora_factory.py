"""Random PEFT LoRA adapters for tests, and merged references.

    make_lora_dir(tmp / "a", cfg, targets=("q_proj", "v_proj"), rank=8, seed=1)
        -> Path with adapter_config.json + adapter_model.safetensors, as PEFT saves them
    merge_into_hf_dir(model_dir, [adapter_dir], out_dir)
        -> an HF model directory whose weights are W + s * B @ A (the merged reference)
    merge_into_model(llm.engine.runner.model, adapter_dir)
        -> the same merge in place on a float model already loaded (e.g. quantization="none")
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["make_lora_dir", "merge_into_hf_dir", "merge_into_model", "ALL_TARGETS", "shapes_of"]

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_GROUP = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


def shapes_of(cfg: Any) -> dict[str, tuple[int, int]]:
    """(out, in) per target for a ``sluice.models.config.ModelConfig``."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}  # fmt: skip


def make_lora_dir(
    path: str | Path,
    cfg: Any,
    *,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    rank: int = 8,
    alpha: float | None = None,
    seed: int = 0,
    std: float = 0.1,
    use_rslora: bool = False,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = shapes_of(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for t in targets:
            n_out, n_in = shapes[t]
            pre = f"base_model.model.model.layers.{layer}.{_GROUP[t]}.{t}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * std
            tensors[f"{pre}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    doc = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
           "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
           "use_rslora": use_rslora, "base_model_name_or_path": "test", **(config_overrides or {})}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(doc))
    return path


def merge_into_hf_dir(model_dir: str | Path, adapters: Sequence[str | Path], out_dir: str | Path) -> Path:
    """Copy an HF model directory with every adapter's ``s * B @ A`` added to its weights."""
    from safetensors.torch import load_file, save_file

    from sluice.models.config import ModelConfig
    from sluice.models.lora import lora_deltas

    model_dir, out = Path(model_dir), Path(out_dir)
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    sd = load_file(str(model_dir / "model.safetensors"))
    for adapter in adapters:
        for (layer, target), (a, b, s) in lora_deltas(adapter, cfg).items():
            name = f"model.layers.{layer}.{_GROUP[target]}.{target}.weight"
            sd[name] = (sd[name].double() + s * (b.double() @ a.double())).to(sd[name].dtype)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    from tests.model_factory import stable_mtimes

    stable_mtimes(out)  # one cache key for the same merged model run after run
    return out


def merge_into_model(model: Any, adapter_dir: str | Path) -> None:
    """Add an adapter's deltas to a loaded float model's dense weights, in place (a merged reference)."""
    import torch

    from sluice.kernels.linear import pack_fp32, unpack_fp32
    from sluice.models.lora import lora_deltas

    cfg = model.cfg
    shapes = shapes_of(cfg)
    seam_of = {"q_proj": ("qkv", 0), "k_proj": ("qkv", shapes["q_proj"][0]),
               "v_proj": ("qkv", shapes["q_proj"][0] + shapes["k_proj"][0]), "o_proj": ("o_proj", 0),
               "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", shapes["gate_proj"][0]), "down_proj": ("down", 0)}  # fmt: skip
    with torch.no_grad():
        for (layer, target), (a, b, s) in lora_deltas(adapter_dir, cfg).items():
            attr, row = seam_of[target]
            lin = getattr(model.layers[layer], attr)
            kinds = [k for k, _, _ in lin.parts]
            if kinds not in (["dense"], ["fp32"]):
                raise ValueError(f"merge_into_model needs a float model with one float part, got {kinds}")
            # a float32 model on the engine's float kernel holds its weight packed (NOTE(float-kernel))
            w = lin.dense_0 if kinds == ["dense"] else unpack_fp32(lin.f0_data, lin.out_features).clone()
            n = shapes[target][0]
            w[row : row + n] = (w[row : row + n].double() + s * (b.double() @ a.double())).to(w.dtype)
            if kinds == ["fp32"]:
                lin.f0_data.copy_(pack_fp32(w))
        for lin in model.linears().values():
            lin.prepare()


def dequantize_model(model: Any) -> None:
    """Replace every quantized linear of a loaded model by a float one holding its dequantized
    weights, in place: the float twin of a quantized model (the base of a merged reference)."""
    import torch

    from sluice.kernels.linear import make_linear

    with torch.no_grad():
        for name, lin in list(model.linears().items()):
            if not lin.is_quantized and all(k == "dense" for k, _, _ in lin.parts):
                continue
            w = torch.cat([lin.dense_weight(i).float() for i in range(len(lin.parts))])
            new = make_linear([w.to(model.dtype)], lin.bias)
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        model.prepare()
