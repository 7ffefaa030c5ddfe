"""Smoke test of benchmarks/quant_accuracy.py on a tiny random model: it runs end to end, scores
every token once, and the reference path reproduces the float model exactly for 'none'."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.quant_accuracy import main  # noqa: E402


def test_quant_accuracy_smoke(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", str(tiny_llama_dir), "--tokens", "300", "--window", "128", "--prompts", "3", "--prompt-len", "8", "--gen", "6",
            "--paths", "none,int8,int4:g64", "--no-doc", "--reference", "--threads", "1"]  # fmt: skip
    result = main(args)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["benchmark"] == "quant_accuracy", "the last stdout line is the JSON result"
    assert result["tokens"] == 299, "every token after the first is scored exactly once"
    by = {p["path"]: p for p in result["paths"]}
    assert by["none"]["kl"] == 0.0 and by["none"]["greedy_identical"] == 1.0 and by["none"]["ppl_change_pct"] == 0.0
    assert by["int8"]["kl"] < by["int4:g64"]["kl"], "int8 must be closer to the reference than int4"
    assert 0 < by["int4:g64"]["weights_mb"] < by["none"]["weights_mb"]


def test_quant_accuracy_on_the_engine_runs_every_default_kind_of_path(tiny_llama_dir: Path) -> None:
    # the engine's own kernels for what it can load; a group size it does not quantize at (64) on the
    # reference path instead of an argument the engine refuses (the default --paths has int4:g64:auto)
    args = ["--model", str(tiny_llama_dir), "--tokens", "200", "--window", "64", "--prompts", "2", "--prompt-len", "8", "--gen", "4",
            "--paths", "int8,int4:g64", "--no-doc", "--threads", "1"]  # fmt: skip
    result = main(args)
    assert result["via"] == "engine"
    by = {p["path"]: p for p in result["paths"]}
    assert set(by) == {"int8", "int4:g64"}
    assert all(p["ppl"] > 0 and 0.0 <= p["top1_agreement"] <= 1.0 for p in by.values())
    assert 0.0 < by["int8"]["kl"] < by["int4:g64"]["kl"], "int8 must be closer to the reference than int4"
