"""HuggingFace-hub quantized checkpoints (AWQ, GPTQ): detect, read the config, convert a state dict.

    quant_method(folder)                    -> 'awq' | 'gptq' | None  (from its quantization config)
    hub_state_dict(sd, qcfg, dequantize)    -> {'...q_proj.weight': QuantWeight | float32 tensor, ...}

The config is ``quantization_config`` in config.json (transformers / optimum /
AutoAWQ / GPTQModel), or the older AutoGPTQ ``quantize_config.json`` beside it.
A quantized linear ``P`` appears as ``P.qweight``, ``P.qzeros``, ``P.scales``
(and ``P.g_idx`` for GPTQ); it becomes ``P.weight``.  Every other tensor
(embeddings, norms, biases, layers left unquantized) comes back as float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from sluice.errors import ModelLoadError
from sluice.kernels.qweight import QuantWeight
from sluice.models.quant.awq import awq_params, qweight_from_awq
from sluice.models.quant.gptq import dequantize_gptq, gptq_params, qweight_from_gptq

__all__ = ["read_quant_config", "quant_method", "hub_state_dict", "HUB_METHODS"]

HUB_METHODS = ("awq", "gptq")


def read_quant_config(folder: Path) -> dict[str, Any] | None:
    """The checkpoint's quantization config, or None for a float checkpoint."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    qcfg = cfg.get("quantization_config")
    if qcfg is None and (folder / "quantize_config.json").is_file():  # AutoGPTQ before transformers integration
        try:
            qcfg = {"quant_method": "gptq", **json.loads((folder / "quantize_config.json").read_text())}
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {folder / 'quantize_config.json'}: {e}") from e
    return qcfg if isinstance(qcfg, dict) else None


def quant_method(folder: Path) -> str | None:
    qcfg = read_quant_config(folder)
    if qcfg is None:
        return None
    method = str(qcfg.get("quant_method", "")).lower()
    if method not in HUB_METHODS:
        raise ModelLoadError(
            f"model {folder}: quantization method {method or '?'!r} is not supported "
            f"(supported: {', '.join(HUB_METHODS)}, GGUF files, or float checkpoints)"
        )
    return method


def hub_state_dict(
    sd: dict[str, torch.Tensor], qcfg: dict[str, Any], dequantize: bool = False
) -> dict[str, QuantWeight | torch.Tensor]:
    """Convert every ``P.qweight`` group of ``sd``; ``dequantize``: return exact float32 weights instead."""
    method = str(qcfg.get("quant_method", "")).lower()
    prefixes = sorted(k[: -len(".qweight")] for k in sd if k.endswith(".qweight"))
    if not prefixes:
        raise ModelLoadError(f"{method.upper()} checkpoint has no '.qweight' tensors")
    consumed: set[str] = set()
    out: dict[str, QuantWeight | torch.Tensor] = {}
    for p in prefixes:
        try:
            qw, qz, sc = sd[p + ".qweight"], sd[p + ".qzeros"], sd[p + ".scales"]
        except KeyError as e:
            raise ModelLoadError(f"{method.upper()} layer {p}: missing tensor {e}") from e
        consumed.update({p + ".qweight", p + ".qzeros", p + ".scales", p + ".g_idx"})
        if method == "awq":
            _, group = awq_params(qcfg)
            w: QuantWeight | torch.Tensor = qweight_from_awq(qw, qz, sc, group, p)
            out[p + ".weight"] = w.dequantize() if dequantize else w
        else:
            params = gptq_params(qcfg)
            g_idx = sd.get(p + ".g_idx")
            if dequantize:
                out[p + ".weight"] = dequantize_gptq(qw, qz, sc, g_idx, params, p)
            else:
                out[p + ".weight"] = qweight_from_gptq(qw, qz, sc, g_idx, params, p)
    for k, v in sd.items():
        if k not in consumed:
            out[k] = v.to(torch.float32)
    return out
