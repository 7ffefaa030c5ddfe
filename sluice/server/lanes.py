"""Several engine core processes behind one API process (``--data-parallel-size N``), and the one
admission object that serves one engine core or N.

NOTE(data-parallel): on a CPU with few cores, N engine cores of one thread each serve more than one
engine core of N threads: each step of a multi-threaded engine ends with its threads waiting for one
another (NOTE(pool-waits)), and small steps, P0's express steps above all, parallelise worst.  The
measurement: docs/design/overload.md, "Lanes".

A lane is one engine core with its own ``EngineClient`` and its own ``AdmissionController`` (predicting
from its own engine's stats).  ``LanedClient`` gives the API process the interface of one client;
``LanedAdmission`` is the API process's admission, for one lane or N (one path for both):

- ``admit`` picks the lane.  A P0 goes to a lane with the fewest P0s still waiting for their first
  output (as the gateway spreads them, NOTE(p0-spread)), then to the lowest predicted TTFT; the other
  classes go to the lowest predicted TTFT.  A request is refused only when every lane refuses it; the
  decision names its lane, and ``LanedClient.add_requests`` sends it there.
- NOTE(lane-prefix): each lane has its own prefix cache, and a conversation's next turn repeats its
  history.  With several lanes, the keys of the full prompt blocks sent to each lane are remembered
  (the last ``PREFIX_MEMORY_BLOCKS``), a lane's TTFT is predicted without the prefill of the blocks it
  holds, and with every lane idle a request goes to the lane that holds most of it.  A guess: the engine
  may have evicted them, and a LoRA adapter is not in these keys.  ``SLUICE_LANE_PREFIX=0`` turns it off.
- Aborts and releases follow the request to its lane; operator commands go to every lane, profiling to
  the first.  Stats are summed over the lanes for the metrics and ``/admin/kv`` (``merge_stats``); each
  lane's admission reads its own engine's.

The engines share nothing but idle cores: each has its weights, KV cache, slots and, with
``--kv-disk-dir``, a tier of its own (NOTE(lane-tiers)).

NOTE(lane-lend): one thread per lane made a lone request slower than one engine on every core.
Unpinned and with ``--num-threads`` not given, each engine's work pool gets a thread per core, and
before each step an engine reads the lanes' idle marks (``CoreLending``): with every other lane idle for
``LEND_AFTER_S`` or more it runs on all the cores, else on its share.  The wait keeps a lane from
borrowing in the gaps between another's steps, where the cores would be wanted back mid-step
(NOTE(pool-waits)).  A model not on sluice's kernels runs on torch's threads, which are not lent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from sluice.engine.config import BLOCK_SIZE, EngineConfig, ModelInfo
from sluice.engine.protocol import EngineRequest, EngineStats, KVTierStats
from sluice.errors import OverloadedError
from sluice.server.admission import AdmissionController, Decision
from sluice.server.engine_client import EngineClient, RequestStream
from sluice.types import Priority

if TYPE_CHECKING:
    from sluice.server.config import ServerSettings

__all__ = [
    "AnyAdmission", "AnyClient", "CoreLending", "LanedAdmission", "LanedClient", "build_admission", "data_parallel_lanes",
    "lane_configs", "lane_lending", "lane_of", "merge_stats", "prompt_block_keys",
]

# fields that are a level, not an amount: the lanes' mean, not their sum
_MEAN_FIELDS = frozenset({"kv_cache_usage", "step_time", "step_time_base", "step_time_per_token", "step_time_per_seq"})


LEND_AFTER_S = 0.1  # another lane idle this long lends its cores (NOTE(lane-lend)): not a gap between its steps


class CoreLending:
    """One lane's side of NOTE(lane-lend): its idle mark, and the threads its engine's loops run on.

    Made in the API process (``lane_lending``) and handed to the lane's engine core process, which
    calls ``update`` before each step."""

    def __init__(self, marks: Any, lane: int, own: int, lent: int, clock: Callable[[], float] = time.monotonic):
        # a shared double per lane (multiprocessing RawArray; each lane writes only its own): 0 while that
        # engine has work, else when it went idle (CLOCK_MONOTONIC, the same in every process)
        self.marks = marks
        self.lane, self.own, self.lent = lane, own, lent
        self.clock = clock
        self.active = 0  # the work pool's setting now (0: not set yet)

    def update(self, busy: bool) -> None:
        now = self.clock()
        if not busy:
            if self.marks[self.lane] == 0.0:
                self.marks[self.lane] = now
            return
        self.marks[self.lane] = 0.0
        if self.active == 0:
            self._first_step()
        idle = all(0.0 < self.marks[i] <= now - LEND_AFTER_S for i in range(len(self.marks)) if i != self.lane)
        want = self.lent if idle else self.own
        if want != self.active:
            from sluice.kernels import ext

            ext.set_work_pool_active(want)
            self.active = want

    def _first_step(self) -> None:
        """A model not on sluice's work pool (float weights on BLAS, NOTE(work-pool)) runs on torch's
        threads, which cannot be lent: they keep the lane's share, and the lane never borrows."""
        from sluice.kernels import ext

        if ext.work_pool_threads() == 0:
            torch = sys.modules.get("torch")  # not loaded (a fake engine): no threads to share
            if torch is not None:
                torch.set_num_threads(self.own)
            self.lent = self.own


def _no_lending(config: EngineConfig, n: int, cpus: tuple[int, ...] | None) -> str:
    """Why ``n`` lanes would not lend each other their cores (NOTE(lane-lend)); '' when they would."""
    if n < 2:
        return "one lane"
    if cpus is not None:
        return "--cpu-affinity"
    if config.num_threads is not None:
        return "--num-threads"
    if os.environ.get("SLUICE_LANE_LEND") == "0":
        return "SLUICE_LANE_LEND=0"
    cores = len(os.sched_getaffinity(0))
    return "" if cores >= 2 else f"{cores} core"


def _lends(config: EngineConfig, n: int, cpus: tuple[int, ...] | None) -> int:
    """The cores a lane may borrow (NOTE(lane-lend)): all this process's when unpinned, ``--num-threads``
    not given and more than one lane shares them; 0 otherwise."""
    return 0 if _no_lending(config, n, cpus) else len(os.sched_getaffinity(0))


def lane_lending(config: EngineConfig, n: int, cpus: tuple[int, ...] | None) -> list[CoreLending | None]:
    """Each lane's ``CoreLending`` (NOTE(lane-lend)), or None for every lane where the cores are not lent."""
    cores = _lends(config, n, cpus)
    if not cores:
        return [None] * n
    import multiprocessing

    marks = multiprocessing.get_context("spawn").RawArray("d", n)
    marks[:] = [time.monotonic()] * n  # every lane idle since now
    return [CoreLending(marks, i, max(1, cores // n), cores) for i in range(n)]


AUTO_CORES = (2, 3)  # NOTE(dp-auto): the CPU sizes where `--data-parallel-size auto` runs two lanes
AUTO_MEMORY_SHARE = 0.25  # one copy of the weights at most this share of the free memory (two: half)


def data_parallel_lanes(
    setting: str, config: EngineConfig, cpus: tuple[int, ...] | None, custom_engine: bool = False
) -> tuple[int, str]:
    """The engine cores ``--data-parallel-size`` asks for, and why (for the start-up log).

    NOTE(dp-auto): ``auto`` runs two lanes where they were measured to serve more and hold P0 better
    without slowing a lone stream: sluice's engine on a CPU of 2-3 cores, not pinned, ``--num-threads``
    not given (the cores lent, NOTE(lane-lend)), quantized weights (float ones run on torch's threads,
    which are not lent) whose two copies fit in half the free memory; elsewhere one engine core.  Not
    the default: on long multi-turn prompts one engine served more (docs/benchmarks.md, "Multi-turn
    conversations on two lanes")."""
    if setting != "auto":
        return int(setting), f"--data-parallel-size {setting}"
    n, why = 1, ""
    cores = len(os.sched_getaffinity(0))
    if custom_engine:
        why = "a custom engine"
    elif config.device != "cpu":
        why = f"--device {config.device}"
    elif refusal := _no_lending(config, 2, cpus):  # two lanes that could not lend: a lone stream on one core
        why = refusal
    elif cores not in AUTO_CORES:
        why = f"{cores} cores"
    else:
        import psutil

        from sluice.errors import SluiceError
        from sluice.models.formats import served_quantized, weights_bytes
        from sluice.models.source import resolve_model

        try:
            source = resolve_model(config.model)
            quantized, size = served_quantized(source, config.quantization), weights_bytes(source)
        except (SluiceError, OSError) as e:  # the engine reports a bad model at load
            return 1, f"auto: model not read ({e})"
        free = psutil.virtual_memory().available
        if not quantized:
            why = "float weights (torch's threads are not lent)"
        elif size > AUTO_MEMORY_SHARE * free:
            why = f"weights of {size / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        else:
            n, why = 2, f"{cores} cores, quantized weights"
    return n, f"auto: {why}"


def lane_configs(
    config: EngineConfig, n: int, cpus: tuple[int, ...] | None
) -> list[tuple[EngineConfig, tuple[int, ...] | None]]:
    """Each lane's engine config and cores (``cpus``: the engine cores of ``--cpu-affinity``, None: not pinned).

    The cores are cut into ``n`` runs of neighbours (every lane gets them all when there are fewer than
    ``n``); ``--num-threads`` not given, a lane runs on its share of the cores (one engine: a thread per
    pinned core, else the engine's default), and unpinned its pool has a thread per core to borrow the
    idle lanes' (NOTE(lane-lend)).

    NOTE(lane-tiers): with ``--kv-disk-dir``, the first lane's tier is the directory itself, where one
    engine core keeps it, and each other lane's a subdirectory ``lane-<i>``, so that no two engines
    write one tier, and a tier outlives a change in the number of lanes (``auto`` may count them
    differently from one start to the next, NOTE(dp-auto)); while every lane is idle a request goes to
    the first lane, which finds what one engine stored.  The tier touches only its own ``kv-<fingerprint>``
    directory, so the ``lane-<i>`` ones beside it are safe from its eviction.
    """
    if n == 1:
        if cpus and config.num_threads is None:  # pinned: a thread per core it was given
            config = dataclasses.replace(config, num_threads=len(cpus))
        return [(config, cpus)]
    shares: list[tuple[int, ...] | None] = [cpus] * n
    split = cpus is not None and len(cpus) >= n
    if split:
        assert cpus is not None
        size, extra = divmod(len(cpus), n)
        starts = [i * size + min(i, extra) for i in range(n + 1)]
        shares = [cpus[starts[i]:starts[i + 1]] for i in range(n)]
    out = []
    lent = _lends(config, n, cpus)
    for i, share in enumerate(shares):
        cfg = config
        if cfg.num_threads is None:
            cores = len(share) if split and share else len(cpus or os.sched_getaffinity(0)) // n
            cfg = dataclasses.replace(cfg, num_threads=lent or max(1, cores))  # lent: a pool thread per core
        if cfg.kv_disk_dir and i > 0:  # the first lane's tier is one engine's (NOTE(lane-tiers))
            cfg = dataclasses.replace(cfg, kv_disk_dir=os.path.join(cfg.kv_disk_dir, f"lane-{i}"))
        out.append((cfg, share))
    return out


def lane_of(request_id: str, lanes: dict[str, int]) -> int | None:
    """The lane of an engine request id ``<uid>-<index>`` (``serving.submit``), by its uid."""
    return lanes.get(request_id.rpartition("-")[0])


def _merge_value(name: str, values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, bool):
        return any(values)
    if isinstance(first, (int, float)):
        total = sum(values)
        return total / len(values) if name in _MEAN_FIELDS else total
    if isinstance(first, str):
        return first
    if isinstance(first, list):
        if name == "running_slots" or name == "recent_load_seconds":
            return [x for v in values for x in v]
        if all(isinstance(x, (int, float)) for v in values for x in v):
            width = max(len(v) for v in values)
            return [sum(v[i] for v in values if i < len(v)) for i in range(width)]
        if name == "kv_tiers":
            by_name: dict[str, list[KVTierStats]] = {}
            for v in values:
                for t in v:
                    by_name.setdefault(t.name, []).append(t)
            return [_merge_struct(ts) for ts in by_name.values()]
        return first
    return first  # a nested struct (lora: every lane holds the same adapters) or None


def _merge_struct(items: list[Any]) -> Any:
    cls = type(items[0])
    return cls(**{f: _merge_value(f, [getattr(s, f) for s in items]) for f in cls.__struct_fields__})


def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """The lanes' stats as one engine's: amounts summed, levels averaged, lists of counts summed per index."""
    if len(stats) == 1:
        return stats[0]
    merged: EngineStats = _merge_struct(stats)
    return merged


PREFIX_MEMORY_BLOCKS = 1 << 14  # NOTE(lane-prefix): prompt blocks remembered per lane, least recently sent dropped


def prompt_block_keys(tokens: Sequence[int]) -> list[int]:
    """Keys of a prompt's full KV blocks, chained as the engine chains its prefix cache's keys (not the
    same keys): the k-th names the first k + 1 blocks (NOTE(lane-prefix)).  Python's hash, not the
    engine's ``kv_tiers.keys.prefix_block_hashes``: that package loads torch, and these keys only pick a
    lane in this process (a collision sends a turn to the other lane, nothing worse)."""
    keys, key = [], 0
    for end in range(BLOCK_SIZE, len(tokens) + 1, BLOCK_SIZE):
        key = hash((key, *tokens[end - BLOCK_SIZE:end]))
        keys.append(key)
    return keys


class LanedClient:
    """N ``EngineClient``s with the interface of one (module docstring)."""

    def __init__(self, clients: list[EngineClient], lanes: dict[str, int]):
        assert clients, "at least one lane"
        self.clients = clients
        self._lanes = lanes  # request uid -> lane, written by LanedAdmission.admit
        self.ready = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        for c in self.clients:
            c.start()

    async def wait_ready(self) -> ModelInfo:
        infos = await asyncio.gather(*(c.wait_ready() for c in self.clients))
        self.ready.set()
        return infos[0]

    async def close(self, timeout: float = 5.0) -> None:
        await asyncio.gather(*(c.close(timeout) for c in self.clients))

    @property
    def pid(self) -> int | None:
        return self.clients[0].pid

    @property
    def model_info(self) -> ModelInfo | None:
        return self.clients[0].model_info

    @property
    def is_dead(self) -> bool:
        return any(c.is_dead for c in self.clients)

    @property
    def is_closing(self) -> bool:
        return any(c.is_closing for c in self.clients)

    @property
    def start_error(self) -> str | None:
        return next((c.start_error for c in self.clients if c.start_error), None)

    # -- stats -----------------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """The engines' last stats merged (merged when read: /metrics at scrape time, /admin/kv)."""
        return merge_stats([c.stats for c in self.clients])

    # -- requests ------------------------------------------------------------------

    def add_requests(self, requests: list[EngineRequest], lane: int = 0) -> RequestStream:
        return self.clients[lane].add_requests(requests)

    def _by_lane(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for rid in request_ids:
            lane = lane_of(rid, self._lanes)
            for i in range(len(self.clients)) if lane is None else (lane,):
                out.setdefault(i, []).append(rid)
        return out

    def abort(self, request_ids: Iterable[str]) -> None:
        for lane, ids in self._by_lane(request_ids).items():
            self.clients[lane].abort(ids)

    def release(self, request_ids: Iterable[str]) -> None:
        for lane, ids in self._by_lane(request_ids).items():
            self.clients[lane].release(ids)

    async def control(self, command: str, timeout: float = 600.0, **args: Any) -> dict[str, Any]:
        """An operator command on every lane (the first lane's report), profiling on the first lane only."""
        if command.startswith("profile"):
            return await self.clients[0].control(command, timeout, **args)
        replies = await asyncio.gather(*(c.control(command, timeout, **args) for c in self.clients))
        return replies[0]

    @property
    def num_open_requests(self) -> int:
        return sum(c.num_open_requests for c in self.clients)


class LanedAdmission:
    """The API process's admission: one ``AdmissionController`` per engine core, one core or several, with
    the interface of one (module docstring).  ``build_admission`` makes it from the server's settings."""

    def __init__(self, lanes: list[AdmissionController], assigned: dict[str, int]):
        assert lanes, "at least one lane"
        self.lanes = lanes
        self._assigned = assigned  # request uid -> lane (shared with LanedClient)
        # NOTE(lane-prefix): each lane's prompt blocks sent, least recently sent first (one lane: nothing to pick)
        self.prefix_memory: list[OrderedDict[int, None]] | None = (
            None if len(lanes) == 1 or os.environ.get("SLUICE_LANE_PREFIX") == "0" else [OrderedDict() for _ in lanes])

    def observe_stats(self, lane: int, stats: EngineStats) -> None:
        """A lane's engine stats, for that lane's predictions."""
        self.lanes[lane].observe_stats(stats)

    # -- choosing a lane -----------------------------------------------------------

    def cached_tokens(self, lane: int, prompts_keys: Sequence[list[int]]) -> int:
        """The prompt tokens whose blocks were sent to ``lane`` before: its prefix cache likely holds them."""
        memory = self.prefix_memory[lane] if self.prefix_memory is not None else {}
        found = 0
        for keys in prompts_keys:
            for k in keys:
                if k not in memory:
                    break
                found += BLOCK_SIZE
        return found

    def _order(self, priority: Priority, num_prompt_tokens: int, prompts_keys: Sequence[list[int]] = ()) -> list[int]:
        """The lanes in the order a new request tries them (module docstring).

        Every lane idle: the one that holds most of the prompt (NOTE(lane-prefix)), else the first, so that
        a lone stream stays in one lane, and that lane finds the others idle long enough to borrow their
        cores (NOTE(lane-lend)); the lanes' predictions differ then by their measurements' noise only."""
        if len(self.lanes) == 1:
            return [0]
        cached = [self.cached_tokens(i, prompts_keys) if prompts_keys else 0 for i in range(len(self.lanes))]
        if all(adm.is_idle for adm in self.lanes):
            return sorted(range(len(self.lanes)), key=lambda i: -cached[i])

        def key(i: int) -> tuple[int, float, int]:
            adm = self.lanes[i]
            p0_waiting = adm.num_queued_of(Priority.P0) if priority == Priority.P0 else 0
            # NOTE(lane-prefix): predicted without the prefill of the blocks the lane holds;
            # equal predictions (engines not measured yet): the fewest queued requests
            prefill = max(1, num_prompt_tokens - cached[i])
            return p0_waiting, adm.predict(adm.load(), priority, prefill), adm.num_queued

        return sorted(range(len(self.lanes)), key=key)

    def admit(self, key: str, priority: Priority, num_tokens: int, num_prompt_tokens: int | None = None,
              prompts: Sequence[Sequence[int]] = ()) -> Decision:
        prompt = num_tokens if num_prompt_tokens is None else num_prompt_tokens
        prompts_keys = [prompt_block_keys(p) for p in prompts] if self.prefix_memory is not None else []
        refusal: OverloadedError | None = None
        for lane in self._order(priority, prompt, prompts_keys):
            try:
                decision = self.lanes[lane].admit(key, priority, num_tokens, num_prompt_tokens)
            except OverloadedError as e:
                if refusal is None or (e.retry_after or 0.0) < (refusal.retry_after or 0.0):
                    refusal = e
                continue
            self._assigned[key] = lane
            self._remember(lane, prompts_keys)
            return dataclasses.replace(decision, lane=lane)
        assert refusal is not None
        raise refusal

    def _remember(self, lane: int, prompts_keys: Sequence[list[int]]) -> None:
        if self.prefix_memory is None:
            return
        memory = self.prefix_memory[lane]
        for keys in prompts_keys:
            for k in keys:
                memory[k] = None
                memory.move_to_end(k)
        while len(memory) > PREFIX_MEMORY_BLOCKS:
            memory.popitem(last=False)

    def _lane(self, key: str) -> AdmissionController | None:
        lane = self._assigned.get(key)
        return None if lane is None else self.lanes[lane]

    # -- the request's life ----------------------------------------------------------

    def started(self, key: str) -> None:
        adm = self._lane(key)
        if adm is not None:
            adm.started(key)

    def remove(self, key: str) -> None:
        adm = self._lane(key)
        if adm is not None:
            adm.remove(key)
        self._assigned.pop(key, None)

    def overdue(self) -> list[str]:
        """Every lane's overdue requests; each keeps its lane until ``remove`` (the shed's abort goes there)."""
        return [k for adm in self.lanes for k in adm.overdue()]

    def observe_output_tokens(self, num_generated: int) -> None:
        for adm in self.lanes:
            adm.observe_output_tokens(num_generated)

    # -- early refusals and signals ---------------------------------------------------

    def refuse_early(self, priority: Priority, max_prompt_tokens: int | None = None) -> OverloadedError | None:
        """A refusal only when every lane would refuse (the first lane's), else None."""
        refusals = [adm.refuse_early(priority, max_prompt_tokens) for adm in self.lanes]
        return None if any(r is None for r in refusals) else refusals[0]

    def has_floor(self, priority: Priority) -> bool:
        return all(adm.has_floor(priority) for adm in self.lanes)

    def signal(self) -> list[tuple[float, float]]:
        """(predicted TTFT, target) per class: the best lane's prediction, where a new request would go."""
        per_lane = [adm.signal() for adm in self.lanes]
        return [min((s[p] for s in per_lane), key=lambda pt: pt[0]) for p in range(len(per_lane[0]))]

    def jittered(self, seconds: float) -> float:
        return self.lanes[0].jittered(seconds)

    @property
    def retry_after(self) -> float:
        return self.lanes[0].retry_after

    @property
    def num_queued(self) -> int:
        return sum(adm.num_queued for adm in self.lanes)

    @property
    def num_queued_tokens(self) -> int:
        return sum(adm.num_queued_tokens for adm in self.lanes)


def build_admission(settings: ServerSettings, num_lanes: int, assigned: dict[str, int],
                    clock: Callable[[], float] = time.monotonic) -> LanedAdmission:  # fmt: skip
    """The server's admission over ``num_lanes`` engine cores, its bounds shared out over them."""
    engine = settings.engine
    return LanedAdmission([
        AdmissionController(
            -(-settings.max_queued_requests // num_lanes),
            -(-settings.max_queued_tokens // num_lanes),
            slo=settings.slo_targets,
            policy=engine.scheduling_policy,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_num_seqs=engine.max_num_seqs,
            max_queue_wait=settings.max_queue_wait,
            clock=clock,
        )
        for _ in range(num_lanes)
    ], assigned)  # fmt: skip


# what the rest of the API process holds: one engine core's client, or the lanes'
AnyClient: TypeAlias = EngineClient | LanedClient
# the one admission object, one engine core or N (state.py and serving.py still name it so; to go with them)
AnyAdmission: TypeAlias = LanedAdmission
