"""KV tiers: stable keys, bit-exact round trips, corruption, faults, LRU cap, restart, concurrency.

Disk and host tiers share the interface; the generic tests run on both (the
host tier stands in for the second pool a GPU server keeps in host memory).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from sluice.engine.kv_tiers import (
    DiskKVTier,
    HostKVTier,
    KVTier,
    kv_fingerprint,
    prefix_block_hashes,
)
from sluice.engine.kv_tiers.fileformat import SUFFIX, LocalFiles, decode_header
from sluice.engine.kv_tiers.keys import hash_block_tokens

BB = 4096 + 64  # payload bytes per block (not a multiple of the 4 KiB alignment on purpose)
FP = kv_fingerprint(model="test", kv_dtype="fp8", block_size=16)
FP_OTHER = kv_fingerprint(model="test", kv_dtype="int8", block_size=16)


def _hashes(n: int, seed: int = 0) -> list[int]:
    return prefix_block_hashes([seed * 100_000 + i for i in range(16 * n)], n)


def _payloads(hashes: list[int], nbytes: int = BB) -> torch.Tensor:
    """Deterministic content per hash, so any block can be checked by its key alone."""
    rows = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(h % (1 << 62)))
            for h in hashes]
    return torch.stack(rows) if rows else torch.empty((0, nbytes), dtype=torch.uint8)


class Collect:
    """A sink that records what arrived (stands in for copying into KV blocks)."""

    def __init__(self) -> None:
        self.got: dict[int, bytes] = {}
        self.lock = threading.Lock()

    def __call__(self, i: int, payload: memoryview) -> None:
        with self.lock:
            self.got[i] = bytes(payload)


def _load(tier: KVTier, hashes: list[int], timeout: float = 10.0) -> tuple[int, Collect]:
    sink = Collect()
    h = tier.load(hashes, sink)
    assert h.wait(timeout), "a load never finished"
    return h.num_loaded, sink


class SlowFiles(LocalFiles):
    """Block reads (not header reads) take ``delay`` seconds; counts them."""

    def __init__(self, delay: float) -> None:
        self.delay, self.reads = delay, 0

    def read_at(self, path: str, offset: int, size: int) -> bytearray:
        if offset > 0:
            self.reads += 1
            time.sleep(self.delay)
        return super().read_at(path, offset, size)


class FaultyFiles(LocalFiles):
    """Raise ``OSError(code)`` from the chosen operation."""

    def __init__(self, op: str, code: int) -> None:
        self.op, self.code = op, code

    def _fail(self, op: str) -> None:
        if op == self.op:
            raise OSError(self.code, os.strerror(self.code))

    def probe_writable(self, directory: str) -> None:
        self._fail("probe")
        super().probe_writable(directory)

    def write_atomic(self, directory: str, name: str, chunks: list) -> int:  # type: ignore[override]
        self._fail("write")
        return super().write_atomic(directory, name, chunks)

    def read_at(self, path: str, offset: int, size: int) -> bytearray:
        if offset > 0:
            self._fail("read")
        return super().read_at(path, offset, size)


@pytest.fixture
def tiers() -> Iterator[list[KVTier]]:
    made: list[KVTier] = []
    yield made
    for t in made:
        t.close(flush=False)


def _disk(tiers: list[KVTier], root: Path, cap: int = 1 << 30, fp: bytes = FP, **kw: object) -> DiskKVTier:
    t = DiskKVTier(root, fp, BB, cap, **kw)  # type: ignore[arg-type]
    tiers.append(t)
    return t


def _host(tiers: list[KVTier], cap: int = 1 << 30, **kw: object) -> HostKVTier:
    t = HostKVTier(BB, cap, **kw)  # type: ignore[arg-type]
    tiers.append(t)
    return t


@pytest.fixture(params=["disk", "host"])
def make_tier(request: pytest.FixtureRequest, tiers: list[KVTier], tmp_path: Path) -> Callable[..., KVTier]:
    if request.param == "disk":
        return lambda **kw: _disk(tiers, tmp_path, **kw)
    return lambda **kw: _host(tiers, **kw)


def _group_files(t: DiskKVTier) -> list[Path]:
    return sorted(Path(t.directory).glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime_ns)


# ---------------------------------------------------------------- keys


def test_block_hashes_are_the_same_in_every_process() -> None:
    code = "from sluice.engine.kv_tiers import prefix_block_hashes as p; print(p(list(range(64)), 4))"
    outs = {subprocess.check_output([sys.executable, "-c", code], text=True).strip() for _ in range(2)}
    assert outs == {str(prefix_block_hashes(list(range(64)), 4))}, "a restart would never hit the disk tier"


def test_block_hashes_chain_and_separate_adapters() -> None:
    a, b = _hashes(3), prefix_block_hashes([0, *range(1, 16)] + [7] * 32, 3)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2], "a block's key depends on everything before it"
    assert hash_block_tokens(None, range(16), b"lora-a") != hash_block_tokens(None, range(16)), \
        "an adapter's blocks must not be served to the base model"


def test_fingerprint_changes_with_every_field() -> None:
    base = dict(model="m", kv_dtype="fp8", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
    fps = {kv_fingerprint(**base)} | {kv_fingerprint(**{**base, k: "x"}) for k in base}
    assert len(fps) == len(base) + 1
    assert kv_fingerprint(**base) == kv_fingerprint(**dict(reversed(base.items())))


# ---------------------------------------------------------------- both tiers


def test_round_trip_is_bit_exact(make_tier: Callable[..., KVTier]) -> None:
    t = make_tier()
    hs = _hashes(40)
    assert t.store(hs, _payloads(hs))
    assert t.flush(10)
    assert t.count_prefix(hs) == 40
    n, sink = _load(t, hs)
    assert n == 40
    for i, h in enumerate(hs):
        assert sink.got[i] == _payloads([h]).numpy().tobytes(), f"block {i} changed on its way through the tier"
    s = t.make_stats()
    assert (s.num_blocks, s.num_stored_blocks, s.num_loaded_blocks, s.num_loads) == (40, 40, 40, 1)
    assert s.load_bytes == 40 * BB and s.load_seconds > 0


def test_count_prefix_stops_at_the_first_missing_block(make_tier: Callable[..., KVTier]) -> None:
    t = make_tier()
    hs = _hashes(6)
    t.store(hs[:3] + hs[4:], _payloads(hs[:3] + hs[4:]))
    t.flush(10)
    assert t.count_prefix(hs) == 3
    assert t.count_prefix(_hashes(2, seed=9)) == 0


def test_a_missing_block_ends_the_load_at_that_block(make_tier: Callable[..., KVTier]) -> None:
    t = make_tier()
    hs = _hashes(5)
    t.store(hs[:2], _payloads(hs[:2]))
    t.flush(10)
    n, sink = _load(t, hs)
    assert n == 2 and 2 not in sink.got
    assert t.make_stats().num_failed_blocks == 3


def test_storing_the_same_blocks_twice_keeps_one_copy(make_tier: Callable[..., KVTier]) -> None:
    t = make_tier()
    hs = _hashes(4)
    t.store(hs, _payloads(hs))
    t.store(hs, _payloads(hs))
    t.flush(10)
    s = t.make_stats()
    assert (s.num_blocks, s.num_stored_blocks) == (4, 4)


def test_a_store_beyond_the_pending_limit_is_dropped_not_blocked(make_tier: Callable[..., KVTier]) -> None:
    t = make_tier(max_pending_bytes=3 * BB)
    hs = _hashes(8)
    t0 = time.monotonic()
    accepted = [t.store(hs[i : i + 2], _payloads(hs[i : i + 2])) for i in range(0, 8, 2)]
    assert not t.store(_hashes(4, seed=1), _payloads(_hashes(4, seed=1))), "4 blocks never fit a 3-block queue"
    assert time.monotonic() - t0 < 1.0, "store() must never wait for the writer"
    t.flush(10)
    s = t.make_stats()
    assert s.num_dropped_blocks >= 4 and s.num_stored_blocks == 2 * sum(accepted)


def test_a_cancelled_load_finishes_and_delivers_nothing_more(tiers: list[KVTier], tmp_path: Path) -> None:
    files = SlowFiles(0.05)
    t = _disk(tiers, tmp_path, files=files, num_load_threads=1)
    hs = _hashes(20)
    t.store(hs, _payloads(hs))
    t.flush(10)
    sink = Collect()
    h = t.load(hs, sink)
    time.sleep(0.08)
    h.cancel()
    assert h.wait(2.0), "a cancelled load must still complete"
    assert len(sink.got) < 5 and h.num_loaded < 5


def test_a_failing_sink_fails_only_its_own_load(make_tier: Callable[..., KVTier]) -> None:
    t = make_tier()
    hs = _hashes(3)
    t.store(hs, _payloads(hs))
    t.flush(10)

    def bad(i: int, payload: memoryview) -> None:
        raise RuntimeError("no such block")

    h = t.load(hs, bad)
    assert h.wait(5) and h.num_loaded == 0
    assert _load(t, hs)[0] == 3


# ---------------------------------------------------------------- disk: restart, corruption, faults


def test_restart_rebuilds_the_index_from_the_directory(tiers: list[KVTier], tmp_path: Path) -> None:
    hs = _hashes(70)
    t = _disk(tiers, tmp_path, group_blocks=16)
    t.store(hs, _payloads(hs))
    t.close()
    assert len(_group_files(t)) == 5, "70 blocks in groups of 16"
    t2 = _disk(tiers, tmp_path)
    assert t2.count_prefix(hs) == 70
    n, sink = _load(t2, hs)
    assert n == 70 and sink.got[69] == _payloads([hs[69]]).numpy().tobytes()


def _one_group(tiers: list[KVTier], root: Path, n: int = 3) -> tuple[list[int], Path]:
    hs = _hashes(n)
    t = _disk(tiers, root)
    t.store(hs, _payloads(hs))
    t.close()
    (f,) = _group_files(t)
    return hs, f


def test_a_truncated_file_is_removed_at_start_up(tiers: list[KVTier], tmp_path: Path) -> None:
    hs, f = _one_group(tiers, tmp_path)
    os.truncate(f, f.stat().st_size - 100)
    t = _disk(tiers, tmp_path)
    assert t.count_prefix(hs) == 0 and not f.exists()
    assert t.make_stats().num_corrupt == 1


def test_a_bit_flip_in_the_header_is_removed_at_start_up(tiers: list[KVTier], tmp_path: Path) -> None:
    hs, f = _one_group(tiers, tmp_path)
    raw = bytearray(f.read_bytes())
    raw[60] ^= 0x10  # inside the first entry's hash
    f.write_bytes(raw)
    t = _disk(tiers, tmp_path)
    assert t.count_prefix(hs) == 0 and not f.exists()


def test_a_bit_flip_in_a_block_is_never_delivered(tiers: list[KVTier], tmp_path: Path) -> None:
    hs, f = _one_group(tiers, tmp_path)
    raw = bytearray(f.read_bytes())
    header = decode_header(bytes(raw), FP, BB)
    raw[header.block_offset(1) + 1234] ^= 0x01
    f.write_bytes(raw)
    t = _disk(tiers, tmp_path, num_load_threads=1)
    assert t.count_prefix(hs) == 3, "payloads are checked when read, not at start-up"
    n, sink = _load(t, hs)
    assert n == 1 and 1 not in sink.got, "a corrupt block reached the KV cache"
    assert not f.exists() and t.count_prefix(hs) == 0
    assert t.make_stats().num_corrupt == 1


def test_a_file_of_another_model_or_dtype_is_never_loaded(tiers: list[KVTier], tmp_path: Path) -> None:
    hs = _hashes(3)
    other = _disk(tiers, tmp_path, fp=FP_OTHER)
    other.store(hs, _payloads(hs))
    other.close()
    (foreign,) = _group_files(other)
    t = _disk(tiers, tmp_path)
    assert t.count_prefix(hs) == 0, "another fingerprint's directory must not be read"
    assert foreign.exists(), "another fingerprint's files belong to another configuration"
    planted = Path(t.directory) / foreign.name
    planted.write_bytes(foreign.read_bytes())
    t.close()
    t2 = _disk(tiers, tmp_path)
    assert t2.count_prefix(hs) == 0 and not planted.exists()


def test_stale_temporary_files_are_removed_and_never_indexed(tiers: list[KVTier], tmp_path: Path) -> None:
    hs, f = _one_group(tiers, tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tmp = f.parent / f".{f.name}.{dead.pid}.tmp"
    tmp.write_bytes(f.read_bytes()[:5000])
    t = _disk(tiers, tmp_path)
    assert not tmp.exists() and t.count_prefix(hs) == 3


def test_kill_9_during_writes_leaves_nothing_that_loads_wrong(tiers: list[KVTier], tmp_path: Path) -> None:
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_kv_tiers import _hashes, _payloads, FP, BB
from sluice.engine.kv_tiers import DiskKVTier
t = DiskKVTier({str(tmp_path)!r}, FP, BB, 1 << 30, group_blocks=4)
print("ready", flush=True)
seed = 0
while True:
    hs = _hashes(4, seed=seed)
    t.store(hs, _payloads(hs))
    seed += 1
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    time.sleep(0.6)
    p.send_signal(signal.SIGKILL)
    p.wait()
    t = _disk(tiers, tmp_path)
    groups = list(t._groups.values())
    assert groups, "the writer should have finished some files before the kill"
    hs = [h for g in groups for h in g.header.hashes]
    sink = Collect()
    handle = t.load(hs, sink)
    assert handle.wait(30) and handle.num_loaded == len(hs)
    for i, h in enumerate(hs):
        assert sink.got[i] == _payloads([h]).numpy().tobytes(), "a block loaded with the wrong content"


def test_a_read_only_directory_turns_the_tier_off(tiers: list[KVTier], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    t = _disk(tiers, tmp_path, files=FaultyFiles("probe", errno.EROFS))
    hs = _hashes(2)
    assert not t.is_enabled and "disabled" in caplog.text
    assert not t.store(hs, _payloads(hs))
    assert t.count_prefix(hs) == 0
    assert _load(t, hs)[0] == 0


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_a_directory_without_write_permission_turns_the_tier_off(tiers: list[KVTier], tmp_path: Path) -> None:
    root = tmp_path / "ro"
    (root / f"kv-{FP.hex()}").mkdir(parents=True)
    (root / f"kv-{FP.hex()}").chmod(0o500)
    try:
        assert not _disk(tiers, root).is_enabled
    finally:
        (root / f"kv-{FP.hex()}").chmod(0o700)


def test_a_full_disk_stops_writes_but_keeps_serving_reads(tiers: list[KVTier], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hs, _ = _one_group(tiers, tmp_path)
    t = _disk(tiers, tmp_path, files=FaultyFiles("write", errno.ENOSPC))
    more = _hashes(2, seed=5)
    t.store(more, _payloads(more))
    t.flush(10)
    s = t.make_stats()
    assert s.is_enabled and not s.is_writable and "full" in caplog.text
    assert not t.store(more, _payloads(more)), "no more writes after the disk filled"
    assert _load(t, hs)[0] == 3, "what is on disk is still served"


def test_a_failing_disk_turns_the_tier_off(tiers: list[KVTier], tmp_path: Path) -> None:
    hs, _ = _one_group(tiers, tmp_path)
    t = _disk(tiers, tmp_path, files=FaultyFiles("read", errno.EIO))
    assert _load(t, hs)[0] == 0
    assert not t.is_enabled and t.count_prefix(hs) == 0


def test_the_size_cap_evicts_least_recently_used_groups(tiers: list[KVTier], tmp_path: Path) -> None:
    probe = _disk(tiers, tmp_path / "probe", group_blocks=2)
    probe.store(_hashes(2, seed=99), _payloads(_hashes(2, seed=99)))
    probe.flush(10)
    group_size = probe.make_stats().num_bytes
    t = _disk(tiers, tmp_path, cap=3 * group_size, group_blocks=2)
    groups = [_hashes(2, seed=s) for s in range(3)]
    for hs in groups:
        t.store(hs, _payloads(hs))
        t.flush(10)
        time.sleep(0.01)
    assert _load(t, groups[0])[0] == 2  # touch the oldest: now the newest
    newcomer = _hashes(2, seed=3)
    t.store(newcomer, _payloads(newcomer))
    t.flush(10)
    s = t.make_stats()
    assert s.num_bytes <= 3 * group_size and s.num_evicted_blocks == 2
    assert t.count_prefix(groups[1]) == 0, "the least recently used group goes first"
    assert t.count_prefix(groups[0]) == 2 and t.count_prefix(newcomer) == 2
    t.close()
    t2 = _disk(tiers, tmp_path, cap=2 * group_size)
    assert t2.make_stats().num_bytes <= 2 * group_size, "a smaller cap at start-up evicts at once"
    assert t2.count_prefix(newcomer) == 2, "after a restart the LRU order comes from the files' mtimes"


def test_host_tier_evicts_least_recently_used_blocks(tiers: list[KVTier]) -> None:
    t = _host(tiers, cap=4 * BB)
    hs = _hashes(4)
    t.store(hs, _payloads(hs))
    t.flush(10)
    assert _load(t, hs[:1])[0] == 1
    more = _hashes(2, seed=1)
    t.store(more, _payloads(more))
    t.flush(10)
    assert t.make_stats().num_blocks == 4
    assert t.count_prefix(hs[:1]) == 1 and t.count_prefix(hs[1:2]) == 0


# ---------------------------------------------------------------- concurrency


def test_a_small_load_does_not_wait_behind_a_large_one(tiers: list[KVTier], tmp_path: Path) -> None:
    delay = 0.03
    t = _disk(tiers, tmp_path, files=SlowFiles(delay), num_load_threads=2)
    big, small = _hashes(24), _hashes(2, seed=1)
    t.store(big + small, _payloads(big + small))
    t.flush(10)
    hb = t.load(big, Collect())
    time.sleep(0.005)
    hs = t.load(small, Collect())
    assert hs.wait(10) and hb.wait(10)
    assert hs.num_loaded == 2 and hb.num_loaded == 24
    assert hs.latency is not None and hb.latency is not None
    assert hs.latency < 0.5 * hb.latency, (
        f"the 2-block load took {hs.latency:.3f}s next to a 24-block load of {hb.latency:.3f}s: a convoy"
    )


def test_concurrent_loads_run_in_parallel(tiers: list[KVTier], tmp_path: Path) -> None:
    delay = 0.05
    t = _disk(tiers, tmp_path, files=SlowFiles(delay), num_load_threads=4)
    groups = [_hashes(3, seed=s) for s in range(4)]
    for hs in groups:
        t.store(hs, _payloads(hs))
    t.flush(10)
    t0 = time.monotonic()
    handles = [t.load(hs, Collect()) for hs in groups]
    assert all(h.wait(10) for h in handles)
    wall = time.monotonic() - t0
    serial = 12 * delay
    assert wall < 0.6 * serial, f"4 loads of 3 blocks took {wall:.3f}s; one after another would be {serial:.3f}s"


def test_32_loads_of_one_prefix_read_it_once(tiers: list[KVTier], tmp_path: Path) -> None:
    delay = 0.05
    files = SlowFiles(delay)
    t = _disk(tiers, tmp_path, files=files, num_load_threads=4)
    hs = _hashes(8)
    t.store(hs, _payloads(hs))
    t.flush(10)
    sinks = [Collect() for _ in range(32)]
    handles = [t.load(hs, s) for s in sinks]
    assert all(h.wait(10) for h in handles)
    assert all(h.num_loaded == 8 for h in handles)
    assert all(s.got == sinks[0].got for s in sinks)
    assert files.reads == 8 and t.make_stats().num_block_reads == 8, f"read {files.reads} blocks for 8 shared ones"
    assert max(h.latency or 0 for h in handles) < 8 * delay * 2, "the 32 loads must not take turns reading"
