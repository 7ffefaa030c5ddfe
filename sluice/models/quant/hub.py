"""HuggingFace-hub quantized checkpoints (AWQ, GPTQ): detect, read the config, convert a state dict.

    quant_method(folder)                    -> 'awq' | 'gptq' | None  (its quantization config; sluice.models.formats)
    hub_state_dict(sd, qcfg, dequantize)    -> {'...q_proj.weight': QuantWeight | float32 tensor, ...}

The config is ``quantization_config`` in config.json (transformers / optimum /
AutoAWQ / GPTQModel), or the older AutoGPTQ ``quantize_config.json`` beside it.
A quantized linear ``P`` appears as ``P.qweight``, ``P.qzeros``, ``P.scales``
(and ``P.g_idx`` for GPTQ); it becomes ``P.weight``.  Every other tensor
(embeddings, norms, biases, layers left unquantized) comes back as float32.
"""

from __future__ import annotations

from typing import Any

import torch

from sluice.errors import ModelLoadError
from sluice.kernels.qweight import QuantWeight
from sluice.models.formats import HUB_METHODS, quant_method, read_quant_config
from sluice.models.quant.awq import awq_params, qweight_from_awq
from sluice.models.quant.gptq import dequantize_gptq, gptq_params, qweight_from_gptq

__all__ = ["read_quant_config", "quant_method", "hub_state_dict", "HUB_METHODS"]

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
