"""The disk KV tier inside the engine: hits equal cold runs, restarts hit, faults recompute, loads never block others."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sluice.engine.block_manager import BlockManager
from sluice.engine.core import EngineCore
from sluice.engine.kv_tiers import prefix_block_hashes
from sluice.engine.kv_tiers.fileformat import SUFFIX, LocalFiles, decode_header
from sluice.engine.protocol import EngineRequest, SamplingParams
from sluice.engine.request import Request
from sluice.server.admin import kv_report

PREFIX = 100  # tokens: 6 full blocks
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model: Path, disk: Path | None, **kw: object) -> EngineCore:
    args: dict[str, object] = dict(model=str(model), kv_cache_memory=1 << 20, max_num_batched_tokens=64)
    args.update(kw)
    return EngineCore(kv_disk_dir=str(disk) if disk else None, **args)  # type: ignore[arg-type]


def _run(engine: EngineCore, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[tuple[list[int], int]]:
    """(output tokens, cached prompt tokens) per prompt, all submitted at once."""
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=p, sampling=params))
    toks: dict[str, list[int]] = {rid: [] for rid in ids}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens
    engine.block_manager.check_invariants()
    return [(toks[r], cached[r]) for r in ids]


def _disk_stats(engine: EngineCore):  # type: ignore[no-untyped-def]
    (t,) = engine.make_stats().kv_tiers
    return t


class SlowFiles(LocalFiles):
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def read_at(self, path: str, offset: int, size: int) -> bytearray:
        if offset > 0:
            time.sleep(self.delay)
        return super().read_at(path, offset, size)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
def test_disk_hit_equals_memory_hit_equals_cold(tiny_llama: Path, tmp_path: Path, kv_dtype: str, backend: str) -> None:
    prompt = _tokens(PREFIX, 1) + [7, 8, 9]
    e = _engine(tiny_llama, tmp_path, kv_cache_dtype=kv_dtype, attention_backend=backend)
    (cold, c0), = _run(e, [prompt])
    (mem, c1), = _run(e, [prompt])
    e.close()
    e = _engine(tiny_llama, tmp_path, kv_cache_dtype=kv_dtype, attention_backend=backend)
    (disk, c2), = _run(e, [prompt])
    s = _disk_stats(e)
    e.close()
    assert (c0, c1, c2) == (0, 96, 96), "cold, then 6 blocks from memory, then 6 from disk"
    assert s.hit_blocks == 6 and s.num_loaded_blocks == 6 and s.num_load_failures == 0
    assert cold == mem == disk, f"outputs differ: cold {cold}, memory hit {mem}, disk hit {disk}"


def test_a_graceful_restart_hits_for_the_same_prompts(tiny_llama: Path, tmp_path: Path) -> None:
    shared = _tokens(64, 2)
    prompts = [shared + _tokens(40, 10 + i) for i in range(6)]
    e = _engine(tiny_llama, tmp_path)
    before = _run(e, prompts)
    e.close()
    e = _engine(tiny_llama, tmp_path)
    after = _run(e, prompts)
    rep = kv_report(e.make_stats())
    e.close()
    assert [t for t, _ in after] == [t for t, _ in before], "outputs changed across the restart"
    full = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert sum(c for _, c in after) / full >= 0.95, f"hit rate after restart {sum(c for _, c in after) / full:.2f}"
    assert rep["tiers"][1]["name"] == "disk" and rep["tiers"][1]["hit_tokens"] > 0


def test_kill_9_after_serving_keeps_the_written_blocks(tiny_llama: Path, tmp_path: Path) -> None:
    """Write-through: a process killed with no shutdown path still leaves its prefixes on disk."""
    prompts = [_tokens(PREFIX, 3) + [1, 2], _tokens(PREFIX, 4) + [3]]
    code = f"""
import json, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_kv_disk_engine import _engine, _run
from pathlib import Path
e = _engine(Path({str(tiny_llama)!r}), Path({str(tmp_path)!r}))
print(json.dumps([t for t, _ in _run(e, {prompts!r})]), flush=True)
e.kv_tiers.tier.flush(30)
print("written", flush=True)
time.sleep(600)
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        served = p.stdout.readline().strip()
        assert p.stdout.readline().strip() == "written"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    e = _engine(tiny_llama, tmp_path)
    after = _run(e, prompts)
    e.close()
    assert [t for t, _ in after] == json.loads(served), "same outputs after the kill"
    assert [c for _, c in after] == [96, 96], "the prefixes come from disk"


def test_corrupt_blocks_are_recomputed_not_loaded(tiny_llama: Path, tmp_path: Path) -> None:
    prompt = _tokens(PREFIX, 5) + [4, 5]
    e = _engine(tiny_llama, tmp_path)
    (cold, _), = _run(e, [prompt])
    e.close()
    fp = bytes.fromhex(next(tmp_path.glob("kv-*")).name[3:])
    target = prefix_block_hashes(prompt, 4)[3]  # the 4th block of the prefix
    for f in tmp_path.glob(f"*/*{SUFFIX}"):
        raw = bytearray(f.read_bytes())
        header = decode_header(bytes(raw), fp, e.runner.kv_cache.bytes_per_block)
        if target in header.hashes:
            raw[header.block_offset(header.hashes.index(target)) + 5] ^= 0xFF
            f.write_bytes(raw)
    e = _engine(tiny_llama, tmp_path)
    (again, cached), = _run(e, [prompt])
    s = _disk_stats(e)
    e.close()
    assert again == cold, "a corrupt block must never change the output"
    assert s.num_corrupt == 1 and s.num_load_failures == 1
    assert cached == 48, "blocks 0-2 arrived before the corrupt block 3 and are reused from memory"


def test_a_read_only_disk_tier_keeps_serving(tiny_llama: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")  # makedirs fails under a file: the tier turns off
    e = _engine(tiny_llama, blocker)
    out = _run(e, [_tokens(40, 6)])
    s = _disk_stats(e)
    e.close()
    assert len(out[0][0]) == 8 and not s.is_enabled


def test_32_requests_on_one_on_disk_prefix_read_it_once(tiny_llama: Path, tmp_path: Path) -> None:
    prefix = _tokens(PREFIX, 7)
    e = _engine(tiny_llama, tmp_path)
    _run(e, [prefix + [1]])
    e.close()
    e = _engine(tiny_llama, tmp_path, max_num_seqs=64, kv_cache_memory=4 << 20, max_num_batched_tokens=512)
    out = _run(e, [prefix + [i + 2, i + 3] for i in range(32)])
    s = _disk_stats(e)
    e.close()
    assert all(c == 96 for _, c in out), "every request takes the prefix"
    assert s.num_block_reads == 6 and s.hit_blocks == 6, f"{s.num_block_reads} block reads for a 6-block prefix"
    assert s.num_request_loads == 32, "each request waited for the one load"


def test_the_step_keeps_running_other_requests_while_one_loads(tiny_llama: Path, tmp_path: Path) -> None:
    prefix = _tokens(PREFIX, 8)
    e = _engine(tiny_llama, tmp_path)
    _run(e, [prefix + [1]])
    e.close()
    e = _engine(tiny_llama, tmp_path)
    assert e.kv_tiers is not None
    e.kv_tiers.tier.files = SlowFiles(0.05)  # type: ignore[attr-defined]  # 6 blocks ~ 0.3 s with 4 threads
    e.add_request(EngineRequest(request_id="busy", prompt_token_ids=_tokens(20, 9),
                                sampling=SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)))
    e.step()
    e.add_request(EngineRequest(request_id="loads", prompt_token_ids=prefix + [2], sampling=PARAMS))
    tokens_while_loading = 0
    while e.scheduler.loading or e.scheduler.waiting.peek() is not None:
        tokens_while_loading += sum(len(o.new_token_ids) for o in e.step() if o.request_id == "busy")
    assert tokens_while_loading >= 2, "the other request must keep decoding while the load runs"
    e.abort(["busy"])
    while e.has_unfinished_requests():
        e.step()
    e.close()


def test_aborting_a_loading_request_keeps_its_blocks_until_the_load_ends(tiny_llama: Path, tmp_path: Path) -> None:
    prefix = _tokens(PREFIX, 11)
    e = _engine(tiny_llama, tmp_path)
    (cold, _), = _run(e, [prefix + [1]])
    e.close()
    e = _engine(tiny_llama, tmp_path)
    assert e.kv_tiers is not None
    e.kv_tiers.tier.files = SlowFiles(0.05)  # type: ignore[attr-defined]
    e.add_request(EngineRequest(request_id="a", prompt_token_ids=prefix + [1], sampling=PARAMS))
    e.step()
    assert e.scheduler.loading, "the request should be waiting for its blocks"
    held = list(e.scheduler.loading[0].block_ids[:6])
    e.abort(["a"])
    e.step()
    bm = e.block_manager
    assert all(bm.ref_counts[b] == 1 for b in held), "the load still holds the blocks an I/O thread writes"
    while e.kv_tiers.has_loads():
        e.kv_tiers.wait_any(1.0)
        e.step()
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    (again, cached), = _run(e, [prefix + [1]])
    e.close()
    assert again == cold and cached == 96, "the finished load's blocks serve the next request from memory"


def test_checkpoint_writes_what_the_tier_lacks(tiny_llama: Path, tmp_path: Path) -> None:
    prompt = _tokens(PREFIX, 12) + [3]
    e = _engine(tiny_llama, tmp_path)
    e.block_manager.track_new_blocks = False  # as if every write-through store had been dropped
    (cold, _), = _run(e, [prompt])
    assert _disk_stats(e).num_blocks == 0
    rep = e.kv_checkpoint()
    assert rep["complete"] and rep["num_written_blocks"] == 6, rep
    assert e.kv_checkpoint()["num_written_blocks"] == 0, "a second checkpoint has nothing to write"
    e.close(checkpoint=False)
    e = _engine(tiny_llama, tmp_path)
    (again, cached), = _run(e, [prompt])
    e.close()
    assert again == cold and cached == 96


def test_another_kv_dtype_never_reads_these_files(tiny_llama: Path, tmp_path: Path) -> None:
    prompt = _tokens(PREFIX, 13) + [3]
    e = _engine(tiny_llama, tmp_path)
    _run(e, [prompt])
    e.close()
    e = _engine(tiny_llama, tmp_path, kv_cache_dtype="int8")
    (_, cached), = _run(e, [prompt])
    e.close()
    assert cached == 0, "an int8 engine must not load fp32 blocks"


def test_failed_loads_release_their_keys() -> None:
    bm = BlockManager(8, 16)
    req = Request("r", list(range(70)), SamplingParams(max_tokens=4))
    assert bm.allocate(req, 70)
    keys = bm.prefix_hashes(req, 3)
    loading = req.block_ids[:3]
    bm.hold_for_load(req, loading, keys)
    assert [bm.block_by_hash.get(k) for k in keys] == loading
    bm.free_request(req)  # aborted while loading: the load's reference keeps the blocks
    assert bm.num_free_blocks == 8 - 3
    bm.release_load(loading, 1)  # only the first block arrived
    bm.check_invariants()
    assert keys[0] in bm.block_by_hash and keys[1] not in bm.block_by_hash and keys[2] not in bm.block_by_hash
    assert bm.num_free_blocks == 8
