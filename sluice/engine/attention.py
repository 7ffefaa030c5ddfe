"""Attention over the paged KV cache, behind one interface.

    KV cache of one layer (K and V alike):
      [num_blocks, block_size=16, num_kv_heads, head_dim]
    token t of a sequence lives in block  block_table[t // 16], row t % 16;
    its flat "slot" is  block_id * 16 + t % 16  (the slot mapping).

Backends (chosen once at start-up, reported by ``sluice doctor``):

- ``torch``: the reference, any device.  Gathers each sequence's blocks into a
  contiguous tensor and runs ``scaled_dot_product_attention``.
- ``cpu_paged``: reads K/V in place from the blocks with a small C++ kernel
  (sluice/kernels/csrc/paged_attention.cpp, compiled when the package is
  installed), online softmax, OpenMP over (token, KV head).  Every row goes
  through it, fresh prefills included, so a prompt's result does not depend
  on how it was chunked.

Both write the new K/V into the cache first and read them back from it, so
attention sees K/V as the cache stores them, in every row: a prompt gives the
same output cold, from the prefix cache or from disk.  A quantized (fp8/int8)
cache is written by ``KVCache.write`` (quantize, then store; see ``kv_quant``)
and the kernel dequantizes a block as it reads it; an fp32/bf16 cache is
written by the ``cpu_paged`` kernel itself (NOTE(kv-write) in
paged_attention.cpp), from the uncopied q/k/v slices of the QKV projection.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from sluice.engine.kv_quant import KVCache
from sluice.kernels import ext

__all__ = ["AttentionMetadata", "flat_batch_metadata", "AttentionBackend", "TorchAttention", "CpuPagedAttention", "make_attention_backend", "available_backends"]

log = logging.getLogger("sluice.engine")


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64, cache slot of each new token
    query_start_loc: list[int]  # (S+1,) start of each sequence's tokens in the flat batch
    seq_lens: list[int]  # (S,) context length after this step (cached + new)
    block_tables: torch.Tensor  # (S, max_blocks) int32, padded with 0
    num_blocks_per_seq: list[int]  # (S,) valid entries in each block table row
    # derived tensors for kernels
    query_start_loc_t: torch.Tensor  # (S+1,) int32
    seq_lens_t: torch.Tensor  # (S,) int32
    # the sliding layers' own tables, one per group of them (NOTE(hybrid-blocks) in hybrid_blocks.py): their
    # slot mappings and block tables as above; empty where every layer reads the tables above
    window_slot_mapping: list[torch.Tensor] = field(default_factory=list)
    window_block_tables: list[torch.Tensor] = field(default_factory=list)
    window_num_blocks_per_seq: list[list[int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def q_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]


def _slots_and_tables(
    rows: Sequence[tuple[int, int, Sequence[int]]], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Slot mapping (T,), block tables (S, max_blocks) padded with 0, valid entries per row."""
    slots: list[int] = []
    for start, n, blocks in rows:
        if n and blocks[start // block_size] < 0:  # never: a window frees only blocks before every query's keys
            raise RuntimeError(f"position {start} falls in a block freed out of the sliding window")
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, start + n))
    bt = torch.zeros((len(rows), max(len(b) for _, _, b in rows)), dtype=torch.int32)
    for i, (_, _, blocks) in enumerate(rows):
        bt[i, : len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
    return torch.tensor(slots, dtype=torch.long, device=device), bt.to(device), [len(b) for _, _, b in rows]


def flat_batch_metadata(
    rows: Sequence[tuple[int, int, Sequence[int]]],
    block_size: int,
    device: torch.device,
    window_tables: Sequence[Sequence[Sequence[int]]] = (),
) -> tuple[list[int], AttentionMetadata]:
    """The flat batch's positions and attention metadata: each row ``(start, num_new, block_table)`` is a
    sequence computing positions ``start .. start + num_new - 1``, its K/V in the table's blocks (the
    whole table is attended: pass only the blocks the sequence holds).  A table's leading entries may be
    ``FREED_BLOCK`` (-1: out of a sliding window, NOTE(window-blocks) in the block manager): only the
    window's attention reads such a table, from the first block its queries see.  ``window_tables[q]``: each
    row's table of sliding group q, where the sliding layers have tables of their own (NOTE(hybrid-blocks))."""
    positions: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    for start, n, _ in rows:
        positions.extend(range(start, start + n))
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
    slots, bt, nblocks = _slots_and_tables(rows, block_size, device)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=bt,
        num_blocks_per_seq=nblocks,
        query_start_loc_t=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
    for tables in window_tables:
        wrows = [(start, n, w) for (start, n, _), w in zip(rows, tables, strict=True)]
        slots_q, bt_q, n_q = _slots_and_tables(wrows, block_size, device)
        meta.window_slot_mapping.append(slots_q)
        meta.window_block_tables.append(bt_q)
        meta.window_num_blocks_per_seq.append(n_q)
    return positions, meta


class AttentionBackend:
    name = "base"

    def __init__(self, kv: KVCache, scale: float):
        self.kv, self.scale = kv, scale
        self.meta: AttentionMetadata | None = None

    def set_metadata(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self.meta is not None
        self.kv.write(layer, self.meta.slot_mapping, k, v)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attend_qkv(self, layer: int, qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Attention straight from the QKV projection's rows (T, (H + 2 Hkv) D) -> (T, H D)."""
        t, d, hkv = qkv.shape[0], self.kv.head_dim, self.kv.num_kv_heads
        q, k, v = qkv.split([num_heads * d, hkv * d, hkv * d], dim=-1)
        return self(layer, q.view(t, num_heads, d), k.view(t, hkv, d), v.view(t, hkv, d)).reshape(t, num_heads * d)

    def _sdpa_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (L, H, D), k/v: (L, Hkv, D) -> (L, H, D)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            is_causal=True, scale=self.scale, enable_gqa=True,
        )
        return o.transpose(0, 1)


class TorchAttention(AttentionBackend):
    """Reference: gather the blocks, then SDPA.  Any device."""

    name = "torch"

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        assert meta is not None
        self._write(layer, k, v)
        out = torch.empty_like(q)
        for i in range(meta.num_seqs):
            s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            ql, ctx = e - s, meta.seq_lens[i]
            blocks = meta.block_tables[i, : meta.num_blocks_per_seq[i]].long()
            kk, vv = self.kv.gather(layer, blocks, ctx, q.dtype)  # (ctx, Hkv, D) each, dequantized
            qq = q[s:e].transpose(0, 1)  # (H, ql, D)
            if ql == ctx:
                mask = None
                causal = ql > 1
            else:
                # query j sits at position ctx - ql + j and sees keys 0..ctx-ql+j
                qpos = torch.arange(ctx - ql, ctx, device=q.device).unsqueeze(1)
                mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # (ql, ctx)
                causal = False
            o = F.scaled_dot_product_attention(
                qq, kk.transpose(0, 1), vv.transpose(0, 1),
                attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True,
            )
            out[s:e] = o.transpose(0, 1)
        return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(T, heads, D) as the kernel takes it: contiguous rows of D, any stride between tokens
    (a slice of the fused QKV output passes uncopied)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def load_cpu_kernel() -> Any:
    """The compiled paged-attention extension (built at install time; see sluice/kernels/ext.py)."""
    return ext.load("attention")


class CpuPagedAttention(AttentionBackend):
    name = "cpu_paged"

    def __init__(self, kv: KVCache, scale: float):
        super().__init__(kv, scale)
        self.kernel = load_cpu_kernel()
        self._no_scales = torch.empty(0, dtype=torch.float32)

    def set_metadata(self, meta: AttentionMetadata) -> None:
        super().set_metadata(meta)
        # NOTE(batch-invariance): every row, fresh prefills included, goes through the
        # kernel, which reduces each (token, head) over its own keys in block order:
        # a prompt gives the same bits however the scheduler chunks it.
        self._skip = torch.zeros(meta.num_seqs, dtype=torch.uint8)

    def attend_qkv(self, layer: int, qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
        kv = self.kv
        if kv.fmt.is_quantized or kv.k[layer].dtype != qkv.dtype or qkv.stride(-1) != 1:
            return super().attend_qkv(layer, qkv, num_heads)
        meta = self.meta
        assert meta is not None
        # NOTE(qkv-rows) in paged_attention.cpp: one call, the heads sliced in C++
        return self.kernel.paged_attention(  # type: ignore[no-any-return]
            qkv, kv.k[layer], kv.v[layer], self._no_scales, self._no_scales,
            meta.block_tables, meta.query_start_loc_t, meta.seq_lens_t, self._skip, self.scale,
            None, None, meta.slot_mapping,
        )

    def attend_ext(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                   window: int | None = None, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        """A layer with options (models/attention.py): its own scale, a sliding window (NOTE(window-keys) in
        paged_attention.cpp: no block before the window is read) and soft-capped scores, in the kernel; a
        sliding layer of a hybrid pool through its group's tables (NOTE(hybrid-blocks))."""
        meta = self.meta
        assert meta is not None
        group = self.kv.window_group.get(layer) if window is not None else None
        if group is not None and meta.window_block_tables:
            slots, tables = meta.window_slot_mapping[group], meta.window_block_tables[group]
        else:
            slots, tables = meta.slot_mapping, meta.block_tables
        return self._paged(layer, q, k, v, slots, tables, scale, window=int(window or 0), softcap=float(softcap or 0.0))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        assert meta is not None
        return self._paged(layer, q, k, v, meta.slot_mapping, meta.block_tables, self.scale)

    def _paged(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               tables: torch.Tensor, scale: float, **opts: Any) -> torch.Tensor:  # fmt: skip
        """Store the step's K/V at ``slots`` and attend over ``tables`` (``opts``: the kernel's window, softcap)."""
        meta, kv = self.meta, self.kv
        assert meta is not None
        q = _rows(q)
        if kv.fmt.is_quantized:
            kv.write(layer, slots, k, v)  # quantize, then store
            return self.kernel.paged_attention(  # type: ignore[no-any-return]
                q, kv.k[layer], kv.v[layer], kv.k_scales[layer], kv.v_scales[layer],
                tables, meta.query_start_loc_t, meta.seq_lens_t, self._skip, scale, **opts,
            )
        # NOTE(kv-write) in paged_attention.cpp: the kernel stores the new K/V itself, then attends
        cache_dtype = kv.k[layer].dtype
        return self.kernel.paged_attention(  # type: ignore[no-any-return]
            q, kv.k[layer], kv.v[layer], self._no_scales, self._no_scales,
            tables, meta.query_start_loc_t, meta.seq_lens_t, self._skip, scale,
            _rows(k.to(cache_dtype)), _rows(v.to(cache_dtype)), slots, **opts,
        )


def available_backends(device: str) -> list[str]:
    names = ["torch"]
    if device == "cpu":
        try:
            load_cpu_kernel()
            names.append("cpu_paged")
        except Exception as e:  # no compiler: the reference still works
            log.warning("cpu_paged attention unavailable (%s); using the torch backend", e)
    return names


def make_attention_backend(name: str | None, device: str, kv: KVCache, scale: float) -> AttentionBackend:
    if name is None:
        name = "cpu_paged" if device == "cpu" and "cpu_paged" in available_backends(device) else "torch"
    if name == "torch":
        return TorchAttention(kv, scale)
    if name == "cpu_paged":
        if device != "cpu":
            raise ValueError("the cpu_paged attention backend runs on the CPU only")
        return CpuPagedAttention(kv, scale)
    raise ValueError(f"unknown attention backend {name!r}: use torch or cpu_paged")
