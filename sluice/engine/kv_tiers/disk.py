"""The disk (SSD) tier: group files under one directory per fingerprint, an LRU size cap.

    --kv-disk-dir DIR
      DIR/kv-<fingerprint hex>/            one directory per model/dtype/layout
          3fa9...e1.kvg                    a group of blocks (fileformat.py)
          .3fa9...e1.kvg.4242.tmp          a write in progress (or a crashed one)

Start-up rebuilds the index from the directory: every ``*.kvg`` header is read
and checked (magic, checksum, fingerprint, exact size); a file that fails is
removed, never indexed.  Temporary files of dead writers are removed.  The
LRU order after a restart comes from file mtimes (a load touches its file).

Failures never stop serving: a directory that cannot be written at start-up
(read-only, missing permissions) turns the tier off; a full device (ENOSPC,
EDQUOT) stops writes but keeps serving what is there; any other I/O error on
a write turns the tier off.  Each case logs one warning.  A block that is
missing or fails its checksum on load fails only that load (the request
recomputes from there) and its file is removed.

NOTE(shared-dir): two servers may share a directory (same fingerprint): writes
are atomic renames, so each sees whole files; one may evict a file the other
indexed, which the other sees as a miss on load.  Directories of other
fingerprints are never read or removed: ``--kv-disk-size`` caps this
fingerprint's directory only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import psutil
import torch

from sluice.engine.kv_tiers.base import KVTier, TierError, payload_view
from sluice.engine.kv_tiers.fileformat import (
    HEADER_PEEK,
    SUFFIX,
    CorruptFileError,
    GroupHeader,
    LocalFiles,
    decode_header,
    encode_header,
    header_bytes_needed,
    is_full_error,
)
from sluice.engine.kv_tiers.keys import hash_to_bytes

__all__ = ["DiskKVTier"]

log = logging.getLogger("sluice.engine.kv_tiers")


@dataclass
class _Group:
    name: str
    header: GroupHeader
    size: int  # bytes on disk


class DiskKVTier(KVTier):
    name = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: bytes,
        block_bytes: int,
        capacity_bytes: int,
        *,
        files: LocalFiles | None = None,
        num_load_threads: int = 4,
        group_blocks: int = 32,
        max_pending_bytes: int = 256 << 20,
    ):
        super().__init__(block_bytes, num_load_threads=num_load_threads, max_pending_bytes=max_pending_bytes)
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.group_blocks = group_blocks
        self.files = files or LocalFiles()
        self.root = os.fspath(root)
        self.directory = os.path.join(self.root, f"kv-{fingerprint.hex()}")
        self.stats.capacity_bytes = capacity_bytes
        self._groups: OrderedDict[str, _Group] = OrderedDict()  # LRU order: front = evicted first
        self._where: dict[int, tuple[_Group, int]] = {}  # block hash -> (group, index in group)
        self._num_bytes = 0
        try:
            self.files.makedirs(self.directory)
            self.files.probe_writable(self.directory)
        except OSError as e:
            if is_full_error(e):  # full: what is there is still worth reading
                self._disable(f"{self.directory} is full ({e})", reads_too=False)
            else:
                self._disable(f"{self.directory} is not writable ({e})", reads_too=True)
        if self.stats.is_enabled:
            self._rebuild_index()
        self._start()

    # ------------------------------------------------------------ index

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _rebuild_index(self) -> None:
        found: list[tuple[float, _Group]] = []
        for name in self.files.listdir(self.directory):
            path = self._path(name)
            if name.endswith(".tmp"):
                if not _writer_alive(name):
                    self.files.remove(path)  # a write that never finished
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                st = self.files.stat(path)
                head = bytes(self.files.read_at(path, 0, HEADER_PEEK))
                need = header_bytes_needed(head)
                if need > len(head):
                    head = bytes(self.files.read_at(path, 0, need))
                header = decode_header(head, self.fingerprint, self.block_bytes)
                if st.st_size != header.file_size:
                    raise CorruptFileError(f"{st.st_size} bytes, expected {header.file_size} (truncated)")
            except (CorruptFileError, OSError) as e:
                log.warning("KV disk tier: removing %s: %s", path, e)
                self.stats.num_corrupt += 1
                self.files.remove(path)
                continue
            found.append((st.st_mtime, _Group(name, header, st.st_size)))
        for _, g in sorted(found, key=lambda x: x[0]):
            self._add_group(g)
        self._evict_to(self.capacity_bytes)
        log.info("KV disk tier: %d blocks in %d files (%.1f MiB) in %s",
                 len(self._where), len(self._groups), self._num_bytes / 2**20, self.directory)

    def _add_group(self, g: _Group) -> None:  # under self._lock (or before the threads start)
        self._groups[g.name] = g
        self._num_bytes += g.size
        for i, h in enumerate(g.header.hashes):
            self._where.setdefault(h, (g, i))

    def _drop_group(self, g: _Group, *, remove_file: bool) -> None:  # under self._lock
        if self._groups.pop(g.name, None) is None:
            return
        self._num_bytes -= g.size
        for h in g.header.hashes:
            if self._where.get(h, (None, 0))[0] is g:
                del self._where[h]
        if remove_file:
            self.files.remove(self._path(g.name))

    def _evict_to(self, limit: int) -> None:  # under self._lock
        while self._groups and self._num_bytes > limit:
            g = next(iter(self._groups.values()))
            self.stats.num_evicted_blocks += len(g.header.hashes)
            self._drop_group(g, remove_file=True)

    def _has(self, h: int) -> bool:
        return h in self._where

    def _snapshot(self) -> tuple[int, int]:
        with self._lock:
            return len(self._where), self._num_bytes

    # ------------------------------------------------------------ reads (load threads)

    def _read_block(self, h: int) -> memoryview:
        with self._lock:
            where = self._where.get(h)
            if where is None:
                raise TierError("not on disk (evicted)")
            g, i = where
            self._groups.move_to_end(g.name)
        path = self._path(g.name)
        try:
            buf = self.files.read_at(path, g.header.block_offset(i), self.block_bytes)
        except FileNotFoundError:
            with self._lock:  # evicted by another server sharing the directory
                self._drop_group(g, remove_file=False)
            raise TierError("file gone") from None
        except OSError as e:
            self._disable(f"read error on {path}: {e}", reads_too=True)
            raise TierError(str(e)) from e
        if len(buf) != self.block_bytes or zlib.crc32(buf) != g.header.crcs[i]:
            log.warning("KV disk tier: block %d of %s fails its checksum; removing the file", i, path)
            with self._lock:
                self.stats.num_corrupt += 1
                self._drop_group(g, remove_file=True)
            raise TierError("checksum mismatch")
        self.files.touch(path)
        return memoryview(buf)

    # ------------------------------------------------------------ writes (writer thread)

    def _write_blocks(self, hashes: list[int], payloads: list[torch.Tensor]) -> None:
        with self._lock:
            seen: set[int] = set()
            todo = []
            for h, p in zip(hashes, payloads):
                if h not in self._where and h not in seen:
                    seen.add(h)
                    todo.append((h, p))
            self.stats.num_dropped_blocks += len(hashes) - len(todo)  # already on disk
        for start in range(0, len(todo), self.group_blocks):
            if not self.stats.is_writable:
                with self._lock:
                    self.stats.num_dropped_blocks += len(todo) - start
                return
            self._write_group(todo[start : start + self.group_blocks])

    def _write_group(self, items: list[tuple[int, torch.Tensor]]) -> None:
        hs = [h for h, _ in items]
        views = [payload_view(p) for _, p in items]
        crcs = [zlib.crc32(v) for v in views]
        header = encode_header(self.fingerprint, self.block_bytes, hs, crcs)
        size = len(header) + len(items) * self.block_bytes
        if size > self.capacity_bytes:
            with self._lock:
                self.stats.num_dropped_blocks += len(items)
            return
        name = hashlib.blake2b(b"".join(hash_to_bytes(h) for h in hs), digest_size=16).hexdigest() + SUFFIX
        with self._lock:
            self._evict_to(self.capacity_bytes - size)  # make room first: the cap holds at all times
        try:
            self.files.write_atomic(self.directory, name, [header, *views])
        except OSError as e:
            with self._lock:
                self.stats.num_dropped_blocks += len(items)
            if is_full_error(e):
                self._disable(f"{self.directory} is full ({e})", reads_too=False)
            else:
                self._disable(f"write error in {self.directory}: {e}", reads_too=True)
            return
        g = _Group(name, decode_header(header, self.fingerprint, self.block_bytes), size)
        with self._lock:
            old = self._groups.get(name)
            if old is not None:
                self._drop_group(old, remove_file=False)  # same blocks rewritten: one entry
            self._add_group(g)
            self.stats.num_stored_blocks += len(items)
            self.stats.store_bytes += size


def _writer_alive(tmp_name: str) -> bool:
    """A ``.<name>.<pid>.tmp`` file belongs to a live process (maybe another server)."""
    try:
        pid = int(tmp_name.rsplit(".", 2)[-2])
    except (ValueError, IndexError):
        return False
    if pid == os.getpid():
        return False  # ours, from before a crash of a process that had our pid: stale
    return psutil.pid_exists(pid)  # another user's process (EPERM) runs too
