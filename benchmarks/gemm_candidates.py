"""Quantized GEMM candidates on this CPU: sluice's kernels against torch's own int8/int4 weight ops.

    python benchmarks/gemm_candidates.py             # SmolLM2's shapes, M = 1, 32, 256
    python benchmarks/gemm_candidates.py --batches 1,13,64,128
    python benchmarks/gemm_candidates.py --no-write

torch 2.13 ships ``_weight_int8pack_mm`` (per-channel int8 weights) and
``_weight_int4pack_mm_for_cpu`` (group-32 int4); both take bf16 activations.
sluice's kernels take float32 activations, quantize them per row to int8 and
use the CPU's best integer dot product (sluice/kernels/csrc/qgemm.cpp).  The
torch ops are not autotune candidates: besides the times below, their bf16
activations and blocking make a row's result depend on the batch, which the
engine's batch invariance forbids (docs/kernels.md).  This script keeps that
choice measured: it prints the table and writes the ``gemm_candidates``
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402
from sluice.kernels import qlinear as ql  # noqa: E402
from sluice.kernels.qweight import QuantWeight  # noqa: E402

# (N, K): SmolLM2-135M's q/k/v fused, o_proj, gate_up fused, down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def best_of(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def rand_weight(n: int, k: int, bits: int, group: int) -> QuantWeight:
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
    d = (torch.rand(n, k // group) * 0.02).half().float()
    m = (torch.randn(n, k // group) * 0.05).half().float()
    return QuantWeight(q, d, m, bits, group)


PATH = ql.best_path()
# the AMX path too where this CPU has it (autotune uses it from ~a dozen rows up)
AMX = ql.Path.AMX if ql.Path.AMX in ql.available_paths() else None


def measure(n: int, k: int, m: int) -> dict[str, float]:
    x = torch.randn(m, k)
    xb = x.to(torch.bfloat16)
    reps = max(3, int(200 / (m * n * k / 1e6 + 1)))
    out = torch.empty(m, n)
    res: dict[str, float] = {}
    for bits in (4, 8):
        pw = ql.pack(rand_weight(n, k, bits, 32))
        res[f"sluice int{bits}"] = best_of(lambda pw=pw: ql.gemm(ql.quantize_activations(x), pw, out, path=PATH), reps)
        if AMX is not None:
            res[f"sluice int{bits} amx"] = best_of(lambda pw=pw: ql.gemm(ql.quantize_activations(x), pw, out, path=AMX), reps)
    w8 = torch.randint(-127, 127, (n, k), dtype=torch.int8)
    s8 = torch.rand(n, dtype=torch.bfloat16)
    res["torch int8pack"] = best_of(lambda: torch._weight_int8pack_mm(xb, w8, s8), reps)
    w4 = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    sz = torch.rand(k // 32, n, 2, dtype=torch.bfloat16)
    res["torch int4pack"] = best_of(lambda: torch._weight_int4pack_mm_for_cpu(xb, w4, 32, sz), reps)
    # not quantized: the ceiling an AMX-BF16 kernel converting the weights in registers could aim at
    # (oneDNN on weights dequantized to bf16 beforehand: 2 bytes a weight read, against 0.625 for Q4_1)
    wb = torch.randn(n, k, dtype=torch.bfloat16)
    res["torch bf16 dense"] = best_of(lambda: torch.nn.functional.linear(xb, wb), reps)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,256", help="rows M of the activations")
    ap.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    a = ap.parse_args()
    ms = [int(v) for v in a.batches.split(",")]
    rows, raw = [], []
    names = ["sluice int4", "sluice int8", *(["sluice int4 amx", "sluice int8 amx"] if AMX else []),
             "torch int4pack", "torch int8pack", "torch bf16 dense"]
    for n, k in SHAPES:
        for m in ms:
            r = measure(n, k, m)
            raw.append({"n": n, "k": k, "m": m, **{key: v * 1e6 for key, v in r.items()}})
            fastest_torch = min(r["torch int4pack"], r["torch int8pack"])
            sluice4 = min(r["sluice int4"], r.get("sluice int4 amx", float("inf")))
            rows.append([f"{n}x{k}", m, *(f"{r[key] * 1e6:.0f}" for key in names),
                         f"{fastest_torch / sluice4:.1f}x"])  # fmt: skip
            print(rows[-1], flush=True)
    table = markdown_table(["N x K", "M", *(f"{key} (us)" for key in names), "sluice int4 speed-up"], rows)
    body = (
        "## Quantized GEMM candidates (`benchmarks/gemm_candidates.py`)\n\n"
        f"{machine_line()}; {torch.get_num_threads()} threads; kernel path "
        f"{PATH.label}. sluice: float32 activations quantized per row + the GEMM (group 32); "
        "torch: bf16 activations (`_weight_int4pack_mm_for_cpu` group 32, `_weight_int8pack_mm` per channel). "
        + ("The `amx` columns: the same GEMM on the AMX path (tile unit + AVX-512 epilogue, same bits). " if AMX else "")
        + "`torch bf16 dense`: `F.linear` on bf16 weights (oneDNN, AMX-BF16 where the CPU has it), not quantized "
        "(2 bytes a weight against 0.625 for Q4_1), for scale. Best of 5. The speed-up is the faster torch quantized "
        "op's time over sluice int4's (its faster path).\n\n" + table + "\n"
    )
    print(table)
    if not a.no_write:
        write_section("gemm_candidates", body)
    print_json_last({"benchmark": "gemm_candidates", "machine": machine_line(), "results": raw})


if __name__ == "__main__":
    main()
