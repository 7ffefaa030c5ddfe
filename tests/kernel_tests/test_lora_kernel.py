"""The C++ LoRA seam (sluice/kernels/csrc/lora.cpp): right, the same bits on every ISA path,
whatever the other groups of the call, and the same bits as the Linear path it replaces."""

from __future__ import annotations

import pytest
import torch

from sluice.kernels import ext
from sluice.kernels.linear import make_linear, pack_fp32

lora = ext.load("lora")


def seam(g: torch.Generator, k: int, targets: list[tuple[int, int]]) -> tuple[object, torch.Tensor, torch.Tensor]:
    """A seam over ``targets`` [(n, r), ...]: the C++ op, its A (R, k) and its block B (N, R)."""
    rs = [r for _, r in targets]
    a = torch.randn(sum(rs), k, generator=g) * 0.1
    n_total = sum(n for n, _ in targets)
    b = torch.zeros(n_total, sum(rs))
    op = lora.LoRASeam(pack_fp32(a), a.shape[0], k, n_total)
    row = col = 0
    for n, r in targets:
        bt = torch.randn(n, r, generator=g) * 0.1
        b[row : row + n, col : col + r] = bt
        op.add_part(pack_fp32(bt), n, r, row, col)
        row, col = row + n, col + r
    return op, a, b


def test_lora_apply_matches_float64_and_touches_only_its_rows() -> None:
    g = torch.Generator().manual_seed(0)
    ops = [seam(g, 64, [(40, 8), (24, 4), (24, 8)]), seam(g, 64, [(40, 16), (24, 2), (24, 1)])]
    x = torch.randn(13, 64, generator=g)
    out = torch.randn(13, 88, generator=g)
    ref = out.double().clone()
    groups = [(1, 6, 0), (6, 11, 1)]  # rows 0 and 11..12: no adapter
    for s, e, i in groups:
        _, a, b = ops[i]
        ref[s:e] += x[s:e].double() @ a.double().T @ b.double().T
    lora.lora_apply(x, out, [s for s, _, _ in groups], [e for _, e, _ in groups], [ops[i][0] for *_, i in groups])
    assert torch.allclose(out.double(), ref, atol=1e-5), (out.double() - ref).abs().max()
    assert torch.equal(out[0].double(), ref[0]) and torch.equal(out[11:].double(), ref[11:]), "base rows untouched"


@pytest.mark.parametrize("isa", [0, 1, 2])
def test_a_rows_delta_is_the_same_bits_in_any_call_and_on_any_path(isa: int) -> None:
    g = torch.Generator().manual_seed(1)
    op_a, _, _ = seam(g, 96, [(64, 16), (32, 16), (32, 16)])
    op_b, _, _ = seam(g, 96, [(64, 8), (32, 4), (32, 4)])
    x = torch.randn(23, 96, generator=g)
    base = torch.randn(23, 128, generator=g)
    alone = base.clone()
    for row in range(23):  # each row on its own, scalar path
        lora.lora_apply(x[row : row + 1], alone[row : row + 1], [0], [1], [op_a if row < 15 else op_b], 0)
    together = base.clone()
    lora.lora_apply(x, together, [0, 15], [15, 23], [op_a, op_b], isa)
    assert torch.equal(alone, together), "a row's delta depends on its neighbours or on the ISA path"


def test_same_bits_as_the_linear_path() -> None:
    g = torch.Generator().manual_seed(2)
    op, a, b = seam(g, 64, [(64, 8), (16, 8), (16, 8)])
    la, lb = make_linear([a], invariant=True), make_linear([b], invariant=True)
    for lin in (la, lb):
        lin.prepare()
    x = torch.randn(9, 64, generator=g)
    out = torch.randn(9, 96, generator=g)
    via_linear = out.clone()
    lb(la(x), residual=via_linear)
    lora.lora_apply(x, out, [0], [9], [op])
    assert torch.equal(out, via_linear)


def test_bad_shapes_are_refused() -> None:
    g = torch.Generator().manual_seed(3)
    op, _, _ = seam(g, 32, [(16, 4)])
    with pytest.raises(RuntimeError, match="seam shape"):
        lora.lora_apply(torch.randn(2, 48), torch.randn(2, 16), [0], [2], [op])
    with pytest.raises(RuntimeError, match="out of range"):
        lora.lora_apply(torch.randn(2, 32), torch.randn(2, 16), [0], [3], [op])
    with pytest.raises(RuntimeError, match="outside the seam"):
        op.add_part(pack_fp32(torch.randn(16, 8)), 16, 8, 8, 0)
    assert ext.status()["lora"]["how"] in ("prebuilt", "jit")
