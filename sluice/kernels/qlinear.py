"""Quantized linear layers on the CPU: packing, kernel paths, and the GEMM call.

    qw = QuantWeight(...)                  # canonical form (sluice/kernels/qweight.py)
    pw = pack(qw)                          # the kernel layout (sluice/kernels/csrc/qgemm.h)
    xq = quantize_activations(x)           # int8 per 32, once per input
    gemm(xq, pw, out)                      # out = x @ W^T, bit-identical for any batch

Kernel paths (``Path``), chosen at start-up from the CPU's flags:
``avx512vnni`` (zmm vpdpbusd), ``amx`` (tdpbsud on the tile unit, AVX-512
epilogue), ``avxvnni`` (ymm vpdpbusd), ``avx2`` (ymm maddubs), ``scalar``.
They compute the same integer sums and the same float operations in the same
order, so they give bit-identical results: the choice between them
(``sluice/kernels/autotune.py``) is purely a matter of speed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from sluice.kernels import ext
from sluice.kernels.qweight import QuantWeight

__all__ = [
    "Path",
    "PackedWeight",
    "pack",
    "quantize_activations",
    "gemm",
    "dequant_rows",
    "available_paths",
    "best_path",
    "kernel_module",
]

TILE = 16  # output channels per packed tile
BLOCK = 32  # k per packed block (and per activation scale)

MODE_W4, MODE_W8, MODE_W8_SMALL = 0, 1, 2


class Path(enum.IntEnum):
    SCALAR = 0
    AVX2 = 1
    AVXVNNI = 2
    AVX512VNNI = 3
    AMX = 4

    @property
    def label(self) -> str:
        return self.name.lower()


def kernel_module() -> Any:
    return ext.load("quant")


def available_paths() -> list[Path]:
    """Kernel paths this CPU can run, fastest-first by design intent (speed is measured by ``select``)."""
    feats = set(kernel_module().cpu_features())
    paths = []
    if "avx512vnni" in feats and "avx512" in feats:
        paths.append(Path.AVX512VNNI)
    if "amx" in feats:
        # NOTE(amx-second): the tile unit wins from about a dozen rows up and loses
        # below eight (its fixed cost per block); autotune picks it per batch bucket
        # only where it is clearly faster than AVX-512, the preferred path.
        paths.append(Path.AMX)
    if "avxvnni" in feats and "avx2" in feats:
        paths.append(Path.AVXVNNI)
    if "avx2" in feats:
        paths.append(Path.AVX2)
    paths.append(Path.SCALAR)
    return paths


def best_path() -> Path:
    return available_paths()[0]


@dataclass
class PackedWeight:
    """A quantized weight in the kernel layout (see qgemm.h).  Tensors only, so it caches as safetensors."""

    data: torch.Tensor  # (NT * KB * B,) uint8
    scale: torch.Tensor  # (NT, NG, 16) float16 or float32
    mins: torch.Tensor  # (NT, NG, 16) m - d*z, same dtype
    n: int  # output channels (before padding to 16)
    k: int
    group_size: int
    mode: int  # MODE_W4 | MODE_W8 | MODE_W8_SMALL
    zero_point: int  # z of the canonical form (for exact row dequantization)
    bits: int
    source: str = ""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.mins))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"data": self.data, "scale": self.scale, "mins": self.mins}

    def meta(self) -> dict[str, Any]:
        return {
            "n": self.n, "k": self.k, "group_size": self.group_size, "mode": self.mode,
            "zero_point": self.zero_point, "bits": self.bits, "source": self.source,
        }

    @classmethod
    def from_parts(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> PackedWeight:
        return cls(data=tensors["data"], scale=tensors["scale"], mins=tensors["mins"], **meta)


def _fits_fp16(t: torch.Tensor) -> bool:
    h = t.to(torch.float16)
    return bool(torch.isfinite(h).all()) and torch.equal(h.float(), t)


def pack(qw: QuantWeight) -> PackedWeight:
    """Repack the canonical form into the kernel layout.  Scales are kept in fp16 when that is exact."""
    n, k = qw.shape
    g = qw.group_size
    nt, kb = -(-n // TILE), k // BLOCK
    q = qw.q
    if nt * TILE != n:  # pad channels with zero rows (their outputs are never written)
        q = torch.cat([q, q.new_zeros(nt * TILE - n, k)])
    tiles = q.view(nt, TILE, kb, BLOCK)
    if qw.bits == 4:
        # chunk c holds k = 8c..8c+7: low nibble k = 8c+j, high nibble k = 8c+4+j
        v = tiles.view(nt, TILE, kb, 4, 2, 4)
        byte = v[..., 0, :] | (v[..., 1, :] << 4)  # (nt, 16, kb, c=4, j=4)
        data = byte.permute(0, 2, 3, 1, 4).contiguous()  # (nt, kb, c, lane, j)
        mode = MODE_W4
    else:
        v = tiles.view(nt, TILE, kb, 8, 4)  # chunk c holds k = 4c..4c+3
        data = v.permute(0, 2, 3, 1, 4).contiguous()
        mode = MODE_W8_SMALL if int(qw.q.max()) < 128 else MODE_W8
    d = qw.d
    z = qw.zero_point
    if z and bool((qw.m != 0).any()):
        # NOTE(zero-point): no format we read has both; the GEMM is unaffected, and
        # dequant_rows then computes d*q + (m - d*z) (may differ by an ulp).
        z = 0
    mins = qw.m - qw.d * float(qw.zero_point) if qw.zero_point else qw.m
    if nt * TILE != n:
        pad = torch.zeros(nt * TILE - n, d.shape[1])
        d, mins = torch.cat([d, pad]), torch.cat([mins, pad])
    ng = k // g
    d = d.view(nt, TILE, ng).transpose(1, 2).contiguous()
    mins = mins.view(nt, TILE, ng).transpose(1, 2).contiguous()
    if _fits_fp16(d) and _fits_fp16(mins):
        d, mins = d.to(torch.float16), mins.to(torch.float16)
    return PackedWeight(
        data=data.view(-1), scale=d, mins=mins, n=n, k=k, group_size=g, mode=mode,
        zero_point=z, bits=qw.bits, source=qw.source,
    )


ActQ = list[torch.Tensor]  # the 6 tensors of quantize_act (q, dx, dxs, dxs16, xs, xs16)


def quantize_activations(x: torch.Tensor, path: Path = Path.AVX2) -> ActQ:
    """int8 per-32 quantization of x (M, K) float32; identical on every path.

    The path picks the instructions: scalar, AVX2 (the ymm paths) or AVX-512 (the zmm
    and AMX paths), each capped by what this CPU has (NOTE(act-quant-zmm) in qgemm.cpp)."""
    return kernel_module().quantize_act(x, int(path))  # type: ignore[no-any-return]


def gemm(
    xq: ActQ,
    pw: PackedWeight,
    out: torch.Tensor,
    col0: int = 0,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    path: Path = Path.SCALAR,
) -> torch.Tensor:
    """out[:, col0:col0+n] = (residual +) (bias +) x @ W^T."""
    kernel_module().qgemm(
        xq, [pw.data, pw.scale, pw.mins], pw.n, pw.group_size, pw.mode, out, col0, bias, residual, int(path)
    )
    return out


def dequant_rows(pw: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of W as float32, exactly the canonical ``d * (q - z) + m`` (embedding lookup)."""
    return kernel_module().dequant_rows(  # type: ignore[no-any-return]
        [pw.data, pw.scale, pw.mins], pw.n, pw.k, pw.group_size, pw.mode, pw.zero_point, ids
    )
