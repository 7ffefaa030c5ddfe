"""Checkpoints -> quantized weights in the canonical ``QuantWeight`` form, with per-layer fallback.

    sd, report = load_quantized_weights(resolve_model("smollm2"), quantization="auto", fallback="auto")
    sd["model.layers.0.self_attn.q_proj.weight"]  -> QuantWeight (gguf:Q4_1)
    sd["model.norm.weight"]                        -> float32 tensor

``quantization`` (the ``--quantization`` flag):

    auto    what the checkpoint holds: GGUF block types as they are, AWQ/GPTQ as they
            are, a sluice quantized checkpoint as it is; float HF checkpoints stay float
    none    everything float32: the exact dequantized reference of the same weights
    int8    round-to-nearest at load from the float (or dequantized) weights,
    int4      group-wise (``group_size``, default 32), per-layer fallback applies
    gguf    like auto, but requires a GGUF file
    awq, gptq, sluice   like auto, but require that checkpoint format

``fallback`` (``--quant-fallback``): ``auto`` | ``none`` | ``PATTERN,...`` (see fallback.py).
Embeddings and the LM head are quantized for int8 and stay float32 for int4 (``quantize_head`` overrides).

The report: ``{"format", "quantization", "fallback", "layers": {name: {"shape", "precision",
"error", "bytes", "reason"}}, "totals": {...}, "model_error": {...} | None}``.

Modules: gguf.py, awq.py, gptq.py, hub.py (AWQ/GPTQ state dicts), rtn.py,
calibrate.py (reference model, per-layer error, KL), fallback.py (policy),
checkpoint.py (sluice's own format).  Only ``sluice.kernels.qweight`` is
imported from the kernels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.errors import ConfigError
from sluice.kernels.qweight import QuantWeight
from sluice.models.formats import detect_format
from sluice.models.quant.calibrate import CALIBRATION_TOKENS, english_text
from sluice.models.quant.fallback import (
    DEFAULT_KL_BOUND,
    FallbackSpec,
    choose_fallback,
    parse_fallback,
)
from sluice.models.quant.rtn import quantize_rtn
from sluice.models.source import ModelSource, cache_dir, file_digest

__all__ = [
    "QUANTIZATION_MODES",
    "QuantWeight",
    "load_quantized_weights",
    "detect_format",
    "parse_fallback",
    "is_linear_weight",
]

log = logging.getLogger("sluice.models.quant")

QUANTIZATION_MODES = ("auto", "none", "int8", "int4", "gguf", "awq", "gptq", "sluice")
_NATIVE = ("auto", "gguf", "awq", "gptq", "sluice")
_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.([qkvo]|qkv)_proj|mlp\.(experts\.\d+\.)?(gate|up|down|gate_up)_proj)\.weight$"
)
_CACHE_VERSION = 2  # 2: choices made before NOTE(ref-owns) measured against a reference their own search had changed


def is_linear_weight(name: str) -> bool:
    """A decoder-layer linear's weight (q/k/v/o or qkv, gate/up/down or gate_up, an expert's): the fallback
    candidates.  MoE routers (``mlp.gate.weight``) stay float."""
    return bool(_LINEAR.match(name))


def _dense(w: QuantWeight | torch.Tensor) -> torch.Tensor:
    return w.dequantize() if isinstance(w, QuantWeight) else w.to(torch.float32)


def _read_native(source: ModelSource, fmt: str, dequantize: bool) -> tuple[dict[str, Any], dict[str, QuantWeight | torch.Tensor]]:
    """(HF config, HF-named state dict) of the checkpoint, quantized tensors kept as ``QuantWeight``
    (or exact float32 when ``dequantize``; act-order GPTQ can only be read that way)."""
    from sluice.models.files import (
        gguf_hf_config,
        load_hf_state_dict,
        load_model_config,
    )
    from sluice.models.files import gguf_reader as _gguf_reader

    if fmt == "gguf":
        from sluice.models.quant.gguf import gguf_quant_state_dict

        reader = _gguf_reader(source.path)
        cfg = gguf_hf_config(reader, source.path)
        return cfg, gguf_quant_state_dict(reader, source.path, cfg)
    cfg = load_model_config(source)
    if fmt == "sluice":
        from sluice.models.quant.checkpoint import load_sluice_state_dict

        return cfg, load_sluice_state_dict(source.path)
    sd = load_hf_state_dict(source.path)
    if fmt in ("awq", "gptq"):
        from sluice.models.quant.hub import hub_state_dict, read_quant_config

        return cfg, hub_state_dict(sd, read_quant_config(source.path) or {}, dequantize=dequantize)
    return cfg, {k: v.to(torch.float32) for k, v in sd.items()}


def _check_combination(fmt: str, quantization: str, group_size: int | None, symmetric: bool | None) -> None:
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATION_MODES)}")
    if quantization in ("gguf", "awq", "gptq", "sluice") and fmt != quantization:
        raise ValueError(f"--quantization {quantization} needs a {quantization} checkpoint, this model is {fmt} (use auto, none, int8 or int4)")
    if quantization not in ("int8", "int4") and (group_size is not None or symmetric is not None):
        raise ValueError(f"group size / symmetric apply to --quantization int8|int4 only, not {quantization}")


def _head_names(sd: dict[str, Any]) -> list[str]:
    if "lm_head.weight" in sd:
        return ["lm_head.weight"]
    return ["model.embed_tokens.weight"] if "model.embed_tokens.weight" in sd else []


def _source_digest(source: ModelSource) -> str:
    if source.path.is_file():
        return file_digest(source.path)
    files = sorted(source.path.glob("*.safetensors")) + [source.path / "config.json"]
    return hashlib.sha256("".join(file_digest(f) for f in files if f.is_file()).encode()).hexdigest()[:16]


def _fallback_cache_path(source: ModelSource, settings: dict[str, Any]) -> Path:
    key = json.dumps({**settings, "v": _CACHE_VERSION, "text": hashlib.sha256(english_text().encode()).hexdigest()[:12]}, sort_keys=True)
    return cache_dir() / "quant-fallback" / f"{_source_digest(source)}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:  # a read-only cache only costs the next start a calibration
        pass


@dataclass
class _AtLoad:
    """Round-to-nearest at load with per-layer fallback, applied to a float32 state dict in place."""

    bits: int  # 4 | 8
    group_size: int
    symmetric: bool | None  # None: int4 asymmetric, int8 symmetric
    quantize_head: bool
    kl_bound: float
    calibration_tokens: int

    def apply(
        self,
        source: ModelSource,
        raw_cfg: dict[str, Any],
        sd: dict[str, Any],
        fb: FallbackSpec,
        reasons: dict[str, str],
        measure_errors: bool,
        use_cache: bool,
    ) -> tuple[dict[str, float], dict[str, Any] | None]:
        sym = (self.bits == 8) if self.symmetric is None else self.symmetric
        heads = _head_names(sd) if self.quantize_head else []
        candidates = [n for n in sd if is_linear_weight(n) or n in heads]
        reasons.update({n: "pattern" for n in candidates if fb.matches(n)})
        quant: dict[str, QuantWeight] = {}
        for n in candidates:
            if n not in reasons:
                try:
                    quant[n] = quantize_rtn(sd[n], self.bits, self.group_size, sym)
                except ValueError as e:
                    raise ValueError(f"--quantization int{self.bits} --group-size {self.group_size}: {n} {tuple(sd[n].shape)}: {e}") from e
        errors: dict[str, float] = {}
        model_error: dict[str, Any] | None = None
        if quant and (fb.mode == "auto" or measure_errors):
            settings = {"bits": self.bits, "g": self.group_size, "sym": sym, "head": self.quantize_head, "bound": self.kl_bound, "n": self.calibration_tokens, "fb": str(fb)}
            cache = _fallback_cache_path(source, settings)
            found = _read_json(cache) if use_cache else None
            if found is None or set(found.get("errors", {})) != set(quant):
                found = _calibrate(source, raw_cfg, sd, quant, fb.mode == "auto", self.kl_bound, self.calibration_tokens)
                if use_cache:
                    _write_json_atomic(cache, found)
            errors = {k: float(v) for k, v in found["errors"].items()}
            if fb.mode == "auto":
                reasons.update({n: "auto" for n in found["float_layers"]})
                model_error = {"metric": "kl_nats_per_token", "value": found["kl"], "all_quantized": found["kl_all_quantized"], "bound": self.kl_bound, "tokens": self.calibration_tokens}
                shown = found["float_layers"][:8]
                log.info(
                    "quant fallback auto: %d of %d linears kept float32 (KL %.4g nats/token, all quantized %.4g, bound %.3g)%s",
                    len(found["float_layers"]), len(quant), found["kl"], found["kl_all_quantized"], self.kl_bound,
                    (": " + ", ".join(shown) + (" ..." if len(found["float_layers"]) > len(shown) else "")) if shown else "",
                )
        sd.update({n: w for n, w in quant.items() if n not in reasons})
        for n in ("model.embed_tokens.weight", "lm_head.weight"):
            if n in sd and not isinstance(sd[n], QuantWeight):
                reasons.setdefault(n, "embedding/head")
        return errors, model_error


def load_quantized_weights(
    source: ModelSource,
    quantization: str = "auto",
    fallback: str = "auto",
    *,
    group_size: int | None = None,  # int8/int4: group of inputs per scale (-1: per channel); default 32
    symmetric: bool | None = None,  # int8/int4: default int4 asymmetric (scale + min), int8 symmetric
    quantize_head: bool | None = None,  # int8/int4: quantize the LM head too (the embedding when tied); default: int8 yes, int4 no
    kl_bound: float = DEFAULT_KL_BOUND,  # auto fallback: model error bound, nats/token
    calibration_tokens: int = CALIBRATION_TOKENS,
    measure_errors: bool = False,  # measure every quantized linear's error even without auto fallback
    use_cache: bool = True,  # reuse an earlier auto-fallback choice for the same file and settings
) -> tuple[dict[str, QuantWeight | torch.Tensor], dict[str, Any]]:
    """The HF-named weights of ``source`` in the requested precision, and a report (see module doc)."""
    t0 = time.monotonic()
    quantization = (quantization or "auto").lower()
    fb = parse_fallback(fallback)
    fmt = detect_format(source)
    _check_combination(fmt, quantization, group_size, symmetric)
    raw_cfg, sd = _read_native(source, fmt, dequantize=quantization not in _NATIVE)
    reasons: dict[str, str] = {}
    errors: dict[str, float] = {}
    model_error: dict[str, Any] | None = None

    if quantization == "none":
        sd = {k: _dense(v) for k, v in sd.items()}
    elif quantization in _NATIVE:
        if fb.mode == "patterns":  # already-quantized layers the user wants in float32: their exact values
            for name, w in sd.items():
                if isinstance(w, QuantWeight) and fb.matches(name):
                    sd[name], reasons[name] = w.dequantize(), "pattern"
        if any(isinstance(w, QuantWeight) for w in sd.values()):
            log.info("quantization %s: serving the %s checkpoint's own weights (%d kept float32 by pattern)", quantization, fmt, len(reasons))
    else:
        sd = {k: _dense(v) for k, v in sd.items()}
        bits = 8 if quantization == "int8" else 4
        # NOTE(int8-head): an int8 group-32 head is what GGUF's Q8_0 heads are, and a
        # float32 head would be the slowest read of every decode step (SmolLM2:
        # 113 MB of its 246 MB); int4 heads cost accuracy, so int4 keeps it float.
        head = bits == 8 if quantize_head is None else quantize_head
        at_load = _AtLoad(bits, 32 if group_size is None else group_size, symmetric, head, kl_bound, calibration_tokens)
        errors, model_error = at_load.apply(source, raw_cfg, sd, fb, reasons, measure_errors, use_cache)

    report = _report(source, fmt, quantization, fb, sd, reasons, errors, model_error)
    report["seconds"] = round(time.monotonic() - t0, 2)
    return sd, report


def _calibrate(
    source: ModelSource,
    raw_cfg: dict[str, Any],
    float_sd: dict[str, torch.Tensor],
    quant: dict[str, QuantWeight],
    choose: bool,
    bound: float,
    num_tokens: int,
) -> dict[str, Any]:
    from sluice.models.quant.calibrate import ReferenceModel, calibration_tokens, mean_kl
    from sluice.models.tokenizer import load_tokenizer

    tokens = calibration_tokens(load_tokenizer(source), num_tokens)
    if not tokens:  # a checkpoint without a usable tokenizer: no text to measure the error on
        raise ConfigError(
            f"{source.path}: its tokenizer encodes none of the calibration text, so quant_fallback=auto "
            "cannot measure the quantization error: use --quant-fallback none",
            setting="quant_fallback",
        )
    ref = ReferenceModel(raw_cfg, float_sd, len(tokens))
    errors = ref.linear_errors(tokens, dict(quant))
    out: dict[str, Any] = {"errors": errors, "float_layers": [], "kl": None, "kl_all_quantized": None}
    if choose:
        base = ref.logprobs(tokens)

        quantized_now: set[str] = set()  # the model holds the float weights

        def kl_with_float(keep: list[str]) -> float:
            want = set(quant) - set(keep)
            ref.assign({n: quant[n] for n in want - quantized_now} | {n: float_sd[n] for n in quantized_now - want})
            quantized_now.clear()
            quantized_now.update(want)
            return mean_kl(base, ref.logprobs(tokens))

        choice = choose_fallback(errors, kl_with_float, bound)
        out.update(float_layers=choice.float_layers, kl=choice.kl, kl_all_quantized=choice.kl_all_quantized, history=choice.history)
    return out


_MODULE_ORDER = {m: i for i, m in enumerate(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}


def _layer_order(name: str) -> tuple[int, int, str]:
    """Embedding first, then layer by layer in forward order (q k v o gate up down), then the head."""
    parts = name.split(".")
    if name.startswith("model.layers.") and parts[2].isdigit():
        return (int(parts[2]), _MODULE_ORDER.get(parts[-2], len(_MODULE_ORDER)), name)
    return (-1 if "embed" in name else 1 << 30, 0, name)


def _nbytes(w: QuantWeight | torch.Tensor) -> int:
    return w.nbytes_packed if isinstance(w, QuantWeight) else int(w.numel()) * 4


def _report(
    source: ModelSource,
    fmt: str,
    quantization: str,
    fb: FallbackSpec,
    sd: dict[str, QuantWeight | torch.Tensor],
    reasons: dict[str, str],
    errors: dict[str, float],
    model_error: dict[str, Any] | None,
) -> dict[str, Any]:
    layers: dict[str, dict[str, Any]] = {}
    for name in sorted(sd, key=_layer_order):
        w = sd[name]
        if len(tuple(w.shape)) != 2:
            continue
        quantized = isinstance(w, QuantWeight)
        layers[name] = {
            "shape": list(w.shape),
            "precision": w.source if isinstance(w, QuantWeight) else "float32",
            "error": errors.get(name) if quantized else (0.0 if name in errors else None),
            "bytes": _nbytes(w),
            "reason": "quantized" if quantized else reasons.get(name, "float"),
        }
        if not quantized and name in errors:
            layers[name]["error_if_quantized"] = errors[name]
    total = sum(_nbytes(w) for w in sd.values())
    fp32 = sum(int(torch.Size(w.shape).numel()) * 4 for w in sd.values())
    return {
        "model": source.name,
        "format": fmt,
        "quantization": quantization,
        "fallback": str(fb),
        "layers": layers,
        "model_error": model_error,
        "totals": {
            "bytes": total,
            "float32_bytes": fp32,
            "num_quantized": sum(isinstance(w, QuantWeight) for w in sd.values()),
            "num_float_matrices": sum(1 for n, v in layers.items() if v["precision"] == "float32"),
        },
    }
