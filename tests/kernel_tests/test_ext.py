"""The C++ extensions: built at install time; the JIT build is a working, cached fallback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sluice.kernels import ext
from sluice.kernels.build_spec import EXTENSIONS


def test_install_time_builds_are_the_ones_loaded() -> None:
    status = ext.status()
    assert set(status) == set(EXTENSIONS) == {"attention", "quant", "lora"}
    for name, info in status.items():
        assert info["how"] in ("prebuilt", "jit"), f"{name}: {info}"
    if any(info["how"] != "prebuilt" for info in status.values()):
        pytest.skip(f"not installed with its extensions (make install builds them): {status}")


@pytest.mark.slow
def test_jit_fallback_builds_once_and_runs() -> None:
    # NOTE(jit-cache): the default cache directory is shared by every venv on the
    # machine, so this compiles at most once per machine and source version.  Only the
    # attention extension is built (~75 s on a 2-core EPYC): ``ext.status()`` with no
    # names would JIT-build quant and lora too, ~250 s in all on a fresh CI machine.
    code = (
        "import json, torch; from sluice.kernels import ext; m = ext.load('attention');"
        "print(json.dumps(ext.status('attention')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "SLUICE_KERNELS_JIT": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    status = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(status) == ["attention"], status
    info = status["attention"]
    assert info["how"] == "jit" and "kernels" in info["path"], info


def test_unknown_extension_is_a_clear_error() -> None:
    with pytest.raises(ext.KernelUnavailableError, match="unknown kernel extension"):
        ext.load("nope")


def test_a_stale_prebuilt_extension_is_rebuilt_from_the_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    # a prebuilt module from older sources (no work pool bindings) must not be used with today's Python
    import types

    stale = types.ModuleType("stale")
    fresh = types.ModuleType("fresh")
    calls: list[int] = []
    fresh.set_pool_threads = calls.append  # type: ignore[attr-defined]
    monkeypatch.setattr(ext, "_REG", ext._Registry())
    monkeypatch.setattr(ext.importlib, "import_module", lambda name: stale)
    monkeypatch.setattr(ext, "_jit", lambda name, sources, flags: fresh)
    assert ext.load("attention") is fresh
    info = ext.status("attention")["attention"]
    assert info["how"] == "jit" and "stale build" in info["why"], info
    assert calls == [0], "the fresh module gets the pool's setting (0: off) as it loads"
