"""The C++ extensions: built at install time; the JIT build is a working, cached fallback."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from sluice.kernels import ext
from sluice.kernels.build_spec import EXTENSIONS, SOURCE_HASH_PATTERN, source_hash


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
    # smallest extension, lora, is built (the attention one took 100 s on a 2-core Xeon):
    # ``ext.status()`` with no names would JIT-build all three, ~250 s on a fresh CI machine.
    # NOTE(stale-baton): the lock file of a build killed midway sits in the shared directory;
    # the build must not wait for it (without the flock in ext._build_lock it waits forever).
    build = ext._cache_root() / ext._jit_tag("lora", source_hash("lora", ext.csrc_dir()))
    build.mkdir(parents=True, exist_ok=True)
    (build / "lock").touch()
    code = (
        "import json, torch; from sluice.kernels import ext; m = ext.load('lora');"
        "print(json.dumps(ext.status('lora')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "SLUICE_KERNELS_JIT": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    status = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(status) == ["lora"], status
    info = status["lora"]
    assert info["how"] == "jit" and "kernels" in info["path"], info


def test_a_killed_builds_lock_is_cleared_and_a_live_build_is_waited_for(tmp_path: Path) -> None:
    # NOTE(stale-baton): torch's `lock` file left by a dead build is removed; a live build
    # (one holding the flock) is waited for, and its `lock` is not touched meanwhile
    import fcntl
    import threading

    build = tmp_path / "sluice_attention_x"
    build.mkdir()
    (build / "lock").touch()
    with ext._build_lock(build):
        assert not (build / "lock").exists(), "the dead build's lock file is gone"
        (build / "lock").touch()  # this build's own baton, as cpp_extension takes it
        entered = threading.Event()

        def second() -> None:
            with ext._build_lock(build):
                entered.set()

        t = threading.Thread(target=second, daemon=True)
        t.start()
        assert not entered.wait(0.3), "a second build waits while the first holds the directory"
        assert (build / "lock").exists(), "and leaves the live build's lock alone"
        (build / "lock").unlink()  # the first build releases its baton
    assert entered.wait(5.0), "the second build goes on once the first is done"
    t.join(5.0)
    with open(build / "sluice.flock", "a") as fh:  # nobody holds it afterwards
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_unknown_extension_is_a_clear_error() -> None:
    with pytest.raises(ext.KernelUnavailableError, match="unknown kernel extension"):
        ext.load("nope")


def _fake_module(name: str, digest: str | None) -> tuple[types.ModuleType, list[int]]:
    """A stand-in for a compiled module: ``source_hash()`` returns ``digest`` (None: it has none)."""
    mod = types.ModuleType(name)
    calls: list[int] = []
    mod.set_pool_threads = calls.append  # type: ignore[attr-defined]
    mod.set_pool_active = lambda n: None  # type: ignore[attr-defined]  # NOTE(lane-lend)
    if digest is not None:
        mod.source_hash = lambda: digest  # type: ignore[attr-defined]
    return mod, calls


@pytest.mark.parametrize("built", [None, "sh_0000000000000000"], ids=["no-hash", "other-sources"])
def test_a_stale_prebuilt_extension_is_rebuilt_from_the_sources(monkeypatch: pytest.MonkeyPatch, built: str | None) -> None:
    # NOTE(source-hash): a prebuilt module compiled from other sources (older than the hashes, or
    # from sources edited since) must not run with today's Python: it is compiled again from these.
    # NOTE(stale-no-import): and it is never imported: its pybind11 types would stay registered
    # and the rebuilt module could not register them again
    fresh, calls = _fake_module("fresh", None)
    monkeypatch.setattr(ext, "_REG", ext._Registry())
    monkeypatch.setattr(ext, "_built_digests", lambda module: [built] if built else [])
    monkeypatch.setattr(ext.importlib, "import_module", lambda name: pytest.fail(f"a stale {name} was imported"))
    monkeypatch.setattr(ext, "_jit", lambda name, sources, flags: fresh)
    assert ext.load("attention") is fresh
    info = ext.status("attention")["attention"]
    assert info["how"] == "jit" and "stale build" in info["why"], info
    assert source_hash("attention", ext.csrc_dir()) in info["why"], "the reason names the sources' digest"
    assert (built or "(none") in info["why"], "and the digest the stale build carries"
    assert calls == [0], "the fresh module gets the pool's setting (0: off) as it loads"


def test_a_prebuilt_extension_from_these_sources_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    current, calls = _fake_module("current", source_hash("lora", ext.csrc_dir()))
    monkeypatch.setattr(ext, "_REG", ext._Registry())
    monkeypatch.setattr(ext, "_built_digests", lambda module: [source_hash("lora", ext.csrc_dir())])
    monkeypatch.setattr(ext.importlib, "import_module", lambda name: current)
    monkeypatch.setattr(ext, "_jit", lambda *a: pytest.fail("a current build must not be compiled again"))
    assert ext.load("lora") is current
    assert ext.status("lora")["lora"]["how"] == "prebuilt" and calls == [0]


def test_without_sources_beside_it_a_prebuilt_extension_is_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # an install that ships the compiled modules only: nothing to compare with, nothing to rebuild from
    old, _ = _fake_module("old", None)
    monkeypatch.setattr(ext, "_REG", ext._Registry())
    monkeypatch.setattr(ext, "csrc_dir", lambda: tmp_path / "absent")
    monkeypatch.setattr(ext.importlib, "import_module", lambda name: old)
    monkeypatch.setattr(ext, "_jit", lambda *a: pytest.fail("there are no sources to compile"))
    assert ext.load("quant") is old and ext.status("quant")["quant"]["how"] == "prebuilt"


def test_the_digest_is_read_from_the_module_file_without_importing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "fakepkg_digest"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "built.py").write_text("raise RuntimeError('imported')\nDIGEST = 'sh_0123456789abcdef'\n")
    (pkg / "old.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ext._built_digests("fakepkg_digest.built") == ["sh_0123456789abcdef"]
    assert ext._built_digests("fakepkg_digest.old") == []
    with pytest.raises(ImportError):
        ext._built_digests("fakepkg_digest.absent")
    for name, info in ext.status().items():  # the real extensions: what the file says is what the module says
        if info["how"] == "prebuilt":
            assert ext._built_digests(EXTENSIONS[name][0]) == [ext.load(name).source_hash()], name


def test_every_loaded_extension_carries_the_digest_of_the_sources_beside_it() -> None:
    # what setup.py (or the JIT build) compiled in is what ext.load compares: a build that dropped
    # the -D flag would report "unknown" here, and every load would compile the kernels again
    for name in EXTENSIONS:
        assert ext.load(name).source_hash() == source_hash(name, ext.csrc_dir()), name


def test_the_digest_changes_with_any_header_or_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(ext.csrc_dir(), csrc)
    before = {name: source_hash(name, csrc) for name in EXTENSIONS}
    assert before == {name: source_hash(name, ext.csrc_dir()) for name in EXTENSIONS}, "the path is not hashed"
    assert all(re.fullmatch(SOURCE_HASH_PATTERN, d.encode()) for d in before.values()), "what ext finds in a build"
    with (csrc / "work_pool.h").open("a") as f:  # a header every extension includes
        f.write("\n// edited\n")
    assert all(source_hash(name, csrc) != before[name] for name in EXTENSIONS)
    (csrc / "work_pool.h").write_bytes((ext.csrc_dir() / "work_pool.h").read_bytes())
    module, files, flags = EXTENSIONS["quant"]
    monkeypatch.setitem(EXTENSIONS, "quant", (module, files, [*flags, "-DEXTRA"]))
    assert source_hash("quant", csrc) != before["quant"] and source_hash("lora", csrc) == before["lora"]
