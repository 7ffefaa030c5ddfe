"""Engine configuration (one dataclass; the server's pydantic settings fill it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sluice.errors import InvalidRequestError

__all__ = ["EngineConfig", "ModelInfo", "parse_bytes", "BLOCK_SIZE"]

BLOCK_SIZE = 16  # tokens per KV block (DESIGN.md)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: str | int | float) -> int:
    """``2GiB`` -> 2147483648; ``512MB`` -> 512000000; ``1e9`` -> 1000000000."""
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise InvalidRequestError(f"invalid byte size {value!r}: expected e.g. 2GiB, 512MB, 1000000")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise InvalidRequestError(f"byte size must be > 0, got {value!r}")
    return n


@dataclass
class EngineConfig:
    model: str = "smollm2"  # HF directory, .gguf file, or the alias 'smollm2'
    dtype: str | None = None  # 'float32' | 'bfloat16'; None: the device's default
    device: str = "cpu"
    kv_cache_memory: int | None = None  # bytes for K+V of all layers; None: fraction of free memory
    kv_cache_fraction: float = 0.05  # of currently free memory, when kv_cache_memory is None
    max_model_len: int | None = None  # None: the model's context length (capped at 8192)
    max_num_batched_tokens: int = 512  # per-step token budget (prefill chunks + decodes)
    max_num_seqs: int = 64  # running sequences cap
    scheduling_policy: str = "wfq"  # 'fcfs' | 'priority' | 'wfq'
    attention_backend: str | None = None  # 'torch' | 'cpu_paged' | None: best available
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None: $SLUICE_NUM_THREADS or torch default

    def validate(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be >= 1")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise InvalidRequestError(f"unsupported dtype {self.dtype!r}: use float32 or bfloat16")
        if self.scheduling_policy not in ("fcfs", "priority", "wfq"):
            raise InvalidRequestError(
                f"unknown scheduling policy {self.scheduling_policy!r}: use fcfs, priority or wfq"
            )
        if not (0.0 < self.kv_cache_fraction <= 0.9):
            raise InvalidRequestError("kv_cache_fraction must be in (0, 0.9]")


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the system needs to know about the loaded model."""

    name: str  # served model name ('smollm2', directory name, or file stem)
    path: str
    max_model_len: int  # context window enforced by the engine (prompt + output)
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    num_blocks: int
    block_size: int
    attention_backend: str
