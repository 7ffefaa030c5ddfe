"""What a checkpoint holds, read from its files without torch.

    detect_format(source)                     -> 'gguf' | 'sluice' | 'awq' | 'gptq' | 'float'
    served_quantized(source, "auto")          -> True: the engine's linears will be quantized
    weights_bytes(source)                     -> the checkpoint's weight files, in bytes
    describe(source)                          -> {"architecture", "num_parameters", "num_active_parameters", ...}

The API process asks these before it starts its engine cores (NOTE(dp-auto) in
``sluice.server.lanes``), so they read only small files: config.json, the
sluice manifest, file sizes.  The loader (``sluice.models.quant``) uses the
same ``detect_format``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sluice.errors import ModelLoadError
from sluice.models.source import ModelSource

__all__ = [
    "HUB_METHODS", "MANIFEST", "detect_format", "is_sluice_checkpoint", "quant_method", "read_quant_config",
    "served_quantized", "weights_bytes", "describe",
]

HUB_METHODS = ("awq", "gptq")
MANIFEST = "sluice_quant.json"  # sluice's own quantized checkpoint (sluice.models.quant.checkpoint)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def is_sluice_checkpoint(folder: Path) -> bool:
    return folder.is_dir() and (folder / MANIFEST).is_file()


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


def detect_format(source: ModelSource) -> str:
    """'gguf' | 'sluice' | 'awq' | 'gptq' | 'float' (a fp32/fp16/bf16 HF checkpoint)."""
    if source.kind == "gguf":
        return "gguf"
    if is_sluice_checkpoint(source.path):
        return "sluice"
    return quant_method(source.path) or "float"


def served_quantized(source: ModelSource, quantization: str) -> bool:
    """Whether ``--quantization`` on this checkpoint serves its linears quantized (on sluice's kernels).

    A GGUF file counts as quantized: its tensor types are known only after parsing the whole header
    (~2 s for SmolLM2's vocabulary), and a float GGUF is rare; such a model is served by torch's
    threads, which the engine finds at its first step (NOTE(lane-lend) in ``sluice.server.lanes``)."""
    if quantization in ("int8", "int4"):
        return True
    if quantization == "none":
        return False
    try:
        return detect_format(source) != "float"
    except ModelLoadError:  # an unsupported method: the engine reports it at load
        return False


def weights_bytes(source: ModelSource) -> int:
    """The size of the checkpoint's weight files (a GGUF file, or a folder's tensor files)."""
    path = source.path
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())


def describe(source: ModelSource) -> dict[str, Any]:
    """What ``/v1/models`` and ``sluice doctor`` show of a checkpoint, without loading it: the
    architecture, the parameter count, the active parameters per token (MoE: the top-k experts)
    and the weight files' bytes.  A HF folder reads its config.json; a GGUF file its header (or the
    config the converted-weights cache kept).  A loaded model says the same and its served bytes
    (``LlamaForCausalLM.summary()``)."""
    from sluice.models.config import ModelConfig
    from sluice.models.files import load_model_config

    try:
        cfg = ModelConfig.from_hf(load_model_config(source))
    except (KeyError, ValueError, TypeError) as e:
        raise ModelLoadError(f"model {source.path}: bad config: {e}") from e
    return {
        "architecture": cfg.arch,
        "num_parameters": cfg.num_parameters(),
        "num_active_parameters": cfg.num_parameters(active=True),
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_tok,
        "weight_file_bytes": weights_bytes(source),
    }
