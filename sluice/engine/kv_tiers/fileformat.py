"""The disk tier's group file, and the file operations behind a swappable transport.

One file holds a group of blocks (up to ``group_blocks``, written together):

    offset 0     header (little endian)
                   magic        8s   b"SLKVGRP1"
                   version      u32  1
                   header_bytes u32  bytes up to and including header_crc
                   fingerprint  16s  model / dtype / layout digest (keys.kv_fingerprint)
                   num_blocks   u32
                   reserved     u32  0
                   block_bytes  u64  payload bytes per block
                   entries      num_blocks x (hash 16s, crc32 u32, reserved u32)
                   header_crc   u32  crc32 of everything above
                 zero padding to a multiple of 4096
    payload_off  block 0 payload | block 1 payload | ...   (block_bytes each)
    file size == payload_off + num_blocks * block_bytes, exactly

A file is valid only if the magic, version, header crc, fingerprint and size
all match; each block's crc32 is checked again when it is read, so a bit flip
in a payload is caught at load time and the file removed, never delivered.

Files are written atomically (``LocalFiles.write_atomic``): a temporary name
in the same directory, fsync, rename, fsync of the directory.  A crash leaves
either the whole file under its final name or a ``*.tmp`` that no reader
looks at and the next start-up deletes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.engine.kv_tiers.keys import HASH_BYTES, hash_from_bytes, hash_to_bytes

__all__ = ["GroupHeader", "CorruptFileError", "encode_header", "decode_header", "LocalFiles", "HEADER_PEEK", "SUFFIX"]

MAGIC = b"SLKVGRP1"
VERSION = 1
ALIGN = 4096
HEADER_PEEK = 4096  # first read at start-up; enough for ~165 blocks of entries
SUFFIX = ".kvg"
_HEAD = struct.Struct("<8sII16sIIQ")
_ENTRY = struct.Struct(f"<{HASH_BYTES}sII")
_CRC = struct.Struct("<I")
MAX_BLOCKS = 1 << 16


class CorruptFileError(Exception):
    """Not a valid group file for this fingerprint (truncated, corrupt or foreign)."""


@dataclass(frozen=True)
class GroupHeader:
    fingerprint: bytes
    block_bytes: int
    hashes: tuple[int, ...]
    crcs: tuple[int, ...]
    payload_offset: int

    @property
    def file_size(self) -> int:
        return self.payload_offset + len(self.hashes) * self.block_bytes

    def block_offset(self, i: int) -> int:
        return self.payload_offset + i * self.block_bytes


def _header_bytes(n: int) -> int:
    return _HEAD.size + n * _ENTRY.size + _CRC.size


def encode_header(fingerprint: bytes, block_bytes: int, hashes: Sequence[int], crcs: Sequence[int]) -> bytes:
    """The header, padded to the payload offset."""
    n = len(hashes)
    hb = _header_bytes(n)
    parts = [_HEAD.pack(MAGIC, VERSION, hb, fingerprint, n, 0, block_bytes)]
    parts += [_ENTRY.pack(hash_to_bytes(h), c, 0) for h, c in zip(hashes, crcs)]
    body = b"".join(parts)
    body += _CRC.pack(zlib.crc32(body))
    return body + bytes(-len(body) % ALIGN)


def header_bytes_needed(buf: bytes) -> int:
    """From the first bytes of a file: how many bytes the header takes (0: not a group file)."""
    if len(buf) < _HEAD.size or buf[:8] != MAGIC:
        return 0
    hb = _HEAD.unpack_from(buf)[2]
    return hb if _HEAD.size < hb <= _header_bytes(MAX_BLOCKS) else 0


def decode_header(buf: bytes, fingerprint: bytes, block_bytes: int) -> GroupHeader:
    """Parse and check a header; raise ``CorruptFileError`` for anything but a valid file of ours."""
    hb = header_bytes_needed(buf)
    if hb == 0 or len(buf) < hb:
        raise CorruptFileError("no group-file header (bad magic or truncated)")
    magic, version, _, fp, n, _, bb = _HEAD.unpack_from(buf)
    if version != VERSION:
        raise CorruptFileError(f"group-file version {version}, expected {VERSION}")
    if hb != _header_bytes(n):
        raise CorruptFileError("header length does not match its block count")
    (crc,) = _CRC.unpack_from(buf, hb - _CRC.size)
    if zlib.crc32(buf[: hb - _CRC.size]) != crc:
        raise CorruptFileError("header checksum mismatch")
    if fp != fingerprint:
        raise CorruptFileError("written for another model, KV dtype or layout (fingerprint differs)")
    if bb != block_bytes:
        raise CorruptFileError(f"block size {bb} bytes, expected {block_bytes}")
    hashes, crcs = [], []
    for i in range(n):
        h, c, _ = _ENTRY.unpack_from(buf, _HEAD.size + i * _ENTRY.size)
        hashes.append(hash_from_bytes(h))
        crcs.append(c)
    return GroupHeader(fp, bb, tuple(hashes), tuple(crcs), hb + (-hb % ALIGN))


class LocalFiles:
    """File operations of the disk tier.  Tests subclass it to inject latency and faults."""

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def stat(self, path: str) -> os.stat_result:
        return os.stat(path)

    def read_at(self, path: str, offset: int, size: int) -> bytearray:
        """Exactly ``size`` bytes at ``offset`` (fewer only at end of file)."""
        buf = bytearray(size)
        fd = os.open(path, os.O_RDONLY)
        try:
            view, got = memoryview(buf), 0
            while got < size:
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    break
                got += n
        finally:
            os.close(fd)
        return buf if got == size else buf[:got]

    def write_atomic(self, directory: str, name: str, chunks: Sequence[bytes | memoryview]) -> int:
        """Write ``chunks`` as ``directory/name`` atomically; return the bytes written."""
        tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        total = 0
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                    total += n
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self.remove(tmp)
            raise
        os.close(fd)
        try:
            os.rename(tmp, os.path.join(directory, name))
        except BaseException:
            self.remove(tmp)
            raise
        self.fsync_dir(directory)
        return total

    def fsync_dir(self, directory: str) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def touch(self, path: str) -> None:
        """Mark recent use (mtime orders the LRU after a restart)."""
        with contextlib.suppress(OSError):  # a read-only mount: recency is then kept in memory only
            os.utime(path)

    def probe_writable(self, directory: str) -> None:
        """Raise OSError unless a file can be created, synced and removed in ``directory``."""
        self.write_atomic(directory, ".probe", [b"sluice"])
        self.remove(os.path.join(directory, ".probe"))


def is_full_error(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)
