"""KV tiers below the in-memory cache: disk (survives restarts) and host memory.

    memory (KV cache blocks)  --store-->  tier (disk files | host buffers)
             ^                                   |
             +---- load(hashes, sink) ----------+   per-request handle, async

- ``keys``: the chained block hash (blake2b, stable across processes) and the
  model/dtype/layout fingerprint.
- ``base``: the ``KVTier`` interface, ``LoadHandle``, ``TierStats``, the
  round-robin load threads and the background writer.
- ``fileformat``: the checksummed group file and the atomic file operations.
- ``disk``: ``DiskKVTier``.  ``host``: ``HostKVTier``.

See docs/kv_cache.md for the user-facing side.
"""

from sluice.engine.kv_tiers.base import BlockSink, KVTier, LoadHandle, TierError, TierStats
from sluice.engine.kv_tiers.disk import DiskKVTier
from sluice.engine.kv_tiers.host import HostKVTier
from sluice.engine.kv_tiers.keys import hash_block_tokens, kv_fingerprint, prefix_block_hashes

__all__ = [
    "BlockSink",
    "KVTier",
    "LoadHandle",
    "TierError",
    "TierStats",
    "DiskKVTier",
    "HostKVTier",
    "hash_block_tokens",
    "kv_fingerprint",
    "prefix_block_hashes",
]
