"""Speculative decoding on SmolLM2: greedy output bit-identical to decoding without drafts, on the default
(Q4_1, batch-invariant) path, with n-gram drafts and with the target's own copy drafting, through preemption."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.engine.protocol import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "List the days of the week, one per line.",
    "def fibonacci(n):",
    "What is the capital of France?",
    "Count from one to twenty in words.",
]


def _generate(spec: dict[str, Any] | None, **kw: Any) -> tuple[list[list[int]], Any]:
    from sluice import LLM

    llm = LLM("smollm2", speculative_config=spec, max_num_seqs=8, **kw)
    ids = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                add_special_tokens=False) for p in PROMPTS]  # fmt: skip
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True))
    return [o.token_ids for o in outs], llm.engine


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4, "k_policy": "fixed"},
                                  {"model": "self:q4", "num_speculative_tokens": 3, "k_policy": "fixed"},
                                  "auto"], ids=["ngram", "self_q4", "auto"])  # fmt: skip
def test_greedy_output_is_bit_identical_through_preemption(spec: Any) -> None:
    small = dict(kv_cache_memory=24 * 2 * 30 * 16 * 3 * 64 * 4)  # 24 blocks; 5 requests of ~8 blocks each preempt
    base, _ = _generate(None, **small)
    got, engine = _generate(spec, **small)
    assert got == base, "speculation must not change a greedy answer"
    s = engine.make_stats()
    assert s.num_preemptions > 0, "the KV cache should be small enough to preempt"
    assert s.spec_accepted_tokens > 0, f"drafts should be kept ({s.spec_accepted_tokens}/{s.spec_drafted_tokens})"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_speculative_example_runs_with_the_same_tokens() -> None:
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "speculative.py"
    proc = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if "same tokens" in ln]
    assert [ln.split(": ")[0] for ln in lines] == ["ngram, Q4_1 path", "self:q4, float32 target"], proc.stdout
    for ln in lines:
        assert "same tokens: True" in ln, ln
        m = re.search(r"drafted (\d+), kept (\d+)", ln)
        assert m and int(m.group(2)) > 0, f"drafts were kept: {ln}"
    assert "Paris" in proc.stdout, "the float32 answer"
