"""The converted-weights cache's bound: least recently used entries go, in-use ones stay (NOTE(model-cache-bound))."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from model_factory import make_tiny_model_dir

from sluice.errors import ModelLoadError
from sluice.models.loader import load_model, resolve_model
from sluice.models.model_cache import (
    MIN_AGE_S,
    STALE_S,
    bound_cache,
    cache_entries,
    max_cache_bytes,
)
from sluice.models.source import model_cache_root


def _entry(root: Path, name: str, size: int, age: float) -> Path:
    p = root / name / "variant"
    p.mkdir(parents=True)
    (p / "model.safetensors").write_bytes(b"x" * size)
    t = time.time() - age
    os.utime(p.parent, (t, t))
    return p.parent


def test_the_least_recently_used_go_first_until_under_the_bound(tmp_path: Path) -> None:
    old = _entry(tmp_path, "old", 1000, age=3 * MIN_AGE_S)
    mid = _entry(tmp_path, "mid", 1000, age=2 * MIN_AGE_S)
    new = _entry(tmp_path, "new", 1000, age=1.5 * MIN_AGE_S)
    assert [e.path for e in cache_entries(tmp_path)] == [old, mid, new]
    assert sum(e.size for e in cache_entries(tmp_path)) == 3000
    assert bound_cache(tmp_path, max_bytes=2500) == [old]
    assert not old.exists() and mid.exists() and new.exists()
    assert bound_cache(tmp_path, max_bytes=1000) == [mid]
    assert [p.name for p in tmp_path.iterdir()] == ["new"], "nothing left behind, not even the renamed entry"


def test_the_entry_just_written_and_entries_in_use_are_kept(tmp_path: Path) -> None:
    written = _entry(tmp_path, "written", 1000, age=10 * MIN_AGE_S)
    in_use = _entry(tmp_path, "in-use", 1000, age=MIN_AGE_S / 2)  # another process may be reading it
    idle = _entry(tmp_path, "idle", 1000, age=5 * MIN_AGE_S)
    assert bound_cache(tmp_path, keep=written, max_bytes=0) == [idle]
    assert written.exists() and in_use.exists()


def test_a_crashs_leftovers_are_swept_when_stale(tmp_path: Path) -> None:
    entry = _entry(tmp_path, "e", 10, age=0)
    stale_tmp, fresh_tmp = entry / ".tmp-a", entry / ".tmp-b"
    stale_evict = tmp_path / ".evict-x-123"
    for d in (stale_tmp, fresh_tmp, stale_evict):
        d.mkdir()
    t = time.time() - 2 * STALE_S
    for d in (stale_tmp, stale_evict):
        os.utime(d, (t, t))
    bound_cache(tmp_path)  # the default bound, far above these entries: only the sweep acts
    assert not stale_tmp.exists() and not stale_evict.exists()
    assert fresh_tmp.exists(), "a write under way is not touched"
    assert (entry / "variant" / "model.safetensors").exists()


def test_the_bound_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_MODEL_CACHE_MAX_GB", raising=False)
    assert max_cache_bytes() == 20 * 2**30
    monkeypatch.setenv("SLUICE_MODEL_CACHE_MAX_GB", "0.5")
    assert max_cache_bytes() == 2**29
    monkeypatch.setenv("SLUICE_MODEL_CACHE_MAX_GB", "0")
    assert max_cache_bytes() is None
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv("SLUICE_MODEL_CACHE_MAX_GB", bad)
        with pytest.raises(ModelLoadError, match="SLUICE_MODEL_CACHE_MAX_GB"):
            max_cache_bytes()


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_loads_under_a_bound_evict_the_idle_model_and_convert_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path
) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SLUICE_MODEL_CACHE_MAX_GB", str(1 / 1024))  # 1 MiB: less than one converted tiny model
    a = resolve_model(str(tiny_llama_dir))
    b = resolve_model(str(make_tiny_model_dir(tmp_path / "other", "llama", seed=4)))
    first = _tensors(load_model(a, torch.float32, quantization="int8"))
    root_a = model_cache_root(a)
    assert (root_a / "config.json").is_file(), "the model just written stays, whatever the bound"
    t = time.time() - 2 * MIN_AGE_S  # a is idle now
    os.utime(root_a, (t, t))
    load_model(b, torch.float32, quantization="int8")
    assert not root_a.exists() and model_cache_root(b).exists()
    assert [e.path for e in cache_entries(root_a.parent)] == [model_cache_root(b)]
    again = _tensors(load_model(a, torch.float32, quantization="int8"))  # converted again: the same model
    assert again.keys() == first.keys()
    for k in first:
        torch.testing.assert_close(again[k], first[k], rtol=0, atol=0, msg=k)
    os.utime(root_a, (t, t))
    load_model(a, torch.float32, quantization="int8")  # a hit marks the entry used
    assert root_a.stat().st_mtime > t + MIN_AGE_S


def test_a_bad_bound_is_one_clear_error_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SLUICE_MODEL_CACHE_MAX_GB", "lots")
    with pytest.raises(ModelLoadError, match="number of GiB"):
        load_model(resolve_model(str(tiny_llama_dir)), torch.float32, quantization="int8")
    assert not (tmp_path / "models-v3").exists()


def test_a_quantized_head_is_its_own_cache_variant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path) -> None:
    """int4 at load keeps a float head unless asked (NOTE(int8-head)); a draft model asks (NOTE(draft-head)), and
    the two conversions are cached apart: neither load is served the other's head."""
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    src = resolve_model(str(tiny_llama_dir))

    def head_kind(model: torch.nn.Module) -> list[tuple[str, int | None]]:
        return [(part["kind"], part.get("bits")) for part in model.manifest()["lm_head"]["parts"]]

    for _ in range(2):  # converted, then read back from the cache
        assert head_kind(load_model(src, torch.float32, quantization="int4", quant_fallback="none")) == [("fp32", None)]
        quantized = load_model(src, torch.float32, quantization="int4", quant_fallback="none", quantize_head=True)
        assert head_kind(quantized) == [("quant", 4)]
    assert len([p for p in model_cache_root(src).iterdir() if p.is_dir()]) == 2
