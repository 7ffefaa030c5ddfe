"""AWQ checkpoints (AutoAWQ "GEMM" layout, as on the hub) -> ``QuantWeight``, exactly.

A quantized linear ``L`` (in K, out N, group G, 4 bits) is stored as

    L.qweight  (K, N // 8)   int32   eight 4-bit q per word, along the *output* dim
    L.qzeros   (K // G, N // 8) int32  the zero of each (group, column), packed alike
    L.scales   (K // G, N)   fp16
    w[n, k] = scales[k // G, n] * (q[k, n] - zeros[k // G, n])

and packed in AWQ's interleaved order: value ``i`` of a word (bits 4i..4i+3)
is output column ``8c + AWQ_ORDER[i]``:

    word c:  bits  0-3  4-7  8-11 12-15 16-19 20-23 24-27 28-31
             col   8c+0 8c+2 8c+4 8c+6  8c+1  8c+3  8c+5  8c+7

Canonical form (transposed to (N, K)): ``d = s``, ``m = -(s * zg)``, ``z = 0``.
Exact: ``s`` is fp16, so ``s*q`` and ``s*zg`` are exact in float32 and their
sum is exactly ``s * (q - zg)``.
"""

from __future__ import annotations

from typing import Any

import torch

from sluice.errors import ModelLoadError
from sluice.kernels.qweight import QuantWeight
from sluice.models.quant.packing import unpack_int32

__all__ = ["AWQ_ORDER", "qweight_from_awq", "awq_params"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word slot i holds column AWQ_ORDER[i] of its 8
_AWQ_COLUMN_TO_SLOT = tuple(AWQ_ORDER.index(j) for j in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)


def awq_params(qcfg: dict[str, Any]) -> tuple[int, int]:
    """(bits, group size) of an AWQ ``quantization_config``; refuses layouts other than GEMM."""
    bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
    group = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
    version = str(qcfg.get("version", "gemm")).lower()
    if version not in ("gemm", "exllama", "ipex"):  # exllama/ipex kernels load GEMM-layout checkpoints
        raise ModelLoadError(f"AWQ version {version!r} is not supported (supported: the GEMM layout)")
    if bits != 4:
        raise ModelLoadError(f"AWQ with {bits} bits is not supported (supported: 4)")
    if qcfg.get("zero_point", True) is False:
        raise ModelLoadError("AWQ without zero points (zero_point: false) is not supported")
    return bits, group


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 AWQ words -> (R, 8C) int16 values in column order."""
    r, c = words.shape
    slots = unpack_int32(words, 4).reshape(r, c, 8)
    return slots[:, :, list(_AWQ_COLUMN_TO_SLOT)].reshape(r, 8 * c)


def qweight_from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int, name: str = "?"
) -> QuantWeight:
    k, n8 = qweight.shape
    n = 8 * n8
    g = k if group_size in (-1, 0) else group_size
    if k % g or tuple(qzeros.shape) != (k // g, n8) or tuple(scales.shape) != (k // g, n):
        raise ModelLoadError(
            f"AWQ layer {name}: shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)} do not fit K={k}, N={n}, group {g}"
        )
    q = _unpack_awq(qweight)  # (K, N)
    zeros = _unpack_awq(qzeros).to(torch.float32)  # (K/G, N)
    s = scales.to(torch.float32)
    try:
        return QuantWeight(
            q=q.t().to(torch.uint8).contiguous(),
            d=s.t().contiguous(),
            m=(-(s * zeros)).t().contiguous(),
            bits=4,
            group_size=g,
            zero_point=0,
            source="awq",
        )
    except ValueError as e:
        raise ModelLoadError(f"AWQ layer {name}: {e}") from e
