"""The quantized GEMM: exact integer sums, the documented float steps, every ISA path bit-identical,
and a row's result independent of its batch (sluice/kernels/csrc/qgemm.h)."""

from __future__ import annotations

import pytest
import torch

from sluice.kernels import qlinear as ql
from sluice.kernels.qweight import QuantWeight

PATHS = ql.available_paths()


def rand_qweight(n: int, k: int, bits: int, g: int, z: int = 0, with_min: bool = True, seed: int = 0,
                 fp16_scales: bool = True) -> QuantWeight:
    gen = torch.Generator().manual_seed(seed)
    hi = {4: 16, 5: 32, 6: 64, 8: 256}[bits]
    q = torch.randint(0, hi, (n, k), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // g, generator=gen) * 0.02 + 0.001
    m = torch.randn(n, k // g, generator=gen) * 0.05 if with_min else torch.zeros(n, k // g)
    if fp16_scales:
        d, m = d.half().float(), m.half().float()
    return QuantWeight(q, d, m, bits, g, zero_point=z)


def reference(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """What the kernel computes, in float64: the quantized activations times the exact weights."""
    xq = ql.quantize_activations(x, ql.Path.SCALAR)
    m, k = x.shape
    xd = (xq[0].double().view(m, -1, 32) * xq[1].double().unsqueeze(-1)).view(m, k)
    return xd @ qw.dequantize().double().T


CASES = [
    # n, k, bits, group, zero point, min, fp16 scales
    (40, 64, 4, 32, 0, True, True),  # Q4_1-like, channels not a multiple of 16
    (64, 128, 4, 64, 8, False, True),  # Q4_0-like, group 64
    (48, 96, 8, 32, 128, False, True),  # Q8_0-like: full 8-bit range
    (33, 128, 6, 16, 32, False, False),  # Q6_K-like: groups of 16, fp32 scales
    (40, 96, 4, 16, 0, True, True),  # 4-bit in groups of 16 (a GPTQ/AWQ group_size 16)
    (32, 64, 5, 32, 0, True, False),  # Q5_K-like
    (16, 256, 8, 256, 0, True, True),  # per-channel int8
]


@pytest.mark.parametrize("rows", [7, 32])  # 32: full tiles of 16 rows (NOTE(amx-acc-regs)); 7: a partial one
@pytest.mark.parametrize("n,k,bits,g,z,with_min,fp16", CASES)
def test_every_path_matches_the_reference_and_each_other(n, k, bits, g, z, with_min, fp16, rows) -> None:  # type: ignore[no-untyped-def]
    qw = rand_qweight(n, k, bits, g, z, with_min, fp16_scales=fp16)
    pw = ql.pack(qw)
    assert pw.scale.dtype == (torch.float16 if fp16 else torch.float32), "fp16 scales are kept when exact"
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    ref = reference(x, qw)
    xq = ql.quantize_activations(x)
    outs = {}
    for p in PATHS:
        out = torch.empty(rows, n)
        ql.gemm(xq, pw, out, path=p)
        outs[p] = out
        err = (out.double() - ref).abs().max() / ref.abs().max()
        assert err < 1e-5, f"{p.label}: relative error {err:.2e} against the float64 reference"
    first = outs[PATHS[0]]
    for p, out in outs.items():
        assert torch.equal(out, first), f"{p.label} differs from {PATHS[0].label}: paths must be bit-identical"


@pytest.mark.parametrize("rows", [1, 5, 64])  # 1: one thread; more: rows split over the work pool
def test_activation_quantization_is_the_same_on_every_path(rows: int) -> None:
    x = torch.randn(rows, 160) * torch.logspace(-3, 3, 160)
    x[0, 32:64] = 0.0  # an all-zero block: scale 0, codes 0
    x[-1, 96:128] = torch.tensor([127.0] + [k + 0.5 for k in range(-16, 15)])  # scale 1: ties at .5
    a = ql.quantize_activations(x, ql.Path.SCALAR)
    assert torch.equal(a[0][-1, 97:101], torch.tensor([-16, -14, -14, -12], dtype=torch.int8)), "half to even"
    assert int(a[0][0, 32:64].abs().max()) == 0 and float(a[1][0, 1]) == 0.0
    for path in PATHS:  # the AVX2 and AVX-512 versions (as far as this CPU has them)
        b = ql.quantize_activations(x, path)
        assert all(torch.equal(u, v) for u, v in zip(a, b)), f"{path.label}: activation codes or scales differ"
    assert int(a[0].abs().max()) <= 127, "activations use [-127, 127] so AVX2's maddubs never saturates"
    q, dx = a[0].float().view(rows, 5, 32), a[1]
    assert torch.equal(a[4], q.sum(-1).int()) and torch.equal(a[5], q.view(rows, 10, 16).sum(-1).int())
    assert torch.allclose((q * dx.unsqueeze(-1)).view(rows, 160), x, rtol=0, atol=float(dx.max()) / 2 + 1e-6)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.label)
def test_a_row_gives_the_same_bits_alone_and_in_any_batch(path: ql.Path) -> None:
    qw = rand_qweight(96, 192, 4, 32)
    pw = ql.pack(qw)
    gen = torch.Generator().manual_seed(2)
    row = torch.randn(1, 192, generator=gen)
    alone = torch.empty(1, 96)
    ql.gemm(ql.quantize_activations(row), pw, alone, path=path)
    for m, pos in [(2, 1), (5, 3), (37, 20), (64, 63)]:
        batch = torch.randn(m, 192, generator=gen)
        batch[pos] = row[0]
        out = torch.empty(m, 96)
        ql.gemm(ql.quantize_activations(batch), pw, out, path=path)
        assert torch.equal(out[pos], alone[0]), f"row {pos} of a batch of {m} differs from the row alone"


def test_bias_and_residual_are_added_in_the_epilogue_in_place() -> None:
    qw = rand_qweight(32, 64, 4, 32)
    pw = ql.pack(qw)
    x = torch.randn(3, 64)
    bias = torch.randn(32)
    plain = torch.empty(3, 32)
    ql.gemm(ql.quantize_activations(x), pw, plain, path=PATHS[0])
    resid = torch.randn(3, 40)
    expect = resid.clone()
    expect[:, 8:40] = resid[:, 8:40] + (plain + bias)
    ql.gemm(ql.quantize_activations(x), pw, resid, col0=8, bias=bias, residual=resid, path=PATHS[0])
    assert torch.equal(resid, expect), "out[:, col0:] = residual + (x W^T + bias), columns before col0 untouched"


@pytest.mark.parametrize("bits,g,z,with_min", [(4, 32, 0, True), (4, 32, 8, False), (8, 32, 128, False), (6, 16, 32, False)])
def test_dequantized_rows_equal_the_canonical_form_exactly(bits, g, z, with_min) -> None:  # type: ignore[no-untyped-def]
    qw = rand_qweight(50, 96, bits, g, z, with_min)
    pw = ql.pack(qw)
    ids = torch.tensor([0, 49, 17, 17])
    assert torch.equal(ql.dequant_rows(pw, ids), qw.dequantize()[ids]), "embedding rows must be the exact weights"


def test_packed_int4_takes_half_a_byte_per_weight_plus_fp16_scales() -> None:
    pw = ql.pack(rand_qweight(64, 256, 4, 32))
    assert pw.nbytes == 64 * 256 // 2 + 2 * 2 * 64 * 256 // 32  # Q4_1's 5 bits per weight, exactly


def test_a_path_the_cpu_lacks_is_refused() -> None:
    missing = [p for p in ql.Path if p not in PATHS]
    if not missing:
        pytest.skip("this CPU runs every path")
    pw = ql.pack(rand_qweight(16, 32, 4, 32))
    with pytest.raises(RuntimeError, match="not supported by this CPU"):
        ql.gemm(ql.quantize_activations(torch.randn(1, 32)), pw, torch.empty(1, 16), path=missing[0])
