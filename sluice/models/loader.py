"""Build a model from its source (models/source.py), in the weight format asked for.

    load_model(resolve_model("smollm2"), torch.float32)                      # GGUF Q4_1/Q8_0 as is
    load_model(resolve_model("/models/llama"), torch.float32, quantization="int4")

The checkpoint's files are read by models/files.py (float) or models/quant
(quantized, exact); the built model's tensors are cached (see the NOTE below).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from sluice.errors import ModelLoadError
from sluice.models.files import (
    gguf_hf_config,
    gguf_hf_name,
    gguf_reader,
    load_gguf_state_dict,
    load_hf_state_dict,
    load_model_config,
    unpermute,
)
from sluice.models.model_cache import bound_cache, mark_used, max_cache_bytes
from sluice.models.source import (
    ModelSource,
    cache_dir,
    file_digest,
    model_cache_root,
    resolve_model,
)

__all__ = [
    "ModelSource", "resolve_model", "load_model_config", "load_model", "file_digest", "cache_dir",
    "check_fits_in_memory", "served_weight_bytes",
]

# NOTE(compat): the readers live in models/source.py and models/files.py (so
# that models/quant can use them without importing the loader); these names
# stay importable from here.
_gguf_reader = gguf_reader
_unpermute = unpermute
_gguf_hf_name = gguf_hf_name

# ---------------------------------------------------------------- converted-weights cache
#
# NOTE(cold-start): parsing a GGUF (its 49k-entry vocabulary), converting and
# repacking its weights costs seconds at every start.  The first load writes
# the built model's tensors (packed quantized weights, float norms) with a
# manifest of each linear's parts under
#   ~/.cache/sluice/models-v3/<file digest>/config.json
#   ~/.cache/sluice/models-v3/<file digest>/<quantization variant>/{manifest.json, model.safetensors}
# and later loads read those (memory-mapped) and never open the GGUF.  Written
# to a temp dir and renamed, so a crash never leaves a half-written cache.
# The cache is bounded (SLUICE_MODEL_CACHE_MAX_GB, least recently used entries
# removed first: NOTE(model-cache-bound) in models/model_cache.py).

log = logging.getLogger("sluice.models")

LAYOUT_VERSION = 1  # bump when the packed layout or the manifest format changes
RTN_RULES = 2  # int8/int4 at load: bump when what gets quantized changes (2: int8 heads, NOTE(int8-head))


def _variant(quantization: str, quant_fallback: str, dtype: Any, quantize_head: bool | None = None) -> str:
    fb = hashlib.sha256(quant_fallback.encode()).hexdigest()[:8]
    rules = f"-R{RTN_RULES}" if quantization in ("int8", "int4") else ""
    head = "" if quantize_head is None or quantization not in ("int8", "int4") else f"-H{int(quantize_head)}"
    return f"{quantization}-{fb}-{str(dtype).removeprefix('torch.')}-L{LAYOUT_VERSION}{rules}{head}"


def _atomic_dir_write(target: Path, files: dict[str, Any]) -> None:
    """Write ``files`` (name -> str | tensor dict) into ``target`` via a temp dir + rename."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    tmp: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        for name, content in files.items():
            if isinstance(content, dict):
                save_file({k: v.contiguous() for k, v in content.items()}, str(tmp / name))
            else:
                (tmp / name).write_text(content)
        if target.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except OSError:  # a read-only or full cache only costs speed
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _read_cached_model(source: ModelSource, variant: str) -> tuple[dict[str, Any], dict[str, Any], Path] | None:
    root = model_cache_root(source)
    mark_used(root)  # before reading, so that a bound applied meanwhile keeps it (NOTE(model-cache-bound))
    cfg, manifest, weights = root / "config.json", root / variant / "manifest.json", root / variant / "model.safetensors"
    if not (cfg.is_file() and manifest.is_file() and weights.is_file()):
        return None
    try:
        return json.loads(cfg.read_text()), json.loads(manifest.read_text()), weights
    except (OSError, ValueError):
        return None


def load_model(
    source: ModelSource,
    dtype: Any,
    device: str = "cpu",
    max_model_len: int | None = None,
    quantization: str = "none",
    quant_fallback: str = "auto",
    quantize_head: bool | None = None,
) -> Any:
    """Build a ``LlamaForCausalLM`` with the weights of ``source`` on ``device``.

    ``quantization``: ``none`` (every weight dequantized to ``dtype``), ``auto``
    (what the checkpoint holds: a GGUF's or AWQ/GPTQ's quantized weights served
    as they are), ``int8`` / ``int4`` (quantized at load), ``gguf`` (a GGUF, as
    it is).  ``quant_fallback`` keeps sensitive layers in float (see
    ``sluice.models.quant``).  Its ``max_positions`` (the context window the
    engine enforces) is ``max_model_len`` capped at the model's context, or by
    default the model's context capped at 8192.  ``quantize_head`` (int8/int4 at
    load): quantize the LM head (a tied embedding) too; default: int8 yes, int4 no.
    """
    import torch

    from sluice.models.config import ModelConfig
    from sluice.models.llama import LlamaForCausalLM, Ops

    def build(raw_cfg: dict[str, Any], on: str) -> Any:
        try:
            cfg = ModelConfig.from_hf(raw_cfg)
        except (KeyError, ValueError, TypeError) as e:
            raise ModelLoadError(f"model {source.path}: bad config: {e}") from e
        ctx = cfg.max_position_embeddings
        positions = min(max_model_len, ctx) if max_model_len else min(ctx, 8192)
        with torch.device(on):
            return LlamaForCausalLM(cfg, dtype=dtype, max_positions=positions)

    def finish(model: Any) -> Any:
        for p in model.parameters():
            p.requires_grad_(False)
        model.build_rope(device)
        model.set_ops(Ops.for_model(dtype, device))
        return model.eval()

    from sluice.models.quant import detect_format

    fmt = detect_format(source)  # 'gguf' | 'float' | 'awq' | 'gptq' | 'sluice'
    if quantization == "auto" and fmt == "float":
        quantization = "none"  # a float checkpoint: auto serves it as it is
    check_fits_in_memory(source, fmt, quantization, torch.empty((), dtype=dtype).element_size())
    variant = _variant(quantization, quant_fallback, dtype, quantize_head)
    use_cache = source.kind == "gguf" or quantization != "none" or fmt != "float"
    if use_cache:
        max_cache_bytes()  # a bad SLUICE_MODEL_CACHE_MAX_GB fails here, before any work
    cached = _read_cached_model(source, variant) if use_cache else None
    if cached is not None:
        # sluice-native tensors: assign them, no copy, no conversion
        from safetensors.torch import load_file

        raw_cfg, manifest, weights = cached
        try:
            stored = load_file(str(weights), device=device)  # in the serving dtype (the variant says which)
        except FileNotFoundError:  # removed by another process's cache bound since: convert again
            stored = None
        if stored is not None:
            model = build(raw_cfg, "meta")
            model.apply_manifest(manifest["linears"])
            try:
                model.load_state_dict(stored, strict=True, assign=True)
            except RuntimeError as e:
                raise ModelLoadError(f"converted-weights cache {weights} does not match the model: {e}") from e
            return finish(model)

    if quantization == "none" and fmt in ("gguf", "float"):
        if source.kind == "gguf":
            reader = gguf_reader(source.path)
            raw_cfg = gguf_hf_config(reader, source.path)
            sd = load_gguf_state_dict(reader, source.path, raw_cfg)
        else:
            raw_cfg = load_model_config(source)
            sd = load_hf_state_dict(source.path)
        report: dict[str, Any] = {}
    else:  # quantized weights, or an AWQ/GPTQ/sluice checkpoint dequantized exactly ('none')
        raw_cfg, sd, report = _quantized_state_dict(source, quantization, quant_fallback, quantize_head)
    from sluice.kernels.qweight import QuantWeight

    if any(isinstance(v, QuantWeight) for v in sd.values()) and not _quantized_kernels_run_on(device):
        # NOTE(cuda): sluice's quantized kernels are CPU kernels; on a GPU (or without
        # a C++ compiler) the same Linear interface holds the weights dequantized.
        log.warning("quantized weights are dequantized to %s on %s (no quantized kernels there)", dtype, device)
        sd = {k: v.dequantize() if isinstance(v, QuantWeight) else v for k, v in sd.items()}
    model = build(raw_cfg, device)
    try:
        model.load_hf_state_dict(sd)
    except ValueError as e:
        raise ModelLoadError(f"model {source.path}: {e}") from e
    # NOTE(cuda-weights): the Linears built from the state dict hold its tensors where they were read (the
    # CPU); the model is built on ``device``, and so must they be (the cached path reads them onto it)
    model.to(device)
    model = finish(model)
    if use_cache:
        root = model_cache_root(source)
        if not (root / "config.json").is_file():
            root.mkdir(parents=True, exist_ok=True)
            _atomic_file_write(root / "config.json", json.dumps(raw_cfg))
        manifest_doc = {"linears": model.manifest(), "report": report, "layout": LAYOUT_VERSION}
        _atomic_dir_write(root / variant, {"manifest.json": json.dumps(manifest_doc), "model.safetensors": model.state_dict()})
        bound_cache(root.parent, keep=root)
    return model


def served_weight_bytes(source: ModelSource, fmt: str, quantization: str, dtype_bytes: int) -> int:
    """About how many bytes loading holds at once: the weights as served, or the float32 weights that
    quantizing at load starts from (a lower bound of what loading needs)."""
    from sluice.models.formats import weights_bytes

    if quantization in ("auto", "gguf", "awq", "gptq", "sluice") and fmt != "float":
        return weights_bytes(source)  # served as stored
    if source.kind == "gguf":
        n = weights_bytes(source) * 2  # at least 4 bits a weight: a lower bound of the parameter count
    else:
        from sluice.models.config import ModelConfig

        try:
            n = ModelConfig.from_hf(load_model_config(source)).num_parameters()
        except (KeyError, ValueError, TypeError):
            return 0  # the loader reports the bad config itself
    if quantization in ("int8", "int4"):
        return n * 4  # quantized at load from the float32 weights, all read first (models/quant/__init__.py)
    return n * dtype_bytes


def check_fits_in_memory(source: ModelSource, fmt: str, quantization: str, dtype_bytes: int) -> None:
    """NOTE(larger-than-ram): sluice holds every weight in memory (a GGUF's quantized blocks are
    repacked for the kernels, experts one by one: NOTE(lazy-experts)); a model whose weights
    alone, as served or as read for quantizing at load, exceed the memory available fails here
    with one line, rather than by swapping for minutes and being killed."""
    import psutil

    need = served_weight_bytes(source, fmt, quantization, dtype_bytes)
    avail = psutil.virtual_memory().available
    if need > avail:
        gib = 1 << 30
        raise ModelLoadError(
            f"model {source.path}: loading its weights needs about {need / gib:.1f} GiB "
            f"(--quantization {quantization}), more than the {avail / gib:.1f} GiB of memory available; "
            f"use a smaller quantization (e.g. a Q4 GGUF, or --quantization int4) or a machine with more memory"
        )


def _quantized_state_dict(
    source: ModelSource, quantization: str, quant_fallback: str, quantize_head: bool | None = None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    from sluice.models.quant import load_quantized_weights

    try:
        sd, report = load_quantized_weights(source, quantization, quant_fallback, quantize_head=quantize_head)
    except ValueError as e:  # a bad combination (e.g. --quantization gguf on a HF folder)
        raise ModelLoadError(str(e)) from e
    return load_model_config(source), sd, report


def _quantized_kernels_run_on(device: str) -> bool:
    import torch

    if torch.device(device).type != "cpu":
        return False
    from sluice.kernels import ext

    try:
        ext.load("quant")
    except ext.KernelUnavailableError as e:
        log.warning("%s", e)
        return False
    return True


def _atomic_file_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
