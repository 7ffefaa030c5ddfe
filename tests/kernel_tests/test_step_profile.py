"""``benchmarks/_step_profile.py``: where a decode step's milliseconds go, attention included on the fused
layers' path (the backend's ``attend_qkv``), and the backend's methods are the same after the profile."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks._step_profile import step_profile
from sluice.engine.attention import AttentionBackend, CpuPagedAttention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from gguf_factory import write_tiny_gguf  # noqa: E402


def test_the_profile_times_attention_on_the_fused_path_and_restores_the_backend(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    path = str(write_tiny_gguf(tiny_llama_dir, tmp_path / "tiny-q4_1.gguf", "Q4_1", "Q8_0"))
    before = {c: dict(vars(c)) for c in (CpuPagedAttention, AttentionBackend)}
    prof = step_profile(path, batch=4, ctx=64, steps=3, kv_cache_memory=16 << 20)
    ms = prof["breakdown_ms"]
    assert ms["attention"] > 0.0, f"the paged attention of every layer is timed: {ms}"
    assert ms["decoder layers excl. attention (GEMMs, norms, rope, SiLU, residuals)"] > 0.0, ms
    for c, attrs in before.items():
        assert dict(vars(c)) == attrs, f"{c.__name__}'s methods are put back as they were"
