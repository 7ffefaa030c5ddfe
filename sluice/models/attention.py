"""Attention with the options some architectures add: a sliding window, soft-capped scores, a scale.

    attend(attention, layer, q, k, v, window=4096, softcap=50.0, scale=0.0625)

The engine's backends (sluice/engine/attention.py) compute plain causal
attention over the paged cache.  A layer that needs more goes through here:

- a backend that offers ``attend_ext(layer, q, k, v, window=, softcap=, scale=)``
  runs it itself: the ``cpu_paged`` kernel (NOTE(window-keys) in paged_attention.cpp),
  which reads no block before the window (NOTE(window-read));
- a paged backend without it (anything with ``kv`` and ``meta``): K/V are stored
  through ``kv.write`` like every other row, then each sequence's keys are read
  back with ``kv.gather`` and attended in torch, in float32, with the mask;
- any other callable (a test's reference, the calibration model) gets the options
  as keyword arguments.

NOTE(window-read): a sequence's keys are read from the first block its
step's queries see, never before it.  Where every layer slides, the engine
gives the blocks before the window back to the pool and leaves a placeholder
(-1) in their table entries (NOTE(window-blocks) in
sluice/engine/block_manager.py), so reading from that block on is what keeps
attention off the freed ones.  With global layers interleaved (gemma2/3) the
sliding layers have a pool and block tables of their own, freed the same way
(NOTE(hybrid-blocks) in sluice/engine/hybrid_blocks.py).

Batch invariance: each sequence is attended on its own, over its own keys in
order, so its result does not depend on the other sequences of the step.  On
the kernel it does not depend on how a prompt was chunked either (each row is
reduced over exactly its own keys, NOTE(batch-invariance) in
sluice/engine/attention.py); on the torch path below it may, in the last bits
(torch's matmuls reduce a row differently for different numbers of rows).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["attend", "masked_attention"]


def masked_attention(
    q: torch.Tensor,  # (L, H, D), the last L positions of a context of ctx tokens
    k: torch.Tensor,  # (ctx, Hkv, D)
    v: torch.Tensor,  # (ctx, Hkv, D)
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # (L, H, D)
    ql, h, _ = q.shape
    ctx, hkv = k.shape[0], k.shape[1]
    rep = h // hkv
    qf = q.float().transpose(0, 1)  # (H, L, D)
    kf = k.float().transpose(0, 1).repeat_interleave(rep, dim=0)  # (H, ctx, D)
    vf = v.float().transpose(0, 1).repeat_interleave(rep, dim=0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # (H, L, ctx)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    qpos = torch.arange(ctx - ql, ctx, device=q.device).unsqueeze(1)  # (L, 1)
    kpos = torch.arange(ctx, device=q.device).unsqueeze(0)  # (1, ctx)
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos > qpos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1).to(q.dtype)


def attend(
    attention: Any,
    layer: int,
    q: torch.Tensor,  # (T, H, D)
    k: torch.Tensor,  # (T, Hkv, D), new tokens only
    v: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # (T, H, D)
    native = getattr(attention, "attend_ext", None)
    if native is not None:
        return native(layer, q, k, v, window=window, softcap=softcap, scale=scale)  # type: ignore[no-any-return]
    kv, meta = getattr(attention, "kv", None), getattr(attention, "meta", None)
    if kv is None or meta is None:
        return attention(layer, q, k, v, window=window, softcap=softcap, scale=scale)  # type: ignore[no-any-return]
    # NOTE(hybrid-blocks): a sliding layer of a hybrid pool reads and writes through its group's tables
    group = getattr(kv, "window_group", {}).get(layer) if window is not None else None
    if group is not None and meta.window_block_tables:
        slots, tables = meta.window_slot_mapping[group], meta.window_block_tables[group]
        nblocks = meta.window_num_blocks_per_seq[group]
    else:
        slots, tables, nblocks = meta.slot_mapping, meta.block_tables, meta.num_blocks_per_seq
    kv.write(layer, slots, k, v)
    out = torch.empty_like(q)
    for i in range(meta.num_seqs):
        s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        ctx = meta.seq_lens[i]
        first = 0  # the first position any query of the step sees
        if window is not None:
            first = max(0, ctx - (e - s) - window + 1)
        block_size = kv.k[layer].shape[1]
        skip = first // block_size  # whole blocks out of the window are not read (maybe freed: NOTE(window-read))
        blocks = tables[i, skip : nblocks[i]].long()
        kk, vv = kv.gather(layer, blocks, ctx - skip * block_size, torch.float32)  # (ctx', Hkv, D)
        off = first - skip * block_size
        out[s:e] = masked_attention(q[s:e], kk[off:], vv[off:], scale=scale, window=window, softcap=softcap)
    return out
