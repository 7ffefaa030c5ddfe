"""The canonical form of a group-wise quantized weight matrix.

Every weight format sluice reads (GGUF Q4_0/Q4_1/Q8_0 and K-quants, AWQ, GPTQ,
round-to-nearest at load) is converted into this one form, *without changing a
weight value*; the kernels' packers (``sluice.kernels.qlinear``) take it from
there.

    W (N out, K in), groups of G consecutive k within a row:

        w[n, k] = d[n, k // G] * (q[n, k] - z) + m[n, k // G]      (float32 arithmetic)

    q: unsigned integers in [0, 2**bits)   -- uint8, one per weight
    z: one integer zero point per tensor    -- 0, 8, 32, 128 ...
    d: per-group scale                      -- float32
    m: per-group offset ("min")             -- float32, zero for symmetric formats

Examples: GGUF Q4_1 block (d, m, 32 nibbles) -> G=32, bits=4, z=0, d, m as
stored; Q4_0 -> z=8, m=0; Q8_0 (signed q) -> q + 128, z=128, m=0; Q4_K / Q5_K
sub-blocks of 32 -> d = d*sc, m = -(dmin*mn), z=0; Q6_K sub-blocks of 16 ->
G=16, q in [0, 64), z=32, m=0; AWQ/GPTQ ``s * (q - zg)`` with a zero per group
-> d = s, m = -(s*zg), z=0 (exact: s is fp16, so s*q and s*zg are exact in fp32).

``dequantize()`` computes exactly ``d * (q - z) + m`` in float32, which is how
ggml and gguf-py dequantize each of those formats, so a converter is exact when
its ``dequantize()`` equals the format's own dequantization (``torch.equal``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QuantWeight", "SUPPORTED_BITS", "SUPPORTED_GROUPS"]

SUPPORTED_BITS = (4, 5, 6, 8)  # 5/6 (K-quants) are stored like 8-bit values
SUPPORTED_GROUPS = (16, 32, 64, 128, 256)


@dataclass
class QuantWeight:
    q: torch.Tensor  # (N, K) uint8, values in [0, 2**bits)
    d: torch.Tensor  # (N, K // group_size) float32
    m: torch.Tensor  # (N, K // group_size) float32
    bits: int  # 4 | 5 | 6 | 8
    group_size: int  # G: 16 | 32 | 64 | 128 | 256 (per channel: pass K, a multiple of 32)
    zero_point: int = 0  # z, per tensor
    source: str = ""  # where it came from, for reports: 'gguf:Q4_1', 'awq', 'rtn-int4', ...

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.q.dtype != torch.uint8:
            raise ValueError(f"q must be uint8, got {self.q.dtype}")
        if not (0 <= self.zero_point < 2**self.bits):
            raise ValueError(f"zero point {self.zero_point} outside [0, {2**self.bits})")
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        g = self.group_size
        if g < 16 or k % g or (g % 32 and g != 16) or k % 32:
            raise ValueError(f"group size {g} must divide K={k} (a multiple of 32) and be 16 or a multiple of 32")
        shape = (n, k // g)
        for name in ("d", "m"):
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != torch.float32:
                raise ValueError(f"{name} must be float32 of shape {shape}, got {t.dtype} {tuple(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32: ``d * (q - z) + m`` per element, in float32 (exactly as ggml/gguf-py)."""
        g = self.group_size
        n, k = self.shape
        q = self.q.view(n, k // g, g).float()
        if self.zero_point:
            q = q - float(self.zero_point)
        return (self.d.unsqueeze(-1) * q + self.m.unsqueeze(-1)).reshape(n, k)

    @property
    def nbytes_packed(self) -> int:
        """Bytes the kernel layout needs: packed values plus fp16-or-fp32 scales (estimate: fp32)."""
        n, k = self.shape
        vals = n * k // 2 if self.bits == 4 else n * k
        return vals + 2 * 4 * n * (k // self.group_size)
