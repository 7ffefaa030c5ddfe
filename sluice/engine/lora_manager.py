"""The engine core's LoRA adapters: the registry, loads off the step loop, an LRU in memory.

    registry   name -> Adapter (path, engine id, prefix salt)   --lora-modules, POST /v1/load_lora_adapter
    resident   lora_id -> LoRAAdapter (packed weights), LRU     at most --max-cpu-loras (``capacity``)
    loader     one thread: read, check and pack an adapter      (``sluice.models.lora.load_lora``)

An adapter is registered once its files proved loadable (at start-up for
``--lora-modules``, by the loader thread for the load endpoint); it stays
registered until unloaded, while its weights come and go: evicted when the
LRU needs room and no unfinished request uses it, reloaded by its next
request.  The step loop (``EngineCore.step`` -> ``poll``) installs finished
loads, starts queued ones and evicts; the loader thread only builds an
``LoRAAdapter`` and touches no state of this class.

NOTE(lora-loads): a request whose adapter is not in memory waits in the
scheduler's queue (``Scheduler`` defers it, others are admitted past it)
while the loader reads the adapter; the step loop never blocks on a load.
The load is reported as a ``LoRALoadRecord`` carrying the traceparent of the
request (or admin call) that caused it, which the API process turns into a
span, child of that request's span, and metrics.

NOTE(lora-file-sizes): an adapter's files are sized before they are read: the
config at most MAX_CONFIG_BYTES, the weights at most what an adapter of rank
--max-lora-rank on every target of this base model takes in float64 (the
widest dtype), plus room for the safetensors header.  A bigger file cannot be
a valid adapter, and reading it would hold the loader (and memory) for nothing.

NOTE(lora-pins): an adapter with unfinished requests is never evicted, so a
load waits for a slot when every resident adapter is in use (capacity >=
--max-loras guarantees the adapters of running requests always fit).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.engine.protocol import LoRALoadRecord, LoRAStats
from sluice.engine.request import Request
from sluice.errors import InvalidRequestError, ModelNotFoundError, SluiceError
from sluice.models.lora import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoRAAdapter,
    LoRABatch,
    LoRAGroup,
    load_lora,
)

if TYPE_CHECKING:
    from sluice.engine.scheduler import SchedulerOutput
    from sluice.models.config import ModelConfig
    from sluice.models.llama import LlamaForCausalLM

__all__ = ["Adapter", "LoRAManager", "build_lora_batch", "cache_salt", "check_file_sizes", "max_weights_bytes"]

log = logging.getLogger("sluice.engine")

MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json (NOTE(lora-file-sizes))
_HEADER_BYTES = 1 << 20  # safetensors header allowance, plus _TENSOR_HEADER_BYTES per tensor
_TENSOR_HEADER_BYTES = 512


def max_weights_bytes(cfg: ModelConfig, max_rank: int) -> int:
    """Largest ``adapter_model.safetensors`` an adapter of rank ``max_rank`` can take on this
    base model (every target of every layer, float64)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    # (in + out) of q, k, v, o, gate, up, down: A is (r, in), B is (out, r)
    per_rank = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    num_tensors = cfg.num_layers * 7 * 2
    return cfg.num_layers * max_rank * per_rank * 8 + _HEADER_BYTES + num_tensors * _TENSOR_HEADER_BYTES


def check_file_sizes(path: str, max_weights: int) -> None:
    """Refuse an adapter whose files are larger than any valid one (NOTE(lora-file-sizes))."""
    p = Path(path)
    for name, limit, why in ((CONFIG_FILE, MAX_CONFIG_BYTES, ""),
                             (WEIGHTS_FILE, max_weights, " for an adapter of rank --max-lora-rank on this base model")):
        try:
            size = (p / name).stat().st_size
        except OSError:
            continue  # missing: load_lora names the problem
        if size > limit:
            raise InvalidRequestError(f"LoRA adapter {path!r}: {name} is {size} bytes, more than the {limit} "
                                      f"bytes a valid one takes{why}", param="lora_path",
                                      code="invalid_lora_adapter")  # fmt: skip


def cache_salt(name: str, digest: str) -> bytes:
    """Prefix-cache salt of an adapter: its name and the digest of its files.

    Stable across processes (no Python ``hash``), so the blocks of a disk KV
    tier stay valid for the same adapter after a restart, and a changed
    adapter under the same name never reuses old blocks.
    """
    return b"lora\x00" + name.encode() + b"\x00" + bytes.fromhex(digest)


@dataclass(eq=False)
class Adapter:
    """One registration of an adapter name."""

    name: str
    path: str
    lora_id: int  # > 0, unique per registration (a re-registered name gets a new id)
    digest: str  # of its files when registered
    weights: LoRAAdapter | None = None  # None: not in memory
    num_requests: int = 0  # unfinished requests that use it (pins it in memory)
    is_registered: bool = True  # False: unloaded; kept while requests still use it
    is_loading: bool = False
    load_error: str | None = None  # the last failed reload

    @property
    def salt(self) -> bytes:
        return cache_salt(self.name, self.digest)


@dataclass(eq=False)
class _Load:
    name: str
    path: str
    adapter: Adapter | None  # the registered adapter being reloaded; None: a new registration
    cause: str  # 'request' | 'admin'
    request_id: str | None = None
    traceparent: str | None = None
    ticket: int = 0
    start: float = 0.0
    future: cf.Future[LoRAAdapter] | None = None


@dataclass
class _Counters:
    num_loads: int = 0
    num_load_failures: int = 0
    num_evictions: int = 0
    load_seconds: float = 0.0
    recent: list[LoRALoadRecord] = field(default_factory=list)  # finished loads not yet taken


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, *, max_rank: int, max_loras: int, capacity: int):
        self.model = model
        self.max_rank = max_rank
        self.max_loras = max_loras
        self.capacity = capacity
        self.by_name: dict[str, Adapter] = {}  # registered adapters
        self.by_id: dict[int, Adapter] = {}  # registered, or still used by a request
        self.resident: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_id -> weights, LRU first (the runner reads it)
        self._by_request: dict[str, Adapter] = {}  # request_id -> its adapter
        self._running: list[_Load] = []  # loads in the loader thread
        self._queued: list[_Load] = []  # loads waiting for a slot
        self._executor: cf.ThreadPoolExecutor | None = None
        self._next_id = 1
        self._next_ticket = 1
        self.counters = _Counters()

    # ------------------------------------------------------------ registry

    def register_now(self, name: str, path: str) -> Adapter:
        """Load and register an adapter in the calling thread (``--lora-modules`` at start-up)."""
        self._check_new(name, path)
        t0 = time.monotonic()
        weights = self._load(path, name)
        adapter = self._register(name, path, weights.digest)
        self._install(adapter, weights)
        self._count(_Load(name, path, None, "startup", start=t0), weights.num_file_bytes, None)
        return adapter

    def start_load(self, name: str, path: str, traceparent: str | None = None) -> int:
        """Load an adapter in the background and register it when it proves good (``POST
        /v1/load_lora_adapter``); returns the ticket of the ``LoRALoadRecord`` that answers."""
        self._check_new(name, path)
        if any(ld.name == name for ld in self._running + self._queued if ld.adapter is None):
            raise InvalidRequestError(f"LoRA adapter {name!r} is already being loaded", param="lora_name",
                                      code="lora_already_loaded")  # fmt: skip
        ticket = self._next_ticket
        self._next_ticket += 1
        self._schedule_load(_Load(name, path, None, "admin", traceparent=traceparent, ticket=ticket))
        return ticket

    def unregister(self, name: str) -> None:
        """New requests for ``name`` are refused from now on; its running requests finish."""
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise ModelNotFoundError(f"LoRA adapter {name!r} is not loaded", param="lora_name")
        adapter.is_registered = False
        self._queued = [ld for ld in self._queued if ld.adapter is not adapter or adapter.num_requests]
        self._drop_if_unused(adapter)

    def _check_new(self, name: str, path: str) -> None:
        if not name or any(c.isspace() for c in name):
            raise InvalidRequestError(f"invalid LoRA adapter name {name!r}", param="lora_name")
        if name in self.by_name:
            raise InvalidRequestError(f"LoRA adapter {name!r} is already loaded (from {self.by_name[name].path}); "
                                      "unload it first", param="lora_name", code="lora_already_loaded")  # fmt: skip
        if not Path(path).is_dir():
            raise InvalidRequestError(f"LoRA adapter path {path!r} is not a directory", param="lora_path",
                                      code="invalid_lora_adapter")  # fmt: skip

    def _register(self, name: str, path: str, digest: str) -> Adapter:
        adapter = Adapter(name, path, self._next_id, digest)
        self._next_id += 1
        self.by_name[name] = adapter
        self.by_id[adapter.lora_id] = adapter
        return adapter

    # ------------------------------------------------------------ requests

    def acquire(self, req: Request) -> None:
        """Bind a new request to its adapter (``req.lora_name``); start a load if it is not in memory.

        Raises ``ModelNotFoundError`` for a name that is not registered.
        """
        name = req.lora_name
        adapter = self.by_name.get(name or "")
        if adapter is None:
            raise ModelNotFoundError(f"model {name!r} is not served here (no such LoRA adapter)")
        adapter.num_requests += 1
        self._by_request[req.request_id] = adapter
        req.lora_id = adapter.lora_id
        req.cache_salt = adapter.salt
        if adapter.lora_id in self.resident:
            self.resident.move_to_end(adapter.lora_id)  # most recently used
        elif not adapter.is_loading:
            self._schedule_load(_Load(adapter.name, adapter.path, adapter, "request", req.request_id, req.traceparent))

    def release(self, request_id: str) -> None:
        """A request finished (any way): unpin its adapter."""
        adapter = self._by_request.pop(request_id, None)
        if adapter is None:
            return
        adapter.num_requests -= 1
        self._drop_if_unused(adapter)

    def is_ready(self, req: Request) -> bool:
        """Whether the request's adapter (if any) is in memory."""
        return req.lora_id == 0 or req.lora_id in self.resident

    def waiting_on_failed_load(self) -> dict[int, str]:
        """lora_id -> error, for adapters whose reload failed and whose requests must be failed (then cleared)."""
        out = {}
        for adapter in self.by_id.values():
            if adapter.load_error is not None:
                out[adapter.lora_id] = adapter.load_error
                adapter.load_error = None
        return out

    # ------------------------------------------------------------ the step loop

    def poll(self) -> None:
        """Install finished loads, evict for and start queued ones (called once per step)."""
        if self._running:
            for ld in [ld for ld in self._running if ld.future is not None and ld.future.done()]:
                self._running.remove(ld)
                self._finish(ld)
        if self._queued:
            queued, self._queued = self._queued, []
            for ld in queued:
                self._schedule_load(ld)

    @property
    def has_pending_loads(self) -> bool:
        return bool(self._running or self._queued)

    def wait_any(self, timeout: float) -> None:
        """Sleep until a load finishes (at most ``timeout`` s): the step loop has nothing else to do."""
        futures = [ld.future for ld in self._running if ld.future is not None]
        if futures:
            cf.wait(futures, timeout, return_when=cf.FIRST_COMPLETED)
        else:
            time.sleep(timeout)

    def take_records(self) -> list[LoRALoadRecord]:
        out, self.counters.recent = self.counters.recent, []
        return out

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # ------------------------------------------------------------ loads

    def _num_slots_taken(self) -> int:
        return len(self.resident) + len(self._running)

    def _schedule_load(self, ld: _Load) -> None:
        """Start ``ld`` if a slot is free or can be freed by evicting an unused adapter, else queue it."""
        if ld.adapter is not None and not ld.adapter.is_registered and not ld.adapter.num_requests:
            return  # unloaded meanwhile, nobody needs it any more
        while self._num_slots_taken() >= self.capacity:
            if not self._evict_one():
                self._queued.append(ld)
                if ld.adapter is not None:
                    ld.adapter.is_loading = True
                return
        if ld.adapter is not None:
            ld.adapter.is_loading = True
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-lora-load")
        ld.start = time.monotonic()
        ld.future = self._executor.submit(self._load, ld.path, ld.name)
        self._running.append(ld)
        log.info("loading LoRA adapter %r from %s (%s)", ld.name, ld.path, ld.cause)

    def _load(self, path: str, name: str) -> LoRAAdapter:
        """Size-check, read, check and pack an adapter (the loader thread, or start-up)."""
        check_file_sizes(path, max_weights_bytes(self.model.cfg, self.max_rank))
        return load_lora(path, self.model, max_rank=self.max_rank, name=name)

    def _finish(self, ld: _Load) -> None:
        assert ld.future is not None
        weights: LoRAAdapter | None = None
        error: str | None = None
        try:
            weights = ld.future.result()
        except SluiceError as e:
            error = e.message
        except Exception as e:  # noqa: BLE001 -- any failure of one load is reported, the engine goes on
            log.exception("loading LoRA adapter %r failed", ld.name)
            error = f"{type(e).__name__}: {e}"
        adapter = ld.adapter
        if adapter is None:  # a new registration
            if weights is not None:
                if ld.name in self.by_name:  # registered by start-up or another load meanwhile
                    error, weights = f"LoRA adapter {ld.name!r} is already loaded", None
                else:
                    adapter = self._register(ld.name, ld.path, weights.digest)
        else:
            adapter.is_loading = False
            if weights is not None and weights.digest != adapter.digest:
                error, weights = (f"LoRA adapter {ld.name!r}: its files at {ld.path} changed since it was "
                                  "registered; unload and load it again"), None  # fmt: skip
            if error is not None:
                adapter.load_error = f"LoRA adapter {ld.name!r} could not be loaded: {error}"
        if adapter is not None and weights is not None:
            self._install(adapter, weights)
        self._count(ld, weights.num_file_bytes if weights is not None else 0, error)
        if adapter is not None:
            self._drop_if_unused(adapter)

    def _install(self, adapter: Adapter, weights: LoRAAdapter) -> None:
        adapter.weights = weights
        self.resident[adapter.lora_id] = weights
        self.resident.move_to_end(adapter.lora_id)
        while len(self.resident) > self.capacity and self._evict_one(keep=adapter.lora_id):
            pass

    def _evict_one(self, keep: int = 0) -> bool:
        """Drop the least recently used resident adapter that no request uses."""
        for lora_id in self.resident:
            adapter = self.by_id.get(lora_id)
            if lora_id != keep and (adapter is None or adapter.num_requests == 0):
                self._evict(lora_id)
                return True
        return False

    def _evict(self, lora_id: int) -> None:
        weights = self.resident.pop(lora_id)
        adapter = self.by_id.get(lora_id)
        if adapter is not None:
            adapter.weights = None
        self.counters.num_evictions += 1
        log.info("evicted LoRA adapter %r (least recently used)", weights.name)

    def _drop_if_unused(self, adapter: Adapter) -> None:
        """An unregistered adapter goes away with its last request."""
        if adapter.is_registered or adapter.num_requests or adapter.is_loading:
            return
        self.by_id.pop(adapter.lora_id, None)
        self.resident.pop(adapter.lora_id, None)
        adapter.weights = None

    def _count(self, ld: _Load, num_bytes: int, error: str | None) -> None:
        end = time.monotonic()
        c = self.counters
        if error is None:
            c.num_loads += 1
            c.load_seconds += end - ld.start
            log.info("loaded LoRA adapter %r in %.3fs (%d bytes)", ld.name, end - ld.start, num_bytes)
        else:
            c.num_load_failures += 1
            log.warning("LoRA adapter %r failed to load: %s", ld.name, error)
        c.recent.append(LoRALoadRecord(adapter=ld.name, path=ld.path, start=ld.start, end=end, num_bytes=num_bytes,
                                       cause=ld.cause, request_id=ld.request_id, traceparent=ld.traceparent,
                                       ticket=ld.ticket, error=error))  # fmt: skip

    # ------------------------------------------------------------ stats

    def make_stats(self, active_ids: Collection[int], num_waiting_for_load: int) -> LoRAStats:
        c = self.counters
        names = {a.lora_id: a.name for a in self.by_id.values()}
        return LoRAStats(
            max_loras=self.max_loras,
            adapters=sorted(self.by_name),
            loaded=[names.get(i, w.name) for i, w in self.resident.items()],
            active=sorted({names[i] for i in active_ids if i in names}),
            num_waiting_for_load=num_waiting_for_load,
            num_loads=c.num_loads,
            num_load_failures=c.num_load_failures,
            num_evictions=c.num_evictions,
            load_seconds=c.load_seconds,
        )

    def describe(self, name: str) -> dict[str, Any]:
        a = self.by_name[name]
        w = a.weights
        return {"name": a.name, "path": a.path, "digest": a.digest, "rank": w.rank if w else None,
                "targets": w.targets if w else None, "num_bytes": w.num_bytes if w else None}  # fmt: skip


def build_lora_batch(sched: SchedulerOutput, resident: dict[int, LoRAAdapter]) -> LoRABatch | None:
    """Row groups of the step's adapters over the flat batch (the scheduler lays each adapter's
    requests out contiguously, NOTE(lora-rows) in scheduler.py); None when no row uses one."""
    groups: list[LoRAGroup] = []
    row = 0
    start, current = 0, 0
    for s in sched.scheduled:
        lid = s.request.lora_id
        if lid != current:
            if current:
                groups.append(LoRAGroup(start, row, resident[current]))
            start, current = row, lid
        row += s.num_new_tokens
    if current:
        groups.append(LoRAGroup(start, row, resident[current]))
    return LoRABatch(groups) if groups else None
