"""The host-memory tier: blocks below a GPU KV cache, kept in CPU memory, LRU by block.

Same interface and threads as the disk tier (``base.KVTier``): a GPU server
stores evicted or newly full blocks here and loads them back per request
without blocking the step.  On a CUDA machine the buffers would be pinned
so the sink's host-to-device copy is asynchronous; on the CPU (tests, and a
CPU server that wants a second, cheaper pool) they are ordinary bytearrays.
Nothing here survives a restart: that is the disk tier's job.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from sluice.engine.kv_tiers.base import KVTier, TierError, payload_view

__all__ = ["HostKVTier"]


class HostKVTier(KVTier):
    name = "host"

    def __init__(self, block_bytes: int, capacity_bytes: int, *, num_load_threads: int = 2, max_pending_bytes: int = 256 << 20):
        super().__init__(block_bytes, num_load_threads=num_load_threads, max_pending_bytes=max_pending_bytes)
        self.capacity_bytes = capacity_bytes
        self.stats.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[int, bytearray] = OrderedDict()  # LRU: front = evicted first
        self._start()

    def _has(self, h: int) -> bool:
        return h in self._blocks

    def _snapshot(self) -> tuple[int, int]:
        with self._lock:
            return len(self._blocks), len(self._blocks) * self.block_bytes

    def _read_block(self, h: int) -> memoryview:
        with self._lock:
            buf = self._blocks.get(h)
            if buf is None:
                raise TierError("evicted from host memory")
            self._blocks.move_to_end(h)
        return memoryview(buf)  # a stored buffer is never mutated (a re-store replaces it)

    def _write_blocks(self, hashes: list[int], payloads: list[torch.Tensor]) -> None:
        max_blocks = self.capacity_bytes // self.block_bytes
        for h, p in zip(hashes, payloads):
            with self._lock:
                if h in self._blocks or max_blocks == 0:
                    self.stats.num_dropped_blocks += 1
                    continue
            buf = bytearray(payload_view(p))  # the copy happens outside the lock
            with self._lock:
                while len(self._blocks) >= max_blocks:
                    self._blocks.popitem(last=False)
                    self.stats.num_evicted_blocks += 1
                self._blocks[h] = buf
                self.stats.num_stored_blocks += 1
                self.stats.store_bytes += self.block_bytes
