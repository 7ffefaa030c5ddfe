"""The benchmark shape maker (benchmarks/make_llama1b_gguf.py): one float weight set for every type, and
the dense gemma3 / phi3 shapes written as llama.cpp writes them, loaded by sluice."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import make_llama1b_gguf as maker  # noqa: E402


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("pair")
    q4, q8 = maker.main(["--shape", "tiny", "--types", "q4_0,q8_0", "--out", str(out)])
    return q4, q8


def _dequantized(path: Path) -> dict[str, np.ndarray]:
    from gguf import quants

    from sluice.models.files import gguf_reader

    return {t.name: np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32).reshape(-1)
            for t in gguf_reader(path).tensors}  # fmt: skip


def test_q4_0_and_q8_0_files_quantize_the_same_floats(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    q4, q8 = (_dequantized(p) for p in tiny_pair)
    assert q4.keys() == q8.keys()
    w4, w8 = q4["blk.0.ffn_down.weight"], q8["blk.0.ffn_down.weight"]
    # Q8_0 is within 1% of the floats, Q4_0 within ~15%: the same weights if the difference is Q4_0's error
    rel = np.linalg.norm(w4 - w8) / np.linalg.norm(w8)
    assert rel < 0.2, f"the Q4_0 file is not a quantized copy of the Q8_0 file ({rel:.2f} relative difference)"
    assert np.corrcoef(w4, w8)[0, 1] > 0.97
    np.testing.assert_array_equal(q4["token_embd.weight"], q8["token_embd.weight"])  # Q8_0 in both
    # a file written alone has the same floats as one written with the other type (seeded per tensor)
    [alone] = maker.main(["--shape", "tiny", "--types", "q8_0", "--out", str(tmp_path)])
    np.testing.assert_array_equal(_dequantized(alone)["blk.1.attn_q.weight"], q8["blk.1.attn_q.weight"])


def test_an_unknown_type_or_a_bad_shape_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown type 'q5_0'"):
        maker.write_ggufs({"q5_0": tmp_path / "x.gguf"}, maker.SHAPES["tiny"])
    bad = maker.Shape(hidden=100, layers=1, heads=2, kv_heads=1, head_dim=64, intermediate=256)
    with pytest.raises(ValueError, match="hidden = 100 is not a multiple of 32"):
        maker.write_ggufs({"q4_0": tmp_path / "x.gguf"}, bad)
    assert not list(tmp_path.iterdir()), "no file (nor .tmp) left behind"


@pytest.mark.parametrize("shape", ["gemma3-tiny", "phi3-tiny"])
def test_dense_gemma3_and_phi3_shapes_load_quantized(shape: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.models.attention import masked_attention
    from sluice.models.loader import load_model, resolve_model

    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    [path] = maker.main(["--shape", shape, "--types", "q4_0", "--out", str(tmp_path)])
    s = maker.SHAPES[shape]
    model = load_model(resolve_model(str(path)), torch.float32, quantization="auto")
    cfg = model.cfg
    assert cfg.arch == s.arch and (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim)
    if s.arch == "gemma3":
        assert cfg.sandwich_norms and cfg.qk_norm == "head" and cfg.sliding_window == s.sliding_window
        assert cfg.layer_types.count("full_attention") == 1, "one global layer in 6 (7 layers: the 6th)"
    else:
        assert cfg.partial_rotary_factor == s.rotary_dim / s.head_dim
    assert any(lin.is_quantized for lin in model.linears().values()), "the file's Q4_0 blocks served as they are"
    att = lambda layer, q, k, v, **o: masked_attention(q, k, v, **{"scale": cfg.head_dim**-0.5, **o})  # noqa: E731
    logits = model.compute_logits(model(torch.tensor([10, 20, 30]), torch.arange(3), att))
    assert logits.shape == (3, cfg.vocab_size) and torch.isfinite(logits).all()


def test_the_new_shapes_are_gemma3_1b_and_phi4_minis_layer() -> None:
    g, p = maker.SHAPES["gemma3-1b"], maker.SHAPES["phi3"]
    assert (g.hidden, g.layers, g.heads, g.kv_heads, g.head_dim, g.intermediate) == (1152, 26, 4, 1, 256, 6912)
    assert (p.hidden, p.heads, p.kv_heads, p.head_dim, p.intermediate, p.rotary_dim) == (3072, 24, 8, 128, 8192, 96)
