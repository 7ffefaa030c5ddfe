"""Smoke tests of the KV benchmarks on the tiny model: they run and report sane numbers."""

from __future__ import annotations

import math
import sys
from pathlib import Path

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
