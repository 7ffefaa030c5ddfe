"""load_quantized_weights: the modes, their combinations, fallback patterns and auto, the report,
and sluice's own quantized checkpoint (written atomically, loaded back bit for bit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_factory import write_tiny_gguf

from sluice.kernels.qweight import QuantWeight
from sluice.models.loader import _gguf_reader, gguf_hf_config, load_gguf_state_dict, resolve_model
from sluice.models.quant import is_linear_weight, load_quantized_weights
from sluice.models.quant.checkpoint import MANIFEST, save_quantized
from sluice.models.quant.fallback import choose_fallback, parse_fallback

LINEAR = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tiny_llama_dir, tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf", "Q4_1", "Q8_0")


def test_float_checkpoint_auto_and_none_stay_float(tiny_llama_dir: Path) -> None:
    src = resolve_model(str(tiny_llama_dir))
    for mode in ("auto", "none"):
        sd, report = load_quantized_weights(src, mode, "auto")
        assert report["format"] == "float"
        assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in sd.values()), mode
        assert report["totals"]["num_quantized"] == 0


@pytest.mark.parametrize("mode,bits,zero", [("int4", 4, 0), ("int8", 8, 128)])
def test_rtn_quantizes_linears_and_keeps_embeddings_float(tiny_llama_dir: Path, mode: str, bits: int, zero: int) -> None:
    sd, report = load_quantized_weights(resolve_model(str(tiny_llama_dir)), mode, "none")
    linears = [n for n in sd if is_linear_weight(n)]
    assert len(linears) == 14
    for n in linears:
        assert isinstance(sd[n], QuantWeight) and sd[n].bits == bits and sd[n].zero_point == zero and sd[n].group_size == 32, n
    assert isinstance(sd["model.embed_tokens.weight"], torch.Tensor), "an untied embedding is a lookup: it stays float"
    assert report["layers"]["model.embed_tokens.weight"]["reason"] == "embedding/head"
    head = sd["lm_head.weight"]
    if mode == "int8":  # NOTE(int8-head): an int8 head by default, like GGUF's Q8_0 heads
        assert isinstance(head, QuantWeight) and head.bits == 8
    else:  # int4 heads cost accuracy: float unless asked
        assert isinstance(head, torch.Tensor) and report["layers"]["lm_head.weight"]["reason"] == "embedding/head"
    entry = report["layers"][LINEAR]
    assert entry["precision"].startswith(f"rtn-int{bits}") and entry["bytes"] == sd[LINEAR].nbytes_packed
    assert report["totals"]["bytes"] < report["totals"]["float32_bytes"]


def test_quantize_head_when_asked(tiny_llama_dir: Path) -> None:
    sd, _ = load_quantized_weights(resolve_model(str(tiny_llama_dir)), "int4", "none", quantize_head=True)
    assert isinstance(sd["lm_head.weight"], QuantWeight)
    sd, _ = load_quantized_weights(resolve_model(str(tiny_llama_dir)), "int8", "none", quantize_head=False)
    assert isinstance(sd["lm_head.weight"], torch.Tensor)


def test_fallback_patterns_keep_matching_layers_float(tiny_llama_dir: Path) -> None:
    sd, report = load_quantized_weights(resolve_model(str(tiny_llama_dir)), "int4", "*.down_proj,model.layers.0.*")
    for n in sd:
        if not is_linear_weight(n):
            continue
        should_be_float = n.endswith("down_proj.weight") or n.startswith("model.layers.0.")
        assert isinstance(sd[n], torch.Tensor) == should_be_float, n
        if should_be_float:
            assert report["layers"][n]["reason"] == "pattern"


def test_auto_fallback_meets_the_bound_and_reports_it(tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    src = resolve_model(str(tiny_llama_dir))
    sd, report = load_quantized_weights(src, "int4", "auto", kl_bound=1e-6, calibration_tokens=64)
    me = report["model_error"]
    assert me["metric"] == "kl_nats_per_token" and me["value"] <= 1e-6 < me["all_quantized"]
    floats = [n for n in sd if is_linear_weight(n) and isinstance(sd[n], torch.Tensor)]
    assert floats, "a bound this tight must send some layers back to float32"
    assert all(report["layers"][n]["reason"] == "auto" for n in floats)
    errors = {n: v.get("error_if_quantized", v["error"]) for n, v in report["layers"].items() if is_linear_weight(n)}
    assert all(e > 0 for e in errors.values())
    worst_quantized = max((errors[n] for n in errors if n not in floats), default=0.0)
    assert min(errors[n] for n in floats) >= worst_quantized, "the most sensitive layers are the ones kept in float"
    # a loose bound keeps everything quantized; the choice is cached per file and settings
    sd2, report2 = load_quantized_weights(src, "int4", "auto", kl_bound=10.0, calibration_tokens=64)
    assert all(isinstance(sd2[n], QuantWeight) for n in sd2 if is_linear_weight(n))
    assert len(list((tmp_path / "quant-fallback").glob("*.json"))) == 2


def test_choose_fallback_finds_the_smallest_prefix() -> None:
    errors = {f"l{i}": float(i) for i in range(20)}  # l19 worst
    calls: list[int] = []

    def kl(float_layers: list[str]) -> float:
        calls.append(len(float_layers))
        assert float_layers == [f"l{19 - i}" for i in range(len(float_layers))], "worst layers first"
        return 1.0 - 0.1 * len(float_layers)

    choice = choose_fallback(errors, kl, bound=0.25)
    assert len(choice.float_layers) == 8 and choice.kl <= 0.25
    assert choice.num_evaluations <= 7, f"bisection, not a linear scan: {calls}"
    assert choose_fallback(errors, lambda f: 0.0, bound=0.1).float_layers == []


def test_parse_fallback() -> None:
    assert parse_fallback("AUTO").mode == "auto" and parse_fallback(None).mode == "auto"
    spec = parse_fallback(" *.down_proj , model.layers.0.* ")
    assert spec.patterns == ("*.down_proj", "model.layers.0.*")
    assert spec.matches("model.layers.3.mlp.down_proj.weight") and spec.matches("model.layers.0.self_attn.q_proj.weight")
    assert not spec.matches("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="quant-fallback"):
        parse_fallback(" , ")


@pytest.mark.parametrize(
    "mode,kw,msg",
    [("int3", {}, "choose one of"), ("gguf", {}, "needs a gguf checkpoint"), ("auto", {"group_size": 64}, "int8|int4 only"), ("int4", {"group_size": 48}, "group-size 48")],
)
def test_bad_combinations_are_one_line_errors(tiny_llama_dir: Path, mode: str, kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg) as e:
        load_quantized_weights(resolve_model(str(tiny_llama_dir)), mode, "none", **kw)
    assert "\n" not in str(e.value)


def test_gguf_auto_is_exact_and_none_matches_the_loader(tiny_gguf: Path) -> None:
    src = resolve_model(str(tiny_gguf))
    reader = _gguf_reader(src.path)
    ref = load_gguf_state_dict(reader, src.path, gguf_hf_config(reader, src.path))
    sd, report = load_quantized_weights(src, "gguf", "auto")
    assert report["format"] == "gguf"
    assert sd["model.layers.0.self_attn.q_proj.weight"].source == "gguf:Q4_1"
    assert sd["model.embed_tokens.weight"].source == "gguf:Q8_0", "auto keeps what the checkpoint holds"
    for n, w in sd.items():
        dense = w.dequantize() if isinstance(w, QuantWeight) else w
        assert torch.equal(dense, ref[n]), n
    none, _ = load_quantized_weights(src, "none", "none")
    assert all(torch.equal(none[n], ref[n]) for n in ref)
    pat, rep = load_quantized_weights(src, "auto", "*.q_proj")
    assert isinstance(pat["model.layers.0.self_attn.q_proj.weight"], torch.Tensor)
    assert torch.equal(pat["model.layers.0.self_attn.q_proj.weight"], ref["model.layers.0.self_attn.q_proj.weight"])
    re4, _ = load_quantized_weights(src, "int4", "none", group_size=32)
    assert torch.equal(re4[LINEAR].dequantize(), ref[LINEAR]), "re-quantizing a Q4_1 matrix at int4 g32 is lossless"


def test_sluice_checkpoint_round_trip(tiny_llama_dir: Path, tmp_path: Path) -> None:
    src = resolve_model(str(tiny_llama_dir))
    sd, report = load_quantized_weights(src, "int4", "*.o_proj")
    from sluice.models.loader import load_model_config

    out = save_quantized(tmp_path / "q", sd, load_model_config(src), report, tokenizer_source=src)
    assert (out / MANIFEST).is_file() and (out / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".q.tmp-*")), "no temp dir left behind"
    back, rep = load_quantized_weights(resolve_model(str(out)), "auto", "auto")
    assert rep["format"] == "sluice" and set(back) == set(sd)
    for n, w in sd.items():
        b = back[n]
        if isinstance(w, QuantWeight):
            assert isinstance(b, QuantWeight) and torch.equal(b.q, w.q) and torch.equal(b.d, w.d) and torch.equal(b.m, w.m)
            assert (b.bits, b.group_size, b.zero_point, b.source) == (w.bits, w.group_size, w.zero_point, w.source)
        else:
            assert torch.equal(b, w), n
    save_quantized(out, sd, load_model_config(src), report)  # rewriting a sluice checkpoint replaces it
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a sluice quantized checkpoint"):
        save_quantized(tmp_path / "other", sd, {}, report)
