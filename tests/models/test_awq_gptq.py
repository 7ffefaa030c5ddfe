"""AWQ and GPTQ hub checkpoints unpack exactly into QuantWeight (values, shapes, transposes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hub_factory import (
    awq_pack_cols,
    expected_dense,
    gptq_pack_cols,
    gptq_pack_rows,
    known_layer,
    make_hub_checkpoint,
)

from sluice.errors import ModelLoadError
from sluice.kernels.qweight import QuantWeight
from sluice.models.loader import resolve_model
from sluice.models.quant import load_quantized_weights
from sluice.models.quant.awq import qweight_from_awq
from sluice.models.quant.gptq import GptqParams, dequantize_gptq, qweight_from_gptq


@pytest.mark.parametrize("group", [32, 64, -1])
def test_awq_layer_unpacks_known_integers(group: int) -> None:
    n, k = 48, 128
    g = k if group == -1 else group
    q, z, s = known_layer(n, k, g, 4, seed=2)
    qw = qweight_from_awq(torch.from_numpy(awq_pack_cols(q)), torch.from_numpy(awq_pack_cols(z)), torch.from_numpy(s), group)
    assert qw.shape == (n, k), "AWQ stores (in, out): the canonical form is (out, in)"
    assert torch.equal(qw.q, torch.from_numpy(q.T.astype(np.uint8))), "q values or AWQ's interleaved order are wrong"
    assert torch.equal(qw.d, torch.from_numpy(s.T.astype(np.float32)))
    assert torch.equal(qw.m, -(torch.from_numpy(s.T.astype(np.float32)) * torch.from_numpy(z.T).float()))
    assert qw.zero_point == 0 and qw.group_size == g
    assert torch.equal(qw.dequantize(), expected_dense(q, z, s, np.arange(k) // g))


@pytest.mark.parametrize("bits,fmt", [(4, "gptq"), (4, "gptq_v2"), (8, "gptq"), (8, "gptq_v2")])
def test_gptq_layer_unpacks_known_integers(bits: int, fmt: str) -> None:
    n, k, g = 32, 128, 32
    q, z, s = known_layer(n, k, g, bits, seed=bits, zmin=1)
    stored = (z - 1) if fmt == "gptq" else z  # NOTE: v1 stores zero - 1
    params = GptqParams(bits, g, 1 if fmt == "gptq" else 0, False)
    qw = qweight_from_gptq(
        torch.from_numpy(gptq_pack_rows(q, bits)), torch.from_numpy(gptq_pack_cols(stored, bits)), torch.from_numpy(s), torch.from_numpy(np.arange(k) // g), params
    )
    assert qw.shape == (n, k) and qw.bits == bits
    assert torch.equal(qw.q, torch.from_numpy(q.T.astype(np.uint8))), "GPTQ packs q along the input dim"
    assert torch.equal(qw.m, -(torch.from_numpy(s.T.astype(np.float32)) * torch.from_numpy(z.T).float())), "zero point convention"
    assert torch.equal(qw.dequantize(), expected_dense(q, z, s, np.arange(k) // g))


def test_gptq_v1_zero_wraps_like_autogptq() -> None:
    # a v1 packer given zero 0 stores -1 (all ones); AutoGPTQ reads (stored + 1) & mask == 0
    n, k, g = 8, 64, 32
    q, z, s = known_layer(n, k, g, 4, seed=5)
    z[:] = 0
    params = GptqParams(4, g, 1, False)
    qw = qweight_from_gptq(torch.from_numpy(gptq_pack_rows(q, 4)), torch.from_numpy(gptq_pack_cols((z - 1) & 15, 4)), torch.from_numpy(s), None, params)
    assert torch.equal(qw.dequantize(), expected_dense(q, z, s, np.arange(k) // g))


def test_gptq_act_order_is_refused_quantized_and_exact_dequantized() -> None:
    n, k, g = 16, 128, 32
    q, z, s = known_layer(n, k, g, 4, seed=9, zmin=1)
    g_idx = np.random.default_rng(0).permutation(np.arange(k) // g)
    args = (torch.from_numpy(gptq_pack_rows(q, 4)), torch.from_numpy(gptq_pack_cols(z - 1, 4)), torch.from_numpy(s), torch.from_numpy(g_idx.astype(np.int32)))
    params = GptqParams(4, g, 1, True)
    with pytest.raises(ModelLoadError, match="act-order"):
        qweight_from_gptq(*args, params, name="model.layers.0.mlp.up_proj")
    assert torch.equal(dequantize_gptq(*args, params), expected_dense(q, z, s, g_idx))


def test_awq_shape_mismatch_is_a_clear_error() -> None:
    q, z, s = known_layer(16, 64, 32, 4, seed=1)
    with pytest.raises(ModelLoadError, match="shapes"):
        qweight_from_awq(torch.from_numpy(awq_pack_cols(q)), torch.from_numpy(awq_pack_cols(z)), torch.from_numpy(s[:1]), 32, "x")


@pytest.mark.parametrize("method,fmt", [("awq", "gemm"), ("gptq", "gptq"), ("gptq", "gptq_v2")])
def test_hub_checkpoint_loads_exactly(tmp_path: Path, tiny_llama_dir: Path, method: str, fmt: str) -> None:
    expected = make_hub_checkpoint(tiny_llama_dir, tmp_path / "m", method, fmt=fmt)
    src = resolve_model(str(tmp_path / "m"))
    sd, report = load_quantized_weights(src, "auto", "auto")
    assert report["format"] == method
    for name, dense in expected.items():
        w = sd[name]
        assert isinstance(w, QuantWeight), f"{name} should be served quantized"
        assert torch.equal(w.dequantize(), dense), name
    assert sd["model.norm.weight"].dtype == torch.float32
    ref, _ = load_quantized_weights(src, "none", "none")
    assert all(torch.equal(ref[n], d) for n, d in expected.items()), "--quantization none must give the exact dequantized values"
    # explicitly naming the format works too; naming another one is a clear error
    load_quantized_weights(src, method, "none")
    with pytest.raises(ValueError, match="needs a gguf checkpoint"):
        load_quantized_weights(src, "gguf", "none")


def test_act_order_checkpoint_needs_a_float_or_requantized_load(tmp_path: Path, tiny_llama_dir: Path) -> None:
    expected = make_hub_checkpoint(tiny_llama_dir, tmp_path / "m", "gptq", act_order=True)
    src = resolve_model(str(tmp_path / "m"))
    with pytest.raises(ModelLoadError, match="--quantization none"):
        load_quantized_weights(src, "auto", "none")
    sd, _ = load_quantized_weights(src, "none", "none")
    assert all(torch.equal(sd[n], d) for n, d in expected.items())
    sd4, rep = load_quantized_weights(src, "int4", "none")
    assert isinstance(sd4["model.layers.0.mlp.down_proj.weight"], QuantWeight)


def test_old_autogptq_quantize_config_json_is_detected(tmp_path: Path, tiny_llama_dir: Path) -> None:
    import json

    make_hub_checkpoint(tiny_llama_dir, tmp_path / "m", "gptq", fmt="gptq")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    qcfg = cfg.pop("quantization_config")
    qcfg.pop("quant_method")
    cfg_path.write_text(json.dumps(cfg))
    (tmp_path / "m" / "quantize_config.json").write_text(json.dumps(qcfg))
    sd, report = load_quantized_weights(resolve_model(str(tmp_path / "m")), "auto", "auto")
    assert report["format"] == "gptq" and isinstance(sd["model.layers.0.mlp.up_proj.weight"], QuantWeight)


def test_unsupported_quant_method_is_a_clear_error(tmp_path: Path, tiny_llama_dir: Path) -> None:
    import json
    import shutil

    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="bitsandbytes.*not supported"):
        load_quantized_weights(resolve_model(str(tmp_path / "m")), "auto", "auto")
