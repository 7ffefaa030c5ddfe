"""Round-to-nearest quantization at load: float (N, K) weights -> ``QuantWeight``.

    quantize_rtn(w, bits=4, group_size=32, symmetric=False)

Per group of ``G`` consecutive inputs of a row (``G = K``: per channel):

    asymmetric (scale and min):  m = min(w),  d = (max(w) - m) / (2**bits - 1),
                                 q = round((w - m) / d)              in [0, 2**bits)
    symmetric int4 (like Q4_0):  d = w_amax / -8   (w_amax: the value of largest |w|, sign kept),
                                 q = round(w / d) + 8                in [0, 16),  z = 8
    symmetric int8 (like Q8_0):  d = max|w| / 127,  q = round(w / d) + 128   in [1, 256),  z = 128

NOTE(fp16-scales): ``d`` and ``m`` are rounded to fp16 *before* ``q`` is
computed, as ggml does.  That costs nothing measurable (a 2**-11 relative
change of a scale, against a quantization step of 1/15 of the range) and lets
the kernels store scales in fp16 without changing a weight value, exactly as
for GGUF's fp16 scales.
"""

from __future__ import annotations

import torch

from sluice.kernels.qweight import QuantWeight

__all__ = ["quantize_rtn", "RTN_BITS"]

RTN_BITS = (4, 8)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


_ROWS_PER_CHUNK = 128  # keeps each pass over a chunk inside the CPU caches


def _quantize_rows(x: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (rows, groups, G) float32 -> q uint8, d (rows, groups), m (rows, groups)."""
    levels = 2**bits - 1
    if symmetric:
        if bits == 4:  # the value of largest magnitude maps to -8 (Q4_0's layout)
            idx = x.abs().argmax(dim=-1, keepdim=True)
            d = _fp16(x.gather(-1, idx) / -8.0)
            z, lo = 8, 0
        else:
            d = _fp16(x.abs().amax(dim=-1, keepdim=True) / 127.0)
            z, lo = 128, 1
        m = torch.zeros_like(d)
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = (x * inv).round_().add_(z).clamp_(lo, levels)
    else:
        lo_v, hi_v = torch.aminmax(x, dim=-1, keepdim=True)
        m = _fp16(lo_v)
        d = _fp16((hi_v - m) / levels)
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = (x - m).mul_(inv).round_().clamp_(0, levels)
    return q.to(torch.uint8), d.squeeze(-1), m.squeeze(-1)


def quantize_rtn(w: torch.Tensor, bits: int = 4, group_size: int = 32, symmetric: bool = False) -> QuantWeight:
    """Quantize a (N out, K in) float matrix group-wise by rounding to nearest."""
    if w.dim() != 2:
        raise ValueError(f"RTN quantization needs a (N, K) matrix, got shape {tuple(w.shape)}")
    if bits not in RTN_BITS:
        raise ValueError(f"RTN quantization supports bits {RTN_BITS}, got {bits}")
    n, k = w.shape
    g = k if group_size in (-1, 0) else group_size
    if k % 32 or k % g or (g % 32 and g != 16):
        raise ValueError(f"group size {g} must divide K={k} (a multiple of 32) and be a multiple of 32")
    x = w.detach().to(torch.float32).reshape(n, k // g, g)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("cannot quantize a weight matrix that holds inf or nan")
    q = torch.empty((n, k // g, g), dtype=torch.uint8)
    d = torch.empty((n, k // g), dtype=torch.float32)
    m = torch.empty((n, k // g), dtype=torch.float32)
    for r0 in range(0, n, _ROWS_PER_CHUNK):
        r1 = min(n, r0 + _ROWS_PER_CHUNK)
        q[r0:r1], d[r0:r1], m[r0:r1] = _quantize_rows(x[r0:r1], bits, symmetric)
    if not bool(torch.isfinite(d).all()):
        raise ValueError("a group's scale overflows fp16 (weights larger than 65504 in magnitude?)")
    z = 0 if not symmetric else (8 if bits == 4 else 128)
    return QuantWeight(
        q=q.reshape(n, k),
        d=d,
        m=m,
        bits=bits,
        group_size=g,
        zero_point=z,
        source=f"rtn-int{bits}-{'sym' if symmetric else 'asym'}-g{g}",
    )
