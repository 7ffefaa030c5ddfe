"""The engine's side of a KV tier: write-through stores, per-request loads, checkpoint.

    admission (scheduler)      memory hits | tier hits -> start_load | recompute
                                              blocks reserved, keys registered,
                                              the request waits in `loading`
    I/O threads                tier.load -> sink: KVCache.import_block(block, payload)
    next schedule()            poll(): finished loads release their blocks (failed
                               blocks lose their keys); load_state(req) -> READY
                               (run it) or FAILED (requeue it, tier off for it)
    after each step (core)     blocks that became full -> store_new: exported and
                               queued for the tier's writer

NOTE(write-through): a block is stored when it becomes full, not when it is
evicted.  The export is a memcpy on the engine thread (about 0.1 ms per
SmolLM2 fp32 block, none of it I/O); the file is written by the tier's
thread.  Eviction then costs nothing, and a kill -9 loses only what the writer
had not finished: the same prompts hit after a restart.  A store the writer is
too far behind to take is dropped (counted), never waited for.

NOTE(shared-loads): a block being loaded is registered under its key at once,
so a second request with the same prefix takes it as a memory hit and waits for
the same load (read once, held once).  Each request checks its own loads when
they finish: it depends on the first m blocks of a load and is valid iff that
load delivered at least m; otherwise it is requeued and recomputes (after the
tier removed what failed), never reads a half-loaded block.  The load holds a
reference on its blocks until it finishes, so an aborted request never frees a
block an I/O thread is still writing.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluice.engine.kv_tiers.base import KVTier, LoadHandle
from sluice.engine.protocol import KVTierStats

if TYPE_CHECKING:
    from sluice.engine.block_manager import BlockManager
    from sluice.engine.kv_quant import KVCache
    from sluice.engine.request import Request

__all__ = ["KVTierConnector", "LoadState", "ConnectorStats"]

log = logging.getLogger("sluice.engine.kv_tiers")

STORE_BATCH = 64  # blocks exported per tier.store() call during a checkpoint


class LoadState(enum.Enum):
    WAITING = "waiting"  # a load it depends on is still running
    READY = "ready"  # every block it took from the tier arrived
    FAILED = "failed"  # a block it needs did not arrive: requeue and recompute


@dataclass(eq=False)
class _Load:
    handle: LoadHandle
    block_ids: list[int]  # reserved blocks, in the handle's hash order
    num_tokens: int


@dataclass
class ConnectorStats:
    hit_blocks: int = 0  # blocks taken from the tier at admission
    hit_tokens: int = 0
    num_requests_loaded: int = 0  # admissions that waited for a load
    num_load_failures: int = 0  # requests requeued because a block they needed failed
    num_store_requests: int = 0  # blocks offered to the tier (already held ones are not offered)
    load_latency_sum: float = 0.0  # seconds, admission -> all of a request's blocks arrived
    num_load_latencies: int = 0
    recent_load_latencies: list[float] = field(default_factory=list)  # since the last make_stats()


class KVTierConnector:
    def __init__(self, tier: KVTier, kv_cache: KVCache, block_manager: BlockManager):
        self.tier, self.kv, self.bm = tier, kv_cache, block_manager
        self.block_size = block_manager.block_size
        self.stats = ConnectorStats()
        self._loads: list[_Load] = []  # in flight or finished but not yet polled
        self._load_of_block: dict[int, _Load] = {}  # reserved block -> its load
        self._waits: dict[str, tuple[float, set[_Load]]] = {}  # request id -> (admitted at, loads it needs)
        self._skip_tier: set[str] = set()  # requests whose tier load failed once: recompute

    # ------------------------------------------------------------ admission

    def lookup(self, req: Request, num_memory_blocks: int) -> list[int]:
        """Keys of the blocks after the memory hits that the tier holds (a leading run)."""
        if req.request_id in self._skip_tier or not self.tier.is_enabled or not self.bm.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size  # NOTE(prefix-last-token) in block_manager
        if max_blocks <= num_memory_blocks:
            return []
        hashes = self.bm.prefix_hashes(req, max_blocks)[num_memory_blocks:]
        return hashes[: self.tier.count_prefix(hashes)]

    def start_load(self, req: Request, num_memory_blocks: int, hashes: Sequence[int]) -> bool:
        """After ``allocate``: load ``hashes`` into the blocks after the memory hits.

        Returns True when the request must wait (its own load, or memory hits
        that another request's load is still filling).
        """
        memory = req.block_ids[:num_memory_blocks]
        deps = {self._load_of_block[b] for b in memory if b in self._load_of_block}
        if hashes:
            block_ids = req.block_ids[num_memory_blocks : num_memory_blocks + len(hashes)]
            self.bm.hold_for_load(req, block_ids, hashes)
            kv = self.kv

            def sink(i: int, payload: memoryview) -> None:  # on an I/O thread
                kv.import_block(block_ids[i], payload)

            load = _Load(self.tier.load(hashes, sink), list(block_ids), len(hashes) * self.block_size)
            self._loads.append(load)
            for b in block_ids:
                self._load_of_block[b] = load
            deps.add(load)
            self.stats.hit_blocks += len(hashes)
            self.stats.hit_tokens += len(hashes) * self.block_size
        if not deps:
            return False
        self._waits[req.request_id] = (time.monotonic(), deps)
        self.stats.num_requests_loaded += 1
        return True

    # ------------------------------------------------------------ completion (engine thread)

    def poll(self) -> None:
        """Release the blocks of finished loads; failed blocks lose their keys."""
        for load in [ld for ld in self._loads if ld.handle.done()]:
            self._loads.remove(load)
            for b in load.block_ids:
                del self._load_of_block[b]
            self.bm.release_load(load.block_ids, load.handle.num_loaded)

    def load_state(self, req: Request) -> LoadState:
        entry = self._waits.get(req.request_id)
        if entry is None:
            return LoadState.READY
        admitted, deps = entry
        if any(ld in self._loads for ld in deps):  # not yet polled: still running, or finished this step
            return LoadState.WAITING
        del self._waits[req.request_id]
        held = set(req.block_ids)
        for ld in deps:
            needed = sum(1 for b in ld.block_ids if b in held)
            if ld.handle.num_loaded < needed:
                self._skip_tier.add(req.request_id)
                self.stats.num_load_failures += 1
                log.warning("KV %s tier: %d of %d blocks of request %s did not load; recomputing",
                            self.tier.name, needed - ld.handle.num_loaded, needed, req.request_id)
                return LoadState.FAILED
        latency = time.monotonic() - admitted
        self.stats.load_latency_sum += latency
        self.stats.num_load_latencies += 1
        self.stats.recent_load_latencies.append(latency)
        return LoadState.READY

    def make_stats(self) -> KVTierStats:
        """Tier I/O counters plus this engine's hits and waits; drains the recent waits."""
        t, c = self.tier.make_stats(), self.stats
        recent, c.recent_load_latencies = c.recent_load_latencies, []
        return KVTierStats(
            name=t.name, is_enabled=t.is_enabled, is_writable=t.is_writable, num_blocks=t.num_blocks,
            num_bytes=t.num_bytes, capacity_bytes=t.capacity_bytes, hit_blocks=c.hit_blocks, hit_tokens=c.hit_tokens,
            num_request_loads=c.num_load_latencies, load_seconds=c.load_latency_sum, recent_load_seconds=recent,
            num_load_failures=c.num_load_failures, num_loaded_blocks=t.num_loaded_blocks,
            num_block_reads=t.num_block_reads, load_bytes=t.load_bytes, num_stored_blocks=t.num_stored_blocks,
            store_bytes=t.store_bytes, store_seconds=t.store_seconds, num_dropped_blocks=t.num_dropped_blocks,
            num_evicted_blocks=t.num_evicted_blocks, num_corrupt=t.num_corrupt,
        )

    def has_loads(self) -> bool:
        return bool(self._loads)

    def wait_any(self, timeout: float) -> None:
        """Block up to ``timeout`` s for some load to finish (an engine with nothing else to run)."""
        deadline = time.monotonic() + timeout
        for ld in list(self._loads):
            left = deadline - time.monotonic()
            if left <= 0 or ld.handle.wait(left):
                return

    def forget(self, req: Request) -> None:
        """The request finished (or was aborted): drop its per-request state."""
        self._waits.pop(req.request_id, None)
        self._skip_tier.discard(req.request_id)

    # ------------------------------------------------------------ stores

    def store_new(self, pairs: Sequence[tuple[int, int]]) -> int:
        """Offer newly full blocks ((key, block id) pairs) to the tier; returns how many were queued."""
        if not pairs or not self.tier.is_writable:  # off or full: not even the memcpy
            return 0
        todo = [(h, b) for h, b in pairs if self.tier.count_prefix([h]) == 0]
        if not todo:
            return 0
        self.stats.num_store_requests += len(todo)
        payloads = self.kv.export_blocks([b for _, b in todo])
        return len(todo) if self.tier.store([h for h, _ in todo], payloads) else 0

    def checkpoint(self, timeout: float = 300.0) -> dict[str, float | int | bool]:
        """Write every cached block the tier lacks now, and wait until it is on disk."""
        t0 = time.monotonic()
        pairs = [(h, b) for h, b in self.bm.cached_blocks() if b not in self._load_of_block]
        todo = [(h, b) for h, b in pairs if self.tier.count_prefix([h]) == 0]
        queued = 0
        for i in range(0, len(todo), STORE_BATCH):
            if not self.tier.is_writable:
                break
            batch = todo[i : i + STORE_BATCH]
            payloads = self.kv.export_blocks([b for _, b in batch])
            hashes = [h for h, _ in batch]
            if not self.tier.store(hashes, payloads):  # writer behind: let it catch up once
                self.tier.flush(timeout)
                if not self.tier.store(hashes, payloads):
                    continue
            queued += len(batch)
        done = self.tier.flush(max(0.0, timeout - (time.monotonic() - t0)))
        return {
            "num_cached_blocks": len(pairs),
            "num_written_blocks": queued,
            "num_already_stored_blocks": len(pairs) - len(todo),
            "complete": done and self.tier.is_enabled,
            "seconds": time.monotonic() - t0,
        }

    def close(self, checkpoint: bool = True, timeout: float = 30.0) -> None:
        """Shut the tier down; with ``checkpoint``, write what it lacks first (graceful stop)."""
        if checkpoint and self.tier.is_enabled:
            self.checkpoint(timeout)
        for ld in list(self._loads):
            ld.handle.cancel()
        self.tier.close(flush=True, timeout=timeout)
