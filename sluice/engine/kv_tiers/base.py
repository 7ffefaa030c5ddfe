"""The KV tier interface, per-request load handles, and the shared I/O threads.

A tier holds full KV blocks by key (``keys.hash_block_tokens``) below the
in-memory cache: ``DiskKVTier`` (files, survives restarts) and
``HostKVTier`` (host memory below a GPU cache).  Both have the same
synchronous, non-blocking surface:

    count_prefix(hashes)          -> how many leading blocks the tier holds
    load(hashes, sink)            -> LoadHandle; sink(i, payload) is called on an
                                     I/O thread for each block, into memory the
                                     caller reserved for this request only
    store(hashes, payloads)       -> queued for the background writer (or dropped
                                     when it is behind); never blocks the caller
    flush(), make_stats(), close()

Loads run on a small pool of threads that serves the active loads round-robin,
one block per turn:

    active loads  A: a0 a1 a2 a3 ... a127      B: b0 b1
    worker turns  a0 b0 a1 b1 a2 a3 ...        (B is done after 2 turns each, not 130)

NOTE(no-convoy): a request waits for its own blocks only.  A FIFO pool would
queue a two-block load behind another request's hundred-block load (the
convoy vLLM's offloading connector users measured as 12x TTFT); round-robin
makes a load's latency proportional to its own size times the number of loads
sharing the disk.  A block that an earlier, unfinished load is already reading
(or has queued) is not read again: ``load`` registers the new handle as a
waiter on that read (``_Inflight``), which holds no thread, so 32 requests on
one on-disk prefix read it once.

NOTE(per-request-state): everything about one lookup lives in its handle (which
blocks, which arrived, the first failure); the tier keeps no "last lookup"
state that a concurrent request could overwrite (LMCache's shared lookup state
made hits measure like misses under concurrent writes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

__all__ = ["KVTier", "LoadHandle", "TierStats", "BlockSink", "TierError"]

log = logging.getLogger("sluice.engine.kv_tiers")

# sink(index in the handle's hashes, payload): copy the payload into the block
# reserved for it.  Called on an I/O thread; the payload is read-only and shared.
BlockSink = Callable[[int, memoryview], None]


def payload_view(row: torch.Tensor) -> memoryview:
    """A contiguous CPU uint8 tensor as a buffer, without a copy."""
    return memoryview(row.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers


class TierError(Exception):
    """A block could not be read (missing, corrupt); the caller recomputes it."""


@dataclass
class TierStats:
    """Cumulative counters of one tier (the engine's stats carry one per tier)."""

    name: str = ""  # 'disk' | 'host'
    is_enabled: bool = True  # False: disabled (failing device); nothing is read or written
    is_writable: bool = True  # False: full device; still read, no longer written
    num_blocks: int = 0  # blocks held now
    num_bytes: int = 0  # bytes held now (files incl. headers for disk)
    capacity_bytes: int = 0
    num_loads: int = 0  # load handles finished
    num_loaded_blocks: int = 0  # blocks delivered to sinks
    num_failed_blocks: int = 0  # blocks that could not be delivered (missing, corrupt)
    num_block_reads: int = 0  # physical reads (a block shared by concurrent loads is read once)
    load_bytes: int = 0
    load_seconds: float = 0.0  # sum over handles of submit -> done
    num_stored_blocks: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0  # writer busy time
    num_dropped_blocks: int = 0  # store requests dropped: writer behind, tier off, or too big
    num_evicted_blocks: int = 0  # removed by the size cap
    num_corrupt: int = 0  # files/blocks found truncated, corrupt or foreign, and removed


class LoadHandle:
    """Completion handle of one request's load of ``hashes`` (in prefix order).

    ``num_loaded`` (valid once ``done()``) is the number of leading blocks that
    arrived: after a failure at block i, blocks i.. are recomputed, so later
    ones are not delivered.  After ``done()`` no sink call is running or will run.
    """

    def __init__(self, hashes: Sequence[int], sink: BlockSink, on_done: Callable[[LoadHandle], None] | None = None):
        self.hashes = tuple(hashes)
        self._sink = sink
        self._on_done = on_done
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._ok = [False] * len(self.hashes)
        self._first_failure = len(self.hashes)
        self._remaining = len(self.hashes)
        self._cancelled = False
        self.submitted_at = time.monotonic()
        self.finished_at: float | None = None
        self.num_bytes = 0  # payload bytes delivered
        if not self.hashes:
            self._finish()

    # ------------------------------------------------------------ caller side

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def cancel(self) -> None:
        """Deliver nothing more (the request was aborted); ``done()`` follows soon."""
        with self._lock:
            self._cancelled = True

    @property
    def num_loaded(self) -> int:
        n = 0
        while n < len(self._ok) and self._ok[n]:
            n += 1
        return n

    @property
    def latency(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    # ------------------------------------------------------------ tier side

    def wants(self, i: int) -> bool:
        with self._lock:
            return not self._cancelled and i < self._first_failure

    def deliver(self, i: int, payload: memoryview | None, error: BaseException | None = None) -> None:
        ok = False
        if payload is not None and self.wants(i):
            try:
                self._sink(i, payload)
                ok = True
            except Exception as e:  # a sink failure is this request's problem only
                log.warning("KV load: copying block %d into the cache failed: %s", i, e)
        with self._lock:
            if ok:
                self._ok[i] = True
                self.num_bytes += len(payload)  # type: ignore[arg-type]
            elif not self._cancelled:
                self._first_failure = min(self._first_failure, i)
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        self.finished_at = time.monotonic()
        if self._on_done is not None:
            self._on_done(self)
        self._event.set()


class _Job:
    """The blocks one load reads itself (those no earlier load was already reading)."""

    __slots__ = ("hashes", "next")

    def __init__(self, hashes: list[int]):
        self.hashes, self.next = hashes, 0


class _Inflight:
    """One pending read of a block, and every (handle, index) waiting for it."""

    __slots__ = ("waiters",)

    def __init__(self) -> None:
        self.waiters: list[tuple[LoadHandle, int]] = []


class KVTier:
    """Base of the tiers: the load threads (round-robin, shared reads) and the writer thread.

    Subclasses implement ``_has``, ``_read_block`` (raise ``TierError`` for a
    block that cannot be served), ``_write_blocks`` and ``_snapshot``.
    """

    name = "base"

    def __init__(self, block_bytes: int, *, num_load_threads: int = 4, max_pending_bytes: int = 256 << 20):
        self.block_bytes = block_bytes
        self.max_pending_bytes = max_pending_bytes
        self.stats = TierStats(name=self.name)
        self._lock = threading.RLock()  # index + stats; subclasses share it
        self._cv = threading.Condition(threading.Lock())  # load queue
        self._jobs: deque[_Job] = deque()
        self._inflight: dict[int, _Inflight] = {}
        self._closed = False
        self._wcv = threading.Condition(threading.Lock())  # store queue
        self._pending: deque[tuple[list[int], torch.Tensor]] = deque()
        self._pending_bytes = 0
        self._writing = False
        self._threads = [
            threading.Thread(target=self._load_loop, name=f"kv-{self.name}-load{i}", daemon=True)
            for i in range(num_load_threads)
        ]
        self._threads.append(threading.Thread(target=self._write_loop, name=f"kv-{self.name}-write", daemon=True))

    def _start(self) -> None:
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ interface

    @property
    def is_enabled(self) -> bool:
        return self.stats.is_enabled

    @property
    def is_writable(self) -> bool:
        return self.stats.is_enabled and self.stats.is_writable

    def count_prefix(self, hashes: Sequence[int]) -> int:
        """Number of leading ``hashes`` this tier holds (0 when disabled)."""
        if not self.stats.is_enabled:
            return 0
        n = 0
        with self._lock:
            for h in hashes:
                if not self._has(h):
                    break
                n += 1
        return n

    def load(self, hashes: Sequence[int], sink: BlockSink) -> LoadHandle:
        handle = LoadHandle(hashes, sink, self._handle_done)
        if not handle.hashes:
            return handle
        with self._cv:
            closed = self._closed
            if not closed:
                own = []
                for i, h in enumerate(handle.hashes):
                    inflight = self._inflight.get(h)
                    if inflight is None:  # nobody is reading it: this load will
                        inflight = self._inflight[h] = _Inflight()
                        own.append(h)
                    inflight.waiters.append((handle, i))
                if own:
                    self._jobs.append(_Job(own))
                    self._cv.notify()
        if closed:
            for i in range(len(handle.hashes)):
                handle.deliver(i, None)
        return handle

    def store(self, hashes: Sequence[int], payloads: torch.Tensor) -> bool:
        """Queue blocks (payloads: (n, block_bytes) uint8 CPU, owned by the tier from now on).

        Returns False (and counts them dropped) when the tier is off or the
        writer is more than ``max_pending_bytes`` behind.
        """
        n = len(hashes)
        if n == 0:
            return True
        if payloads.shape != (n, self.block_bytes) or payloads.dtype != torch.uint8:
            raise ValueError(f"payloads must be ({n}, {self.block_bytes}) uint8, got {tuple(payloads.shape)} {payloads.dtype}")
        size = n * self.block_bytes
        with self._wcv:
            ok = (
                self.stats.is_enabled and self.stats.is_writable and not self._closed
                and self._pending_bytes + size <= self.max_pending_bytes
            )
            if ok:
                self._pending.append((list(hashes), payloads))
                self._pending_bytes += size
                self._wcv.notify()
        if not ok:
            with self._lock:
                self.stats.num_dropped_blocks += n
        return ok

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued store is written (or dropped); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wcv:
            while self._pending or self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._wcv.wait(left)
        return True

    def make_stats(self) -> TierStats:
        with self._lock:
            s = TierStats(**{f.name: getattr(self.stats, f.name) for f in fields(self.stats)})
        s.num_blocks, s.num_bytes = self._snapshot()
        return s

    def close(self, flush: bool = True, timeout: float = 30.0) -> None:
        if flush:
            self.flush(timeout)
        with self._cv:
            self._closed = True
            jobs = list(self._jobs)
            self._jobs.clear()
            self._cv.notify_all()
        with self._wcv:
            self._wcv.notify_all()
        for job in jobs:  # reads never started: finish their waiters empty-handed
            for h in job.hashes[job.next :]:
                with self._cv:
                    waiters = self._inflight.pop(h).waiters
                for handle, i in waiters:
                    handle.cancel()
                    handle.deliver(i, None)
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout)

    def __enter__(self) -> KVTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ subclass hooks

    def _has(self, h: int) -> bool:  # called under self._lock
        raise NotImplementedError

    def _read_block(self, h: int) -> memoryview:  # any thread, no lock held
        raise NotImplementedError

    def _write_blocks(self, hashes: list[int], payloads: list[torch.Tensor]) -> None:  # writer thread
        raise NotImplementedError

    def _snapshot(self) -> tuple[int, int]:  # (num_blocks, num_bytes) now
        raise NotImplementedError

    def _disable(self, reason: str, *, reads_too: bool) -> None:
        with self._lock:
            was = self.stats.is_enabled and self.stats.is_writable
            self.stats.is_writable = False
            if reads_too:
                self.stats.is_enabled = False
        if was:
            log.warning("KV %s tier %s: %s; serving continues without it", self.name,
                        "disabled" if reads_too else "no longer written", reason)

    # ------------------------------------------------------------ threads

    def _handle_done(self, handle: LoadHandle) -> None:
        with self._lock:
            s = self.stats
            s.num_loads += 1
            s.num_loaded_blocks += handle.num_loaded
            s.num_failed_blocks += len(handle.hashes) - sum(handle._ok)
            s.load_bytes += handle.num_bytes
            s.load_seconds += handle.latency or 0.0

    def _load_loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._jobs.popleft()
                h = job.hashes[job.next]
                job.next += 1
                if job.next < len(job.hashes):
                    self._jobs.append(job)  # round-robin: back of the line
                wanted = any(handle.wants(i) for handle, i in self._inflight[h].waiters)
            payload: memoryview | None = None
            err: BaseException | None = None
            if wanted and self.stats.is_enabled:
                try:
                    payload = self._read_block(h)
                except TierError as e:
                    err = e
                except Exception as e:  # an unexpected failure fails this block, never the thread
                    log.warning("KV %s tier: reading a block failed: %r", self.name, e)
                    err = e
            with self._cv:
                waiters = self._inflight.pop(h).waiters
            if payload is not None:
                with self._lock:
                    self.stats.num_block_reads += 1
            for handle, i in waiters:
                handle.deliver(i, payload, err)

    def _write_loop(self) -> None:
        while True:
            with self._wcv:
                while not self._pending and not self._closed:
                    self._wcv.wait()
                if not self._pending:  # closed and drained
                    return
                hashes: list[int] = []
                rows: list[torch.Tensor] = []
                while self._pending:  # take everything queued: one group file per batch
                    hs, payloads = self._pending.popleft()
                    self._pending_bytes -= payloads.numel()
                    hashes.extend(hs)
                    rows.extend(payloads.unbind(0))
                self._writing = True
            t0 = time.monotonic()
            try:
                if self.stats.is_enabled and self.stats.is_writable:
                    self._write_blocks(hashes, rows)
                else:
                    with self._lock:
                        self.stats.num_dropped_blocks += len(hashes)
            except Exception as e:  # never kill the writer: the tier goes off instead
                self._disable(f"unexpected write error {e!r}", reads_too=True)
            finally:
                with self._lock:
                    self.stats.store_seconds += time.monotonic() - t0
                with self._wcv:
                    self._writing = False
                    self._wcv.notify_all()
