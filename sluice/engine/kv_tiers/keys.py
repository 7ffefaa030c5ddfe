"""Keys of KV blocks that mean the same thing in every process: block hashes and fingerprints.

    h0 = H(0^16,   extra, t0..t15)
    h1 = H(h0,     extra, t16..t31)        H = blake2b, 16-byte digest
    ...                                    key of block i on disk: (fingerprint, h_i)

NOTE(stable-hash): the in-memory prefix cache used to key blocks with Python's
``hash((prev_hash, tokens))``.  That is deterministic for ints and tuples of
ints, but the first block's key contains ``None`` and, before Python 3.12,
``hash(None)`` is derived from the object's address: it changes with every
process (measured on 3.11: three runs, three hashes).  A disk tier keyed that
way is never hit after a restart (the 0.03 hit rate SGLang HiCache users
report).  Python's hash is also 64-bit and not collision resistant, and a
collision here serves one prompt another prompt's KV.  blake2b-128 costs about
a microsecond per 16-token block.  The block manager keys its prefix cache with
the same function, so a memory key and a disk key are one value.

``extra`` separates caches that share token ids but not K/V: a LoRA adapter's
prefix blocks are keyed with the adapter's name (empty for the base model).

The fingerprint names everything else that decides a block's bytes: the model
file (content hash), compute dtype, weight quantization, KV dtype, block size,
shapes and payload layout.  A file from another model or dtype carries another
fingerprint and is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

__all__ = ["HASH_BYTES", "hash_block_tokens", "prefix_block_hashes", "kv_fingerprint", "hash_to_bytes", "hash_from_bytes"]

HASH_BYTES = 16
_ZERO = bytes(HASH_BYTES)


def hash_to_bytes(h: int) -> bytes:
    return h.to_bytes(HASH_BYTES, "little")


def hash_from_bytes(b: bytes) -> int:
    return int.from_bytes(b, "little")


def hash_block_tokens(prev: int | None, tokens: Sequence[int], extra: bytes = b"") -> int:
    """Chained key of one full block: its tokens, the previous block's key, and ``extra``."""
    h = hashlib.blake2b(_ZERO if prev is None else hash_to_bytes(prev), digest_size=HASH_BYTES)
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], num_blocks: int, block_size: int = 16, extra: bytes = b"") -> list[int]:
    """Keys of the first ``num_blocks`` full blocks of a token sequence."""
    out: list[int] = []
    prev: int | None = None
    for i in range(num_blocks):
        prev = hash_block_tokens(prev, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(prev)
    return out


def kv_fingerprint(**fields: Any) -> bytes:
    """16-byte digest of what makes a block's bytes mean something (model, dtypes, layout).

    Callers pass named fields, e.g. ``model='sha256:ab12..', dtype='float32',
    kv_dtype='fp8', block_size=16, num_layers=30, num_kv_heads=3, head_dim=64,
    layout='kvscale-row-v1'``; order does not matter, every value does.
    """
    doc = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(doc.encode(), digest_size=HASH_BYTES, person=b"sluice-kv-fp").digest()
