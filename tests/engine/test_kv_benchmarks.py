"""Smoke tests of the KV benchmarks on the tiny model: they run and report sane numbers."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import kv_accuracy  # noqa: E402


def test_kv_accuracy_benchmark_reports_every_metric(tiny_llama: Path) -> None:
    ids = torch.randint(3, 49000, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    res = kv_accuracy.run(str(tiny_llama), ["int8"], [600], num_prompts=2, gen_tokens=4,
                          kv_memory=4 << 20, capacity_memory=1 << 20, token_ids=ids)
    (row,) = res["rows"]
    m = row["600"]
    assert math.isfinite(m["ppl"]) and abs(m["ppl_change"]) < 0.05, "int8 KV should barely move perplexity"
    assert 0 <= m["kl_mean"] < 0.05 and 0.5 < m["top1_agree"] <= 1
    assert 0 <= row["greedy_agree"] <= 1
    assert row["capacity_tokens"] > res["reference_capacity_tokens"]
    text = kv_accuracy.report(res, [600], 4, 2, 1 << 20)
    assert "int8" in text and "ppl change @600" in text


def test_kv_tiers_benchmark_sections_run_and_hit(tiny_llama: Path, tmp_path: Path) -> None:
    from benchmarks import kv_tiers

    t = kv_tiers.ttft_section(str(tiny_llama), 64, 2, 2, 1 << 20, str(tmp_path / "a"))
    assert t["restart_prefix_hit_rate"] == 1.0 and t["disk_hit_rate"] == 1.0, t
    assert len(t["cold"]) == 2 and len(t["after_restart"]) == 2
    c = kv_tiers.concurrency_section(str(tiny_llama), 64, 1 << 20, str(tmp_path / "b"), n=4)
    assert c["blocks_read"] == c["prefix_blocks"] == 4, "4 requests on one on-disk prefix read it once"


@pytest.mark.slow
def test_kv_restart_example_runs() -> None:
    import subprocess

    example = Path(__file__).resolve().parents[2] / "examples" / "kv_restart.py"
    proc = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "same answers after the restart: True" in proc.stdout, proc.stdout
    assert "[after restart] cached" in proc.stdout and "[after restart] disk tier" in proc.stdout
