"""The converted-weights cache's size bound: the least recently used entries go first.

    mark_used(root)             # a load read this entry
    bound_cache(keep=root)      # after a write: remove entries until under the bound

NOTE(model-cache-bound): every model file (and every version of a HF folder: its
digest includes the weight files' sizes and mtimes) gets an entry
``<cache>/models-v3/<digest>/``, and nothing else ever removes one, so the cache
only grew (a test suite that writes fresh random models left ~1 GB a run).
After each write the entries are summed, and the least recently used are removed
until the total is under ``SLUICE_MODEL_CACHE_MAX_GB`` GiB (default 20; 0 turns
the bound off).  A load that hits an entry marks it used (its directory's mtime).
Never removed: the entry just written, and entries used in the last
``MIN_AGE_S`` (another process may be reading one).  An entry is renamed away
before it is deleted, so a reader sees all of it or none; a write's temp dir or
an interrupted removal older than an hour is swept with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from sluice.errors import ModelLoadError

__all__ = ["CacheEntry", "DEFAULT_MAX_GB", "bound_cache", "cache_entries", "mark_used", "max_cache_bytes"]

log = logging.getLogger("sluice.models")

DEFAULT_MAX_GB = 20.0
MIN_AGE_S = 60.0  # an entry used this recently stays, whatever the bound
STALE_S = 3600.0  # a temp dir or removal left this long ago is a crash's leftover
_EVICTING = ".evict-"


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    size: int  # bytes
    last_used: float  # epoch seconds


def max_cache_bytes() -> int | None:
    """The bound from ``SLUICE_MODEL_CACHE_MAX_GB`` (GiB); None when it is 0 (no bound)."""
    raw = os.environ.get("SLUICE_MODEL_CACHE_MAX_GB", "").strip()
    if not raw:
        return int(DEFAULT_MAX_GB * 2**30)
    try:
        gb = float(raw)
    except ValueError:
        gb = -1.0
    if not gb >= 0:  # also NaN
        raise ModelLoadError(f"SLUICE_MODEL_CACHE_MAX_GB must be a number of GiB >= 0 (0: no bound), got {raw!r}")
    return None if gb == 0 else int(gb * 2**30)


def mark_used(entry: Path) -> None:
    with contextlib.suppress(OSError):  # a read-only cache only loses its order
        os.utime(entry)


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def cache_entries(root: Path) -> list[CacheEntry]:
    """The entries under ``root`` (``.../models-v3``), least recently used first."""
    out = []
    with contextlib.suppress(OSError):
        for p in root.iterdir():
            if p.name.startswith(".") or not p.is_dir():
                continue
            with contextlib.suppress(OSError):
                out.append(CacheEntry(p, _size(p), p.stat().st_mtime))
    return sorted(out, key=lambda e: e.last_used)


def _remove(path: Path) -> None:
    """Rename away, then delete: a reader finds the whole entry or none of it."""
    gone = path.with_name(f"{_EVICTING}{path.name}-{os.getpid()}")
    try:
        os.replace(path, gone)
    except OSError:
        return  # another process removed it first
    shutil.rmtree(gone, ignore_errors=True)


def _sweep(root: Path, now: float) -> None:
    """Remove a crash's leftovers: removals and write temp dirs older than STALE_S."""
    with contextlib.suppress(OSError):
        for p in root.iterdir():
            stale = [p] if p.name.startswith(_EVICTING) else []
            if p.is_dir() and not p.name.startswith("."):
                with contextlib.suppress(OSError):
                    stale = [t for t in p.iterdir() if t.name.startswith(".tmp-")]
            for t in stale:
                with contextlib.suppress(OSError):
                    if now - t.stat().st_mtime > STALE_S:
                        shutil.rmtree(t, ignore_errors=True)


def bound_cache(root: Path, keep: Path | None = None, max_bytes: int | None = None, now: float | None = None) -> list[Path]:
    """Remove least recently used entries of ``root`` until it holds at most ``max_bytes``.

    ``max_bytes`` defaults to ``max_cache_bytes()``.  Returns the removed entries.
    """
    now = time.time() if now is None else now
    limit = max_cache_bytes() if max_bytes is None else max_bytes
    _sweep(root, now)
    if limit is None:
        return []
    entries = cache_entries(root)
    total = sum(e.size for e in entries)
    removed: list[Path] = []
    for e in entries:
        if total <= limit:
            break
        if (keep is not None and e.path == keep) or now - e.last_used < MIN_AGE_S:
            continue
        _remove(e.path)
        total -= e.size
        removed.append(e.path)
    if removed:
        log.info("model cache: removed %d least recently used entries (bound %.1f GiB)", len(removed), limit / 2**30)
    return removed
