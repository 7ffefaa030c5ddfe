"""``sluice quantize report``: the table, bad flags as one-line errors, --out writes a loadable checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from sluice.kernels.qweight import QuantWeight
from sluice.models.cli import register
from sluice.models.loader import resolve_model
from sluice.models.quant import load_quantized_weights


def app() -> typer.Typer:
    a = typer.Typer()

    @a.callback()
    def _root() -> None: ...

    register(a)
    return a


def test_report_prints_a_table_and_writes_a_checkpoint(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "q4"
    r = CliRunner().invoke(app(), ["quantize", "report", str(tiny_llama_dir), "--quantization", "int4", "--group-size", "32", "--quant-fallback", "*.down_proj", "--out", str(out)], env={"COLUMNS": "220"})
    assert r.exit_code == 0, r.output
    assert "model.layers.0.self_attn.q_proj.weight" in r.output and "rtn-int4-asym-g32" in r.output and "pattern" in r.output
    assert "weights:" in r.output and f"wrote {out}" in r.output
    sd, rep = load_quantized_weights(resolve_model(str(out)), "auto", "auto")
    assert rep["format"] == "sluice"
    assert isinstance(sd["model.layers.1.mlp.up_proj.weight"], QuantWeight)
    assert not isinstance(sd["model.layers.1.mlp.down_proj.weight"], QuantWeight)


def test_report_json_and_bad_flags(tiny_llama_dir: Path) -> None:
    r = CliRunner().invoke(app(), ["quantize", "report", str(tiny_llama_dir), "--quantization", "int8", "--quant-fallback", "none", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output.strip().splitlines()[-1])
    assert rep["quantization"] == "int8" and all(v["error"] is not None for k, v in rep["layers"].items() if v["reason"] == "quantized")
    bad = CliRunner().invoke(app(), ["quantize", "report", str(tiny_llama_dir), "--quantization", "gguf"])
    assert bad.exit_code == 2 and "needs a gguf checkpoint" in bad.output
