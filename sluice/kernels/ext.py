"""Load sluice's C++ extensions: the build made at install time, else a cached JIT build.

    from sluice.kernels import ext
    mod = ext.load("attention")      # raises KernelUnavailableError with the reason
    ext.status()                     # {"attention": {"how": "prebuilt", ...}, ...} for `sluice doctor`
    ext.set_work_pool(2)             # the kernels' parallel loops on sluice's work pool (NOTE(work-pool))
    ext.work_pool_waits()            # what the loops waited for chunks other threads held (NOTE(pool-waits))

NOTE(jit-cache): the fallback JIT build goes to
``<sluice cache>/kernels/<name>-<hash>`` where the hash covers the sources, the
flags and the torch version, so two virtual environments (or two checkouts)
on one machine share a build instead of rebuilding in turn.  A prebuilt module
is used only when it was compiled from the sources installed beside it
(NOTE(source-hash) in ``build_spec.py``); a stale one is rebuilt like a missing one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from sluice.kernels.build_spec import (
    EXTENSIONS,
    SOURCE_HASH_MACRO,
    SOURCE_HASH_PATTERN,
    source_hash,
)

__all__ = [
    "load", "status", "set_work_pool", "set_work_pool_active", "work_pool_threads", "work_pool_waits", "PoolWaits", "KernelUnavailableError",
    "csrc_dir",
]

log = logging.getLogger("sluice.kernels")


class KernelUnavailableError(RuntimeError):
    """A C++ extension could be neither imported nor compiled."""


class _Registry:
    # NOTE(process-state): a loaded extension is process-wide by nature; this
    # records how each one was obtained so `sluice doctor` can say it.
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.modules: dict[str, ModuleType] = {}
        self.info: dict[str, dict[str, Any]] = {}
        self.pool_threads = 0  # NOTE(work-pool): 0, torch's OpenMP; else every extension's loops on the pool
        self.pool_active = 0  # NOTE(lane-lend): at most this many of them run a loop (0: all)


_REG = _Registry()


def csrc_dir() -> Path:
    return Path(__file__).resolve().parent / "csrc"


def _cache_root() -> Path:
    root = os.environ.get("SLUICE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "sluice"
    )
    return Path(root) / "kernels"


def _jit_tag(name: str, digest: str) -> str:
    """The JIT build's module name and its folder under the cache (NOTE(jit-cache)): extension ``name``
    compiled from sources of ``digest`` (``source_hash``) against this torch."""
    import torch

    return f"sluice_{name}_{digest[3:]}_{hashlib.sha256(torch.__version__.encode()).hexdigest()[:6]}"


def _jit(name: str, sources: list[Path], flags: list[str]) -> ModuleType:
    from torch.utils.cpp_extension import load as cpp_load

    digest = source_hash(name, sources[0].parent)  # NOTE(source-hash): the headers and .inc files too
    tag = _jit_tag(name, digest)
    build = _cache_root() / tag
    build.mkdir(parents=True, exist_ok=True)
    with _build_lock(build):
        return cpp_load(
            name=tag,
            sources=[str(s) for s in sources],
            extra_cflags=[*flags, f"-D{SOURCE_HASH_MACRO}={digest}"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )


@contextlib.contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """Hold the build directory ``build`` alone, clearing the lock file a killed build left behind.

    NOTE(stale-baton): torch's ``cpp_extension.load`` guards a build directory with a plain
    ``lock`` file that only the builder removes: a build killed midway (a timeout, the OOM
    killer, Ctrl-C) leaves it, and every later load of that directory waits for it forever,
    on every start of every venv sharing the cache (NOTE(jit-cache)).  Here every builder first
    takes an ``flock`` on ``<build>/sluice.flock``, which the kernel releases when its holder
    dies, so while it is held no live sluice build owns ``lock``: one found then is stale."""
    import fcntl

    with open(build / "sluice.flock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # waits for a live build of this directory, never for a dead one
        try:
            stale = build / "lock"
            if stale.exists():
                log.warning("kernel build %s: removing the lock a killed build left (NOTE(stale-baton))", build.name)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _built_digests(module: str) -> list[str]:
    """The source digest compiled into ``module``'s file (what looks like one: a list, though a
    build holds one), read from its bytes without importing it.

    NOTE(stale-no-import): a stale module must not be imported to ask it: pybind11 keeps the
    types an imported module registered (``QLinearOp``), and the module compiled in its place
    could then not register them again ("generic_type: type ... is already registered")."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"No module named {module!r}")
    return [m.decode() for m in re.findall(SOURCE_HASH_PATTERN, Path(spec.origin).read_bytes())]


def _stale_reason(name: str, module: str) -> str | None:
    """Why the compiled ``module`` must not be used: built from sources other than those installed
    beside it (NOTE(source-hash)); None when it was built from them, or when no sources are there."""
    try:
        want = source_hash(name, csrc_dir())
    except OSError:  # no sources installed beside it: nothing to compare with, nor to compile instead
        return None
    built = _built_digests(module)
    if want in built:
        return None
    return f"{module} is a stale build: compiled from sources {built[0] if built else '(none: older than source hashes)'}, these are {want}"


def load(name: str) -> ModuleType:
    """The extension ``name`` ('attention' | 'quant'), loading or building it once per process."""
    with _REG.lock:
        if name in _REG.modules:
            return _REG.modules[name]
        if name not in EXTENSIONS:
            raise KernelUnavailableError(f"unknown kernel extension {name!r}")
        module, files, flags = EXTENSIONS[name]
        import torch  # noqa: F401 -- the extension links against libtorch

        if os.environ.get("SLUICE_KERNELS_JIT") != "1":  # tests force the JIT path with it
            try:
                stale = _stale_reason(name, module)  # built from other sources: rebuild from these
                if stale:
                    raise ImportError(stale)
                return _install(name, importlib.import_module(module), how="prebuilt")
            except ImportError as e:
                prebuilt_error = str(e)
        else:
            prebuilt_error = "SLUICE_KERNELS_JIT=1"
        sources = [csrc_dir() / f for f in files]
        try:
            mod = _jit(name, sources, flags)
        except Exception as e:  # no compiler, missing headers, ...
            _REG.info[name] = {"how": "unavailable", "error": f"{type(e).__name__}: {e}"}
            raise KernelUnavailableError(
                f"kernel extension {name!r} is not built ({prebuilt_error}) and the JIT build failed: {e}"
            ) from e
        log.info("kernel extension %s: built on first use (not at install time: %s)", name, prebuilt_error)
        return _install(name, mod, how="jit", why=prebuilt_error)


def _install(name: str, mod: ModuleType, **info: str) -> ModuleType:
    """Register a loaded extension (under ``_REG.lock``) with the pool's current setting applied."""
    mod.set_pool_threads(_REG.pool_threads)
    mod.set_pool_active(_REG.pool_active)
    _REG.modules[name] = mod
    _REG.info[name] = {"how": info.pop("how"), "path": getattr(mod, "__file__", None), **info}
    return mod


def set_work_pool(threads: int) -> None:
    """Run every extension's parallel loops on sluice's work pool with ``threads`` threads, the caller
    included, or (0) on torch's OpenMP threads, as at start-up.  NOTE(work-pool) in ``csrc/work_pool.h``:
    a loop waits only for chunks a thread has started, and the pool's workers yield their core first,
    so the engine does not wait for a thread the OS has not run; a worker taken off its core while it
    runs a chunk still holds it (``work_pool_waits``, NOTE(pool-waits))."""
    _set_pool("pool_threads", threads)


def set_work_pool_active(threads: int) -> None:
    """At most ``threads`` of the work pool's threads run a loop (0: all of them); its workers stay.

    NOTE(lane-lend) in ``sluice.server.lanes``: an engine core process takes the cores another
    engine core left idle, and gives them back when that one has work again."""
    _set_pool("pool_active", threads)


def _set_pool(setting: str, threads: int) -> None:
    """Record a pool setting (``pool_threads`` | ``pool_active``) and apply it to every loaded extension."""
    if threads < 0:
        raise ValueError(f"work pool {setting.removeprefix('pool_')} threads must be >= 0, got {threads}")
    with _REG.lock:
        setattr(_REG, setting, threads)
        for mod in _REG.modules.values():
            getattr(mod, f"set_{setting}")(threads)


def work_pool_threads() -> int:
    """The threads set by ``set_work_pool`` (0: the pool is off)."""
    return _REG.pool_threads


class PoolWaits(NamedTuple):
    """The work pool's waits since start (NOTE(pool-waits) in ``csrc/work_pool.h``): how often a loop's calling
    thread, done with its own chunks, waited for chunks other threads held, the seconds it waited, and the
    waits of 0.5 ms or more (a worker the OS took off its core mid-chunk) with their seconds."""

    waits: int = 0
    wait_seconds: float = 0.0
    stalls: int = 0
    stall_seconds: float = 0.0


def work_pool_waits() -> PoolWaits:
    """The pool's waits so far (zeros before an extension is loaded; the extensions share one pool)."""
    with _REG.lock:
        mod = next(iter(_REG.modules.values()), None)
    return PoolWaits(*mod.pool_waits()) if mod is not None else PoolWaits()


def status(*names: str) -> dict[str, dict[str, Any]]:
    """How each extension named (default: all of them) was (or would be) loaded: tries to load them."""
    for name in names or EXTENSIONS:
        with contextlib.suppress(KernelUnavailableError):
            load(name)
    return {k: dict(v) for k, v in _REG.info.items() if not names or k in names}
