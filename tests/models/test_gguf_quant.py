"""GGUF blocks -> QuantWeight is exact: ``dequantize()`` equals gguf-py's dequantization bit for bit.

Every test writes random *valid* blocks (random bytes, finite fp16 scales of any
sign and magnitude, subnormals and zeros included) into a real GGUF file with
``gguf.GGUFWriter`` and reads it back with ``gguf.GGUFReader``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from sluice.errors import ModelLoadError
from sluice.kernels.qweight import QuantWeight
from sluice.models.loader import _unpermute
from sluice.models.quant.gguf import GGUF_QUANT_TYPES, qweight_from_gguf, unpermute_rows

T = GGMLQuantizationType
# byte offsets of the fp16 fields inside one block of each type
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def finite_fp16_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # inf/nan exponent -> a subnormal
    bits[: min(n, 2)] = [0x0000, 0x8000]  # +0 and -0 scales too
    return bits.view(np.uint8).reshape(n, 2)


def random_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[T[qtype]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        blocks[:, off : off + 2] = finite_fp16_bytes(rng, blocks.shape[0])
    return blocks.reshape(n, k // block * size)


def write_and_read(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]]) -> dict:
    w = GGUFWriter(str(path), "llama")
    for name, (arr, raw) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {t.name: t for t in GGUFReader(str(path)).tensors}


def reference(t) -> torch.Tensor:
    shape = tuple(reversed([int(x) for x in t.shape]))
    return torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)


@pytest.mark.parametrize("qtype", GGUF_QUANT_TYPES)
def test_quant_types_dequantize_exactly_like_gguf_py(tmp_path: Path, qtype: str) -> None:
    block = GGML_QUANT_SIZES[T[qtype]][0]
    n, k = 8, 2 * block if block == 256 else 96
    tensors = write_and_read(tmp_path / "q.gguf", {"w": (random_blocks(qtype, n, k, seed=len(qtype)), T[qtype])})
    qw = qweight_from_gguf(tensors["w"])
    assert isinstance(qw, QuantWeight)
    assert qw.shape == (n, k) and qw.source == f"gguf:{qtype}"
    assert int(qw.q.max()) < 2**qw.bits, "q out of range for its bit width"
    ref = reference(tensors["w"])
    got = qw.dequantize()
    assert torch.equal(got, ref), f"{qtype}: dequantized values differ from gguf-py ({(got != ref).sum()} of {ref.numel()})"


def test_real_quantizer_output_round_trips(tmp_path: Path) -> None:
    # blocks made by gguf-py's own quantizer (not just random bytes) for the types it can write
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    arrays = {name: (quants.quantize(w, T[name]), T[name]) for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")}
    for name, t in write_and_read(tmp_path / "r.gguf", arrays).items():
        assert torch.equal(qweight_from_gguf(t).dequantize(), reference(t)), name


def test_float_types_come_back_as_float32(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((3, 32)).astype(np.float32)
    f16 = rng.standard_normal((3, 32)).astype(np.float16)
    bf16 = quants.quantize(rng.standard_normal((3, 32)).astype(np.float32), T.BF16)
    norm = rng.standard_normal(32).astype(np.float32)
    tensors = write_and_read(
        tmp_path / "f.gguf", {"f32": (f32, None), "f16": (f16, None), "bf16": (bf16, T.BF16), "norm": (norm, None)}
    )
    for name, t in tensors.items():
        got = qweight_from_gguf(t)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, name
        assert torch.equal(got, reference(t)), name
    assert tuple(qweight_from_gguf(tensors["norm"]).shape) == (32,)


@pytest.mark.parametrize("qtype", ["Q2_K", "IQ4_XS"])
def test_unsupported_type_error_names_tensor_type_and_supported(tmp_path: Path, qtype: str) -> None:
    block, size = GGML_QUANT_SIZES[T[qtype]]
    raw = np.zeros((2, size), dtype=np.uint8)
    t = write_and_read(tmp_path / "u.gguf", {"blk.0.attn_q.weight": (raw, T[qtype])})["blk.0.attn_q.weight"]
    with pytest.raises(ModelLoadError) as e:
        qweight_from_gguf(t)
    msg = str(e.value)
    assert "blk.0.attn_q.weight" in msg and qtype in msg and "Q4_K" in msg and "Q8_0" in msg, msg


def test_unpermute_rows_matches_the_loaders_float_unpermute(tmp_path: Path) -> None:
    n_head, n, k = 4, 32, 64
    t = write_and_read(tmp_path / "p.gguf", {"q": (random_blocks("Q4_1", n, k, seed=7), T.Q4_1)})["q"]
    qw = qweight_from_gguf(t)
    un = unpermute_rows(qw, n_head)
    assert isinstance(un, QuantWeight)
    assert torch.equal(un.dequantize(), _unpermute(reference(t), n_head)), "row un-permutation must move q, d and m together"
    dense = unpermute_rows(reference(t), n_head)
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, un.dequantize())


def test_smollm2_state_dict_dequantizes_to_the_loaders_weights() -> None:
    # the shipped Q4_1/Q8_0 model, end to end: names, q/k un-permutation, values
    from sluice.models.loader import (
        _gguf_reader,
        gguf_hf_config,
        load_gguf_state_dict,
        resolve_model,
    )
    from sluice.models.quant.gguf import gguf_quant_state_dict

    src = resolve_model("smollm2")
    reader = _gguf_reader(src.path)
    cfg = gguf_hf_config(reader, src.path)
    ref = load_gguf_state_dict(reader, src.path, cfg)
    got = gguf_quant_state_dict(reader, src.path, cfg)
    assert set(got) == set(ref)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"):
        w = got[name]
        assert isinstance(w, QuantWeight), f"{name} should stay quantized"
        assert torch.equal(w.dequantize(), ref[name]), name
    assert torch.equal(got["model.norm.weight"], ref["model.norm.weight"])
