"""Round-to-nearest at load: error bounds, fp16-representable scales, grids reproduced exactly."""

from __future__ import annotations

import pytest
import torch

from sluice.models.quant.rtn import quantize_rtn


def fp16_exact(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.to(torch.float16).to(torch.float32), t))


@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, False), (4, 64, False), (4, 32, True), (8, 32, True), (8, -1, True), (8, 128, False)])
def test_rtn_error_is_within_half_a_step(bits: int, group: int, symmetric: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 256) * 0.05
    qw = quantize_rtn(w, bits=bits, group_size=group, symmetric=symmetric)
    g = 256 if group == -1 else group
    assert qw.shape == (16, 256) and qw.group_size == g and qw.bits == bits
    assert qw.d.shape == (16, 256 // g)
    assert fp16_exact(qw.d) and fp16_exact(qw.m), "scales must be fp16-representable so kernels may store them in fp16"
    err = (qw.dequantize() - w).abs().view(16, 256 // g, g).amax(-1)
    step = qw.d.abs()
    # half a step, plus the clamp at the grid edge for the symmetric int4 layout (one extra step)
    slack = 1.0 if (symmetric and bits == 4) else 0.5
    assert bool((err <= step * slack * 1.01 + 1e-7).all()), f"max error {float((err / step).max()):.3f} steps"


def test_rtn_int4_asym_reproduces_a_q4_1_grid_exactly() -> None:
    # weights already on a per-32 (d, m) grid with fp16 d, m that hit both ends: RTN int4 g32 finds that grid
    torch.manual_seed(1)
    d = (torch.rand(8, 4, 1) * 0.01 + 0.001).half().float()
    m = (torch.randn(8, 4, 1) * 0.02).half().float()
    q = torch.randint(0, 16, (8, 4, 32)).float()
    q[..., 0], q[..., 1] = 0, 15
    w = (d * q + m).reshape(8, 128)
    assert torch.equal(quantize_rtn(w, 4, 32, symmetric=False).dequantize(), w)


def test_rtn_constant_and_zero_groups() -> None:
    w = torch.zeros(2, 64)
    w[1] = 0.5
    for sym in (False, True):
        qw = quantize_rtn(w, 4, 32, symmetric=sym)
        assert torch.isfinite(qw.dequantize()).all()
        assert torch.equal(qw.dequantize()[0], torch.zeros(64)), "an all-zero group must stay zero"


@pytest.mark.parametrize("kwargs,msg", [({"bits": 3}, "bits"), ({"group_size": 48}, "group size"), ({"group_size": 512}, "group size")])
def test_rtn_rejects_bad_settings(kwargs: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        quantize_rtn(torch.randn(4, 256), **kwargs)


def test_rtn_rejects_non_finite_weights() -> None:
    w = torch.randn(2, 32)
    w[0, 3] = float("nan")
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_rtn(w)
