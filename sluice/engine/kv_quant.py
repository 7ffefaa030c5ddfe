"""KV cache storage formats: full precision, or fp8 / int8 with scales beside the blocks.

``--kv-cache-dtype auto|fp32|bf16|fp8|int8``.  A quantized layer cache is two
tensors per K and per V:

    data   [num_blocks, block_size=16, num_kv_heads, head_dim]   float8_e4m3fn | int8
    scales [num_blocks, block_size=16, num_kv_heads]             float32
    value(b, t, h, :) = data[b, t, h, :].float() * scales[b, t, h]

The scale of a (token row, KV head) is the absmax of that row over head_dim
divided by the format's largest value (448 for e4m3, 127 for int8), computed
when the token is written: there is no calibration step and no default scale
of 1.0 (the failure that silently corrupts outputs in engines whose fp8 scales
were never calibrated).

NOTE(kv-scale-granularity): one scale per token row and KV head, not one per
(block, head).  A per-block scale must be chosen before the block's later
tokens exist; when a later token's absmax is larger the block has to be
rescaled, which re-rounds its earlier entries (the error compounds with every
growth) and makes a block's bytes depend on how its 16 tokens were split across
steps.  Chunk boundaries depend on the batch a request shares, so per-block
scales would break batch invariance (DESIGN.md) and give one block hash two
different contents (memory vs disk vs another replica).  A per-row scale makes
a token's bytes a function of that token alone: written once, never rewritten,
identical whatever the chunking (tests/engine/test_kv_quant.py checks both).
It costs 4 bytes per (token, head): +6.25% over fp8 data at head_dim 64, which
``KVCacheFormat.bytes_per_block`` counts, so ``--kv-cache-memory`` buys
3.76x the fp32 tokens with fp8/int8 (head_dim 64), not 4x.

Block payload (what the KV tiers store; the fingerprint names this layout):

    for layer in 0..L-1:   K data | V data | K scales | V scales   (scales: quantized only)
    each data  segment  16 * Hkv * D * itemsize bytes, C order (t, h, d)
    each scale segment  16 * Hkv * 4 bytes, float32, C order (t, h)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice.engine.config import KV_CACHE_DTYPES
from sluice.errors import ConfigError

__all__ = [
    "KV_CACHE_DTYPES",
    "KVCacheFormat",
    "KVCache",
    "resolve_kv_format",
    "quantize",
    "dequantize",
]

_FULL = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_QUANT = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
_QMAX = {"fp8": 448.0, "int8": 127.0}  # largest finite e4m3 value; symmetric int8
_NAME_OF = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# an all-zero row gets a tiny normal scale instead of 0 (no 0/0); its entries stay 0
_MIN_ABSMAX = 1e-30


@dataclass(frozen=True)
class KVCacheFormat:
    """A resolved KV cache dtype (never 'auto')."""

    name: str  # 'fp32' | 'bf16' | 'fp16' | 'fp8' | 'int8'
    storage_dtype: torch.dtype  # element type of the data tensors

    @property
    def is_quantized(self) -> bool:
        return self.name in _QUANT

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.storage_dtype).element_size()

    def bytes_per_block(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16) -> int:
        """K + V bytes of one block over all layers, scales included."""
        row = num_kv_heads * (head_dim * self.itemsize + (4 if self.is_quantized else 0))
        return 2 * num_layers * block_size * row

    def num_blocks(self, budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16) -> int:
        return max(1, budget_bytes // self.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size))


def resolve_kv_format(name: str | None, model_dtype: torch.dtype) -> KVCacheFormat:
    """``--kv-cache-dtype`` -> format; 'auto' (or None) is the model's compute dtype."""
    name = (name or "auto").lower()
    if name == "auto":
        if model_dtype not in _NAME_OF:
            raise ConfigError(f"no KV cache format for model dtype {model_dtype}")
        name = _NAME_OF[model_dtype]
    if name in _FULL:
        return KVCacheFormat(name, _FULL[name])
    if name in _QUANT:
        return KVCacheFormat(name, _QUANT[name])
    raise ConfigError(f"unknown KV cache dtype {name!r}: use {', '.join(KV_CACHE_DTYPES)}")


def quantize(x: torch.Tensor, fmt: KVCacheFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (..., D) any float dtype -> data (..., D) storage dtype, scales (...) float32.

    One scale per row (absmax over the last dim); the row's bytes depend on
    that row only.
    """
    qmax = _QMAX[fmt.name]
    xf = x.float()
    scales = xf.abs().amax(dim=-1).clamp_min(_MIN_ABSMAX) / qmax
    y = (xf / scales.unsqueeze(-1)).clamp_(-qmax, qmax)
    if fmt.name == "int8":
        y = y.round_()
    return y.to(fmt.storage_dtype), scales


def dequantize(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data (..., D), scales (...) -> (..., D) in ``dtype``."""
    return (data.float() * scales.unsqueeze(-1)).to(dtype)


class KVCache:
    """The per-layer K/V tensors of the paged cache, in one format.

    Owned by the model runner; attention backends write new tokens through
    ``write`` and read blocks through ``gather`` (or the tensors directly, as
    the C++ kernel does); the KV tiers move whole blocks through
    ``export_blocks`` / ``import_block`` as flat byte payloads.
    """

    def __init__(
        self,
        fmt: KVCacheFormat,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
    ):
        self.fmt = fmt
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        dt, dev = fmt.storage_dtype, torch.device(device)
        # torch.empty: allocating without zeroing keeps start-up fast; every slot
        # is written before it is read (the slot mapping covers each new token).
        self.k = [torch.empty(shape, dtype=dt, device=dev) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dt, device=dev) for _ in range(num_layers)]
        self.k_scales: list[torch.Tensor] = []
        self.v_scales: list[torch.Tensor] = []
        if fmt.is_quantized:
            sshape = shape[:3]
            self.k_scales = [torch.empty(sshape, dtype=torch.float32, device=dev) for _ in range(num_layers)]
            self.v_scales = [torch.empty(sshape, dtype=torch.float32, device=dev) for _ in range(num_layers)]
        self.bytes_per_block = fmt.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size)
        self._segments = self._layout()

    @property
    def num_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    # ------------------------------------------------------------ attention side

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V (T, Hkv, D) at their slots (T,) int64."""
        for x, cache, scales in ((k, self.k, self.k_scales), (v, self.v, self.v_scales)):
            flat = cache[layer].view(-1, self.num_kv_heads, self.head_dim)
            if self.fmt.is_quantized:
                data, s = quantize(x, self.fmt)
                # NOTE(fp8-ops): CPU torch has no index_copy_/index_select for
                # float8; the bytes move as uint8 (same width, same bits).
                flat.view(torch.uint8).index_copy_(0, slot_mapping, data.view(torch.uint8))
                scales[layer].view(-1, self.num_kv_heads).index_copy_(0, slot_mapping, s)
            else:
                flat.index_copy_(0, slot_mapping, x.to(flat.dtype))

    def gather(self, layer: int, block_ids: torch.Tensor, num_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the first ``num_tokens`` tokens of a block table row -> (num_tokens, Hkv, D) each."""
        out = []
        for cache, scales in ((self.k, self.k_scales), (self.v, self.v_scales)):
            if self.fmt.is_quantized:
                raw = cache[layer].view(torch.uint8).index_select(0, block_ids).flatten(0, 1)[:num_tokens]
                s = scales[layer].index_select(0, block_ids).flatten(0, 1)[:num_tokens]
                out.append(dequantize(raw.view(self.fmt.storage_dtype), s, dtype))
                continue
            data = cache[layer].index_select(0, block_ids).flatten(0, 1)[:num_tokens]
            out.append(data.to(dtype))
        return out[0], out[1]

    # ------------------------------------------------------------ tier side

    def _layout(self) -> list[tuple[torch.Tensor, int, int]]:
        """(tensor, byte offset in the payload, bytes) for every segment, in payload order."""
        segs: list[tuple[torch.Tensor, int, int]] = []
        off = 0
        for layer in range(self.num_layers):
            tensors = [self.k[layer], self.v[layer]]
            if self.fmt.is_quantized:
                tensors += [self.k_scales[layer], self.v_scales[layer]]
            for t in tensors:
                n = t[0].numel() * t.element_size()
                segs.append((t, off, n))
                off += n
        assert off == self.bytes_per_block, "the payload layout and the memory accounting disagree"
        return segs

    def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copy blocks out as payloads: (n, bytes_per_block) uint8 on the CPU."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.k[0].device)
        out = torch.empty((len(ids), self.bytes_per_block), dtype=torch.uint8)
        for t, off, n in self._segments:
            src = t.view(torch.uint8) if t.element_size() == 1 else t
            src = src.index_select(0, ids).reshape(len(ids), -1).view(torch.uint8).cpu()
            out[:, off : off + n].copy_(src)
        return out

    def import_block(self, block_id: int, payload: torch.Tensor | bytes | bytearray | memoryview) -> None:
        """Write one payload (bytes_per_block bytes) into block ``block_id``."""
        if isinstance(payload, bytes):
            payload = bytearray(payload)  # torch.frombuffer wants a writable buffer
        if not isinstance(payload, torch.Tensor):
            payload = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
        if payload.numel() != self.bytes_per_block:
            raise ValueError(f"KV block payload has {payload.numel()} bytes, expected {self.bytes_per_block}")
        for t, off, n in self._segments:
            dst = t[block_id]
            dst.view(-1).view(torch.uint8).copy_(payload[off : off + n])
