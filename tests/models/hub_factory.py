"""Build AWQ / GPTQ checkpoints from known integers, with packers written from the formats' docs.

Deliberately independent of sluice's unpackers (plain loops over numpy uint32):

    AWQ (GEMM):  qweight (K, N/8): word c of row k holds q[k, 8c + ORDER[i]] in bits 4i..4i+3,
                 ORDER = 0 2 4 6 1 3 5 7; qzeros (K/G, N/8) packed alike; scales (K/G, N) fp16
    GPTQ:        qweight (K/P, N): word r of column n holds q[rP + j, n] in bits bj..bj+b-1;
                 qzeros (K/G, N/P): word c of group row holds zero[., cP + j] in bits bj..;
                 v1 ("gptq") stores zero - 1, gptq_v2 the zero; g_idx (K,) int32
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

AWQ_DOC_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_pack_cols(v: np.ndarray) -> np.ndarray:
    rows, cols = v.shape
    out = np.zeros((rows, cols // 8), dtype=np.uint32)
    for c in range(cols // 8):
        for i, col in enumerate(AWQ_DOC_ORDER):
            out[:, c] |= v[:, 8 * c + col].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def gptq_pack_rows(v: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    rows, cols = v.shape
    out = np.zeros((rows // per, cols), dtype=np.uint32)
    for r in range(rows // per):
        for j in range(per):
            out[r] |= (v[r * per + j].astype(np.uint32) & np.uint32((1 << bits) - 1)) << np.uint32(bits * j)
    return out.view(np.int32)


def gptq_pack_cols(v: np.ndarray, bits: int) -> np.ndarray:
    return np.ascontiguousarray(gptq_pack_rows(np.ascontiguousarray(v.T), bits).T)


def known_layer(n: int, k: int, g: int, bits: int, seed: int, zmin: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (K, N), zeros (K/G, N), scales (K/G, N) fp16 -- the (in, out) orientation of the hub formats."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 1 << bits, size=(k, n))
    z = rng.integers(zmin, 1 << bits, size=(k // g, n))
    s = (rng.standard_normal((k // g, n)) * 0.01).astype(np.float16)
    return q, z, s


def expected_dense(q: np.ndarray, z: np.ndarray, s: np.ndarray, g_idx: np.ndarray) -> torch.Tensor:
    """(N, K) float32 ``s[g] * (q - z[g])`` -- the formats' own dequantization, computed in float32."""
    w = torch.from_numpy(s[g_idx].astype(np.float32)) * (torch.from_numpy(q).float() - torch.from_numpy(z[g_idx]).float())
    return w.t().contiguous()


LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def make_hub_checkpoint(
    tiny_dir: Path, out: Path, method: str, group: int = 32, bits: int = 4, fmt: str = "gptq", act_order: bool = False
) -> dict[str, torch.Tensor]:
    """Copy a tiny float model to ``out`` with every decoder linear replaced by a quantized one.
    Returns the expected float32 (N, K) weight of each linear."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_dir, out)
    sd = load_file(str(out / "model.safetensors"))
    expected: dict[str, torch.Tensor] = {}
    for seed, name in enumerate(sorted(k for k in sd if any(k.endswith(p + ".weight") for p in LINEARS))):
        n, k = sd.pop(name).shape
        p = name[: -len(".weight")]
        q, z, s = known_layer(n, k, group, bits, seed, zmin=1 if fmt == "gptq" else 0)
        g_idx = np.arange(k) // group
        if method == "awq":
            sd[p + ".qweight"] = torch.from_numpy(awq_pack_cols(q))
            sd[p + ".qzeros"] = torch.from_numpy(awq_pack_cols(z))
        else:
            if act_order:
                g_idx = np.random.default_rng(seed).permutation(g_idx)
            stored = (z - 1) & ((1 << bits) - 1) if fmt == "gptq" else z
            sd[p + ".qweight"] = torch.from_numpy(gptq_pack_rows(q, bits))
            sd[p + ".qzeros"] = torch.from_numpy(gptq_pack_cols(stored, bits))
            sd[p + ".g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        sd[p + ".scales"] = torch.from_numpy(s)
        expected[name] = expected_dense(q, z, s, g_idx)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    if method == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        cfg["quantization_config"] = {
            "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False, "checkpoint_format": fmt,
        }
    (out / "config.json").write_text(json.dumps(cfg))
    from tests.model_factory import stable_mtimes

    stable_mtimes(out)  # one cache key for the same checkpoint run after run
    return expected
