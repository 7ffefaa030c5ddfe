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

All layers share one tensor per kind, so a block of every layer is one
strided slice (``k_all[:, block]``), and moving a block to or from a tier is
four copies, not four per layer:

    k_all, v_all        [num_layers, num_blocks, 16, Hkv, D]   (k[layer] is a contiguous view)
    k_scales_all, ...   [num_layers, num_blocks, 16, Hkv]      (quantized formats only)

Block payload (what the KV tiers store; ``PAYLOAD_LAYOUT`` names it in the fingerprint):

    K data (L, 16, Hkv, D) | V data | K scales (L, 16, Hkv) float32 | V scales   (scales: quantized only)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sluice.engine.config import KV_CACHE_DTYPES
from sluice.errors import ConfigError

__all__ = [
    "KV_CACHE_DTYPES",
    "PAYLOAD_LAYOUT",
    "KVCacheFormat",
    "KVCache",
    "resolve_kv_format",
    "quantize",
    "dequantize",
]

_FULL = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PAYLOAD_LAYOUT = "kvs-rowscale-v1"  # change it whenever the payload's bytes change meaning
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
        layer_slots: Sequence[int] | None = None,
        window_groups: dict[int, int] | None = None,
    ):
        """``layer_slots`` (NOTE(hybrid-blocks) in hybrid_blocks.py): layer i keeps its K/V in slot
        ``layer_slots[i]`` of each block, so several layers that read different block tables share one
        slot of the pool's blocks (a block then holds ``max(layer_slots) + 1`` layers); by default every
        layer has a slot of its own.  ``window_groups``: sliding layer -> the group whose block table it
        reads (``AttentionMetadata.window_block_tables``); the other layers read the request's own table."""
        self.fmt = fmt
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        slots = list(layer_slots) if layer_slots is not None else list(range(num_layers))
        if len(slots) != num_layers or min(slots) < 0:
            raise ValueError(f"layer_slots must give each of the {num_layers} layers a slot, got {slots}")
        self.layer_slots = slots
        self.window_group = dict(window_groups or {})
        num_slots = max(slots) + 1
        shape = (num_slots, num_blocks, block_size, num_kv_heads, head_dim)
        dt, dev = fmt.storage_dtype, torch.device(device)
        # torch.empty: allocating without zeroing keeps start-up fast; every slot
        # is written before it is read (the slot mapping covers each new token).
        self.k_all = torch.empty(shape, dtype=dt, device=dev)
        self.v_all = torch.empty(shape, dtype=dt, device=dev)
        k_slots, v_slots = self.k_all.unbind(0), self.v_all.unbind(0)
        self.k, self.v = [k_slots[i] for i in slots], [v_slots[i] for i in slots]  # per-layer views
        self._all = [self.k_all, self.v_all]
        self.k_scales: list[torch.Tensor] = []
        self.v_scales: list[torch.Tensor] = []
        if fmt.is_quantized:
            ks_all = torch.empty(shape[:4], dtype=torch.float32, device=dev)
            vs_all = torch.empty(shape[:4], dtype=torch.float32, device=dev)
            ks, vs = ks_all.unbind(0), vs_all.unbind(0)
            self.k_scales, self.v_scales = [ks[i] for i in slots], [vs[i] for i in slots]
            self._all += [ks_all, vs_all]
        self.bytes_per_block = fmt.bytes_per_block(num_slots, num_kv_heads, head_dim, block_size)
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
        """(all-layer tensor as bytes, byte offset in the payload, bytes) per segment, in payload order."""
        segs: list[tuple[torch.Tensor, int, int]] = []
        off = 0
        for t in self._all:
            raw = t.view(torch.uint8)  # (L, NB, 16, Hkv, D * itemsize): fp8 has no copy ops
            n = raw[:, 0].numel()
            segs.append((raw, off, n))
            off += n
        assert off == self.bytes_per_block, "the payload layout and the memory accounting disagree"
        return segs

    # NOTE(numpy-copies): on the CPU, block bytes move through numpy views of the
    # same memory: torch's strided uint8 copy of a block across layers measured
    # 16 ms per SmolLM2 block (737 KB) against 0.02 ms with np.copyto.

    def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copy blocks out as payloads: (n, bytes_per_block) uint8 on the CPU."""
        n = len(block_ids)
        out = torch.empty((n, self.bytes_per_block), dtype=torch.uint8)
        if self.k_all.device.type == "cpu":
            ids, dst = np.asarray(block_ids, dtype=np.int64), out.numpy()
            for raw, off, size in self._segments:
                picked = raw.numpy()[:, ids]  # (L, n, 16, Hkv, ...) gathered
                dst[:, off : off + size].reshape((n, raw.shape[0], *picked.shape[2:]))[...] = picked.swapaxes(0, 1)
            return out
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.k_all.device)
        for raw, off, size in self._segments:
            picked = raw.index_select(1, idx).transpose(0, 1).cpu()  # (n, L, 16, Hkv, ...)
            out[:, off : off + size].view(picked.shape).copy_(picked)
        return out

    def import_block(self, block_id: int, payload: torch.Tensor | bytes | bytearray | memoryview) -> None:
        """Write one payload (bytes_per_block bytes) into block ``block_id``."""
        src = payload.cpu().numpy() if isinstance(payload, torch.Tensor) else np.frombuffer(payload, dtype=np.uint8)
        if src.size != self.bytes_per_block:
            raise ValueError(f"KV block payload has {src.size} bytes, expected {self.bytes_per_block}")
        for raw, off, size in self._segments:
            seg = src[off : off + size]
            if raw.device.type == "cpu":
                dst = raw.numpy()[:, block_id]  # (L, 16, Hkv, ...) strided over layers
                np.copyto(dst, seg.reshape(dst.shape))
            else:
                raw[:, block_id].copy_(torch.from_numpy(seg.copy()).view(raw[:, block_id].shape))
