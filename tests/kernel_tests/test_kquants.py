"""GGUF K-quants (Q4_K, Q5_K, Q6_K) and Q5_0/Q5_1 through the kernels: their canonical forms (groups of
32, or 16 for Q6_K) run the same GEMM, on every path, to the float64 reference of the exact weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from sluice.kernels import qlinear as ql
from sluice.kernels.linear import make_linear
from sluice.models.quant.gguf import qweight_from_blocks

FP16_FIELDS = {"Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:  # sane scales (the converter's own test covers every fp16)
        b[:, off : off + 2] = rng.uniform(1e-3, 2e-2, b.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(n, k // block * size)


@pytest.mark.parametrize("qtype", sorted(FP16_FIELDS))
def test_kquants_run_the_gemm_on_every_path(qtype: str) -> None:
    n, k = 48, 512
    qw = qweight_from_blocks(blocks(qtype, n, k, seed=len(qtype)), qtype, (n, k), name="w")
    lin = make_linear([qw])
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(0))
    xq = ql.quantize_activations(x, ql.Path.SCALAR)
    xd = (xq[0].double().view(6, -1, 32) * xq[1].double().unsqueeze(-1)).view(6, k)
    ref = xd @ qw.dequantize().double().T
    outs = []
    for p in ql.available_paths():
        lin.plan.default = p
        lin.prepare()
        outs.append(lin(x))
        err = float((outs[-1].double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, f"{qtype} on {p.label}: relative error {err:.2e}"
    assert all(torch.equal(o, outs[0]) for o in outs), "every path gives the same bits"
