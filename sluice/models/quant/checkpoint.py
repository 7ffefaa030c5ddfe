"""sluice's own quantized checkpoint: the canonical tensors as safetensors plus a JSON manifest.

    save_quantized(out_dir, sd, raw_cfg, report, tokenizer_source)   # atomic: temp dir, then rename
    is_sluice_checkpoint(folder) / load_sluice_state_dict(folder)

    out_dir/
      config.json                 HF config of the model (no quantization_config)
      tokenizer.json ...          the source model's tokenizer, so the folder serves on its own
      model.quant.safetensors     QuantWeight P -> P.q (uint8), P.d, P.m (float32); floats as is
      sluice_quant.json           {"format": "sluice-quant", "version": 1,
                                   "quantized": {P: {bits, group_size, zero_point, source}}, "report": ...}

Loading it back gives the same ``QuantWeight`` objects bit for bit (quantization
``sluice``, detected from the manifest).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from sluice.errors import ModelLoadError
from sluice.kernels.qweight import QuantWeight
from sluice.models.formats import MANIFEST, is_sluice_checkpoint

__all__ = ["MANIFEST", "WEIGHTS", "save_quantized", "is_sluice_checkpoint", "load_sluice_state_dict"]

WEIGHTS = "model.quant.safetensors"
FORMAT, VERSION = "sluice-quant", 1


def save_quantized(
    out_dir: str | Path,
    sd: dict[str, QuantWeight | torch.Tensor],
    raw_cfg: dict[str, Any],
    report: dict[str, Any] | None = None,
    tokenizer_source: Any = None,
) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir).expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not is_sluice_checkpoint(out):
        raise ValueError(f"--out {out}: exists and is not a sluice quantized checkpoint; give a new or empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict[str, Any]] = {}
    for name, w in sd.items():
        if isinstance(w, QuantWeight):
            tensors[name + ".q"], tensors[name + ".d"], tensors[name + ".m"] = w.q.contiguous(), w.d.contiguous(), w.m.contiguous()
            quantized[name] = {"bits": w.bits, "group_size": w.group_size, "zero_point": w.zero_point, "source": w.source}
        else:
            tensors[name] = w.to(torch.float32).contiguous()
    cfg = {k: v for k, v in raw_cfg.items() if k != "quantization_config"}
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        save_file(tensors, str(tmp / WEIGHTS))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if tokenizer_source is not None:
            from sluice.models.tokenizer import load_tokenizer

            load_tokenizer(tokenizer_source).hf.save_pretrained(str(tmp))
        manifest = {"format": FORMAT, "version": VERSION, "quantized": quantized, "report": report or {}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
        if out.exists():  # replace an earlier sluice checkpoint: move it aside, swap, delete
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            os.replace(out, old / "x")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_sluice_state_dict(folder: Path) -> dict[str, QuantWeight | torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        tensors = load_file(str(folder / WEIGHTS))
    except (OSError, ValueError, SafetensorError) as e:
        raise ModelLoadError(f"cannot read sluice quantized checkpoint {folder}: {e}") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ModelLoadError(f"{folder / MANIFEST}: not a {FORMAT} v{VERSION} manifest")
    sd: dict[str, QuantWeight | torch.Tensor] = {}
    quantized: dict[str, dict[str, Any]] = manifest.get("quantized", {})
    for name, meta in quantized.items():
        try:
            sd[name] = QuantWeight(
                q=tensors.pop(name + ".q"),
                d=tensors.pop(name + ".d"),
                m=tensors.pop(name + ".m"),
                bits=int(meta["bits"]),
                group_size=int(meta["group_size"]),
                zero_point=int(meta["zero_point"]),
                source=str(meta.get("source", "")),
            )
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"sluice quantized checkpoint {folder}: tensor {name}: {e}") from e
    sd.update(tensors)
    return sd
