"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum, as on the hub) -> ``QuantWeight``, exactly.

A quantized linear ``L`` (in K, out N, ``b`` bits, group G, ``P = 32 // b``) is stored as

    L.qweight  (K // P, N)      int32   P values per word along the *input* dim:
                                        bits [j*b, (j+1)*b) of qweight[r, n] = q[r*P + j, n]
    L.qzeros   (K // G, N // P) int32   zeros, P per word along the *output* dim, same bit order
    L.scales   (K // G, N)      fp16
    L.g_idx    (K,)             int32   group of each input row (optional)
    w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])

NOTE(gptq-zero-offset): the original format (``checkpoint_format`` "gptq",
a.k.a. v1) stores ``zero - 1``; readers add 1 back and wrap to ``b`` bits, as
AutoGPTQ's reference dequantization does (``(stored + 1) & (2**b - 1)``).
"gptq_v2" (GPTQModel) stores the zero itself.  ``sym`` does not change the
layout (a symmetric checkpoint simply has every zero at ``2**(b-1)``).

NOTE(act-order): with ``desc_act`` the groups are no longer runs of G
consecutive inputs: ``g_idx`` is a permuted assignment.  The canonical form has
contiguous groups, so such a layer cannot be served quantized without changing
values; ``qweight_from_gptq`` refuses it with a clear error, and
``dequantize_gptq`` (any ``g_idx``) gives its exact float32 weights for
``--quantization none|int8|int4``.  A ``desc_act`` checkpoint whose ``g_idx`` is
trivial (``static_groups``) is served as is.

Canonical form (transposed to (N, K)): ``d = s``, ``m = -(s * zg)``, ``z = 0``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from sluice.errors import ModelLoadError
from sluice.kernels.qweight import QuantWeight
from sluice.models.quant.packing import unpack_int32

__all__ = ["gptq_params", "qweight_from_gptq", "dequantize_gptq", "GptqParams"]

log = logging.getLogger("sluice.models.quant")

GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class GptqParams:
    bits: int  # 4 | 8
    group_size: int  # G; -1: one group per output column (all of K)
    zero_offset: int  # added to stored zeros: 1 for v1 ("gptq") checkpoints, 0 for gptq_v2
    desc_act: bool  # act-order was used (g_idx may be permuted)


def gptq_params(qcfg: dict[str, Any]) -> GptqParams:
    bits = int(qcfg.get("bits", 4))
    fmt = str(qcfg.get("checkpoint_format", qcfg.get("format", "gptq"))).lower()
    if fmt not in GPTQ_FORMATS:
        raise ModelLoadError(
            f"GPTQ checkpoint_format {fmt!r} is not supported (supported: {', '.join(GPTQ_FORMATS)}); "
            f"marlin/bitblas layouts must be converted back to gptq first"
        )
    if bits not in (4, 8):
        raise ModelLoadError(f"GPTQ with {bits} bits is not supported (supported: 4, 8)")
    return GptqParams(bits, int(qcfg.get("group_size", 128)), 1 if fmt == "gptq" else 0, bool(qcfg.get("desc_act", False)))


def _unpack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, p: GptqParams, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """-> q (K, N) int16, zeros (K/G, N) float32, scales (K/G, N) float32, G."""
    per = 32 // p.bits
    k, n = qweight.shape[0] * per, qweight.shape[1]
    g = k if p.group_size in (-1, 0) else p.group_size
    if k % g or tuple(qzeros.shape) != (k // g, n // per) or tuple(scales.shape) != (k // g, n):
        raise ModelLoadError(
            f"GPTQ layer {name}: shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)} do not fit K={k}, N={n}, {p.bits} bits, group {g}"
        )
    q = unpack_int32(qweight.t().contiguous(), p.bits).t()  # (K, N): words run along the input dim
    stored = unpack_int32(qzeros, p.bits)
    if p.zero_offset and bool((stored == (1 << p.bits) - 1).any()):
        log.warning("GPTQ layer %s: a v1 zero point wraps (stored %d): the checkpoint was packed by a v1 packer with a zero of 0", name, (1 << p.bits) - 1)
    zeros = ((stored + p.zero_offset) & ((1 << p.bits) - 1)).to(torch.float32)
    return q, zeros, scales.to(torch.float32), g


def _is_trivial(g_idx: torch.Tensor | None, k: int, g: int) -> bool:
    if g_idx is None:
        return True
    return bool(torch.equal(g_idx.to(torch.int64).flatten(), torch.arange(k, dtype=torch.int64) // g))


def qweight_from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    params: GptqParams,
    name: str = "?",
) -> QuantWeight:
    q, zeros, s, g = _unpack(qweight, qzeros, scales, params, name)
    k = q.shape[0]
    if not _is_trivial(g_idx, k, g):
        raise ModelLoadError(
            f"GPTQ layer {name}: act-order (desc_act) checkpoint with a permuted g_idx: its groups are not "
            f"contiguous, so it cannot be served quantized unchanged; load it with --quantization none "
            f"(exact float32) or int8/int4 (re-quantized from those values)"
        )
    try:
        return QuantWeight(
            q=q.t().to(torch.uint8).contiguous(),
            d=s.t().contiguous(),
            m=(-(s * zeros)).t().contiguous(),
            bits=params.bits,
            group_size=g,
            zero_point=0,
            source=f"gptq-int{params.bits}",
        )
    except ValueError as e:
        raise ModelLoadError(f"GPTQ layer {name}: {e}") from e


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    params: GptqParams,
    name: str = "?",
) -> torch.Tensor:
    """(N, K) float32 ``s * (q - z)`` for any ``g_idx`` (act-order included)."""
    q, zeros, s, g = _unpack(qweight, qzeros, scales, params, name)
    k = q.shape[0]
    idx = (torch.arange(k) // g) if g_idx is None else g_idx.to(torch.int64).flatten()
    if idx.numel() != k or int(idx.min()) < 0 or int(idx.max()) >= s.shape[0]:
        raise ModelLoadError(f"GPTQ layer {name}: g_idx does not index its {s.shape[0]} groups")
    return (s[idx] * (q.to(torch.float32) - zeros[idx])).t().contiguous()
