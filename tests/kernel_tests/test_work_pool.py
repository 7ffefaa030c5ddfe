"""The kernels' work pool (NOTE(work-pool) in sluice/kernels/csrc/work_pool.h): every index of a loop runs
exactly once on any thread count, a failing chunk raises, nested loops and forked children work, and the
engine puts a quantized model's kernels on it with the same tokens as on torch's OpenMP threads."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from sluice.engine.config import EngineConfig
from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineRequest, SamplingParams
from sluice.kernels import ext

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from gguf_factory import write_tiny_gguf  # noqa: E402

MODULES = ["quant", "attention", "lora"]


@pytest.fixture
def restore_pool() -> Iterator[None]:
    threads, pool = torch.get_num_threads(), ext.work_pool_threads()
    yield
    ext.set_work_pool(pool)
    torch.set_num_threads(threads)


def _load(name: str) -> ModuleType:
    try:
        return ext.load(name)
    except ext.KernelUnavailableError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("threads", [0, 1, 2, 3])
def test_every_index_runs_exactly_once(restore_pool: None, name: str, threads: int) -> None:
    mod = _load(name)
    ext.set_work_pool(threads)
    assert mod.pool_threads() == threads
    for n in (1, 2, 7, 64, 1000, 100_003):
        for grain in (1, 3, 64, 10**6):
            visits, ran = mod.pool_probe(n, grain)
            assert visits.shape == (n,) and bool((visits == 1).all()), (n, grain, int(visits.min()), int(visits.max()))
            assert 1 <= ran <= max(threads, torch.get_num_threads(), 1), (n, grain, ran)


def test_the_workers_take_chunks(restore_pool: None) -> None:
    mod = _load("quant")
    ext.set_work_pool(2)
    # a loop of 8 chunks of ~1 ms each: the worker (spinning, or woken in microseconds) takes some of
    # them in at least one of 20 tries; a pool whose workers never ran would leave them all to the caller
    assert any(mod.pool_probe(2_000_000, 1)[1] == 2 for _ in range(20))


def test_active_threads_limit_a_loop_and_keep_the_workers(restore_pool: None) -> None:
    """NOTE(lane-lend): an engine lends its extra cores with set_work_pool_active, and takes them back."""
    mod = _load("quant")
    ext.set_work_pool(2)
    try:
        ext.set_work_pool_active(1)
        assert mod.pool_active() == 1 and mod.pool_threads() == 2
        for _ in range(20):  # the loop of the test above: only the caller runs it now
            visits, ran = mod.pool_probe(2_000_000, 1)
            assert ran == 1 and bool((visits == 1).all())
        ext.set_work_pool_active(0)  # all of them again: the worker takes chunks
        assert any(mod.pool_probe(2_000_000, 1)[1] == 2 for _ in range(20))
        with pytest.raises(ValueError):
            ext.set_work_pool_active(-1)
    finally:
        ext.set_work_pool_active(0)


def test_the_pool_counts_the_waits_for_a_chunk_a_worker_holds(restore_pool: None) -> None:
    """NOTE(pool-waits): a worker that holds a chunk for 30 ms (it sleeps, as if the OS had taken its core)
    makes the caller wait at the loop's end: one stall; loops on one thread wait for nobody."""
    mod = _load("quant")
    ext.set_work_pool(1)
    before = ext.work_pool_waits()
    assert bool((mod.pool_probe(64, 1, hold_us=30_000)[0] == 1).all())
    assert ext.work_pool_waits() == before  # no worker: nothing to wait for
    ext.set_work_pool(2)
    seen = False
    for _ in range(50):  # until the worker takes a chunk while the caller waits (a busy moment may prevent either)
        before = ext.work_pool_waits()
        # 8 chunks of ~1-2 ms: the worker, woken (at nice 19: later when another process is busy), takes one
        # while the caller runs the others, which takes less than the 30 ms the worker then holds it
        visits, ran = mod.pool_probe(2_000_000, 1, hold_us=30_000)
        after = ext.work_pool_waits()
        assert bool((visits == 1).all())
        waits, stalls = after.waits - before.waits, after.stalls - before.stalls
        assert 0 <= stalls <= waits <= 1, (before, after)  # one loop: one wait at most
        if ran == 2 and stalls == 1:
            stall = after.stall_seconds - before.stall_seconds
            assert 0.005 <= stall <= after.wait_seconds - before.wait_seconds + 1e-9, (before, after)
            seen = True
            break
    if not seen:
        pytest.skip("the pool's worker never held a chunk while the caller waited, in 50 loops")


def test_a_failing_chunk_raises_and_the_pool_goes_on(restore_pool: None) -> None:
    mod = _load("quant")
    ext.set_work_pool(2)
    for fail_at in (0, 499_999, 999_999):
        with pytest.raises(RuntimeError, match=f"failing at {fail_at}"):
            mod.pool_probe(1_000_000, 1, fail_at)
    visits, _ = mod.pool_probe(1_000_000, 1)
    assert bool((visits == 1).all())


def test_a_loop_nested_in_a_chunk_runs_on_its_thread(restore_pool: None) -> None:
    mod = _load("quant")
    ext.set_work_pool(2)
    visits, _ = mod.pool_probe(4096, 1, -1, True)  # each index runs a 64-index loop inside a chunk
    assert bool((visits == 1).all())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_loops(restore_pool: None) -> None:
    mod = _load("quant")
    ext.set_work_pool(2)
    mod.pool_probe(1_000_000, 1)  # the parent's workers exist (and none of them is forked)
    pid = os.fork()
    if pid == 0:  # the child: its pool starts workers of its own (n below torch's own parallel grain:
        # torch's OpenMP is not usable in a forked child)
        ok = all(bool((mod.pool_probe(20_000, 1)[0] == 1).all()) for _ in range(3))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _greedy(model: str, **kw: object) -> tuple[list[int], EngineCore]:
    eng = EngineCore(EngineConfig(model=model, kv_cache_memory=4 << 20, **kw))  # type: ignore[arg-type]
    for i, n in enumerate((5, 40, 130)):  # a few rows, a chunked prefill, several blocks of context
        eng.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=[(7 * i + j) % 200 + 3 for j in range(n)],
                                      sampling=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))  # fmt: skip
    toks: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [t for rid in sorted(toks) for t in toks[rid]], eng


def test_the_engine_runs_a_quantized_model_on_the_pool_with_the_same_tokens(
    restore_pool: None, tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(write_tiny_gguf(tiny_llama_dir, tmp_path / "tiny-q4_1.gguf", "Q4_1", "Q8_0"))
    pooled, eng = _greedy(path, num_threads=2)
    assert eng.runner.work_pool_threads == 2 and ext.work_pool_threads() == 2
    assert torch.get_num_threads() == 1, "torch's own ops keep one thread beside the pool"
    stats, pool = eng.make_stats(), ext.work_pool_waits()  # NOTE(pool-waits): the engine reports the pool's
    assert (stats.pool_wait_seconds, stats.pool_stalls, stats.pool_stall_seconds) == (
        pool.wait_seconds, pool.stalls, pool.stall_seconds)  # fmt: skip
    monkeypatch.setenv("SLUICE_WORK_POOL", "0")
    omp, eng = _greedy(path, num_threads=2)
    assert eng.runner.work_pool_threads == 0 and ext.work_pool_threads() == 0
    assert eng.make_stats().pool_wait_seconds == 0.0, "no pool, no waits"
    assert torch.get_num_threads() == 2
    assert pooled == omp, "the kernels compute the same bits on either threads"
    monkeypatch.delenv("SLUICE_WORK_POOL")
    single, eng = _greedy(path, num_threads=1)
    assert eng.runner.work_pool_threads == 0 and single == pooled


def test_a_float32_model_runs_on_the_pool_and_blas_keeps_torchs_threads(
    restore_pool: None, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE(float-kernel): a float32 model's linears run sluice's float kernel, so on the pool; with
    ``SLUICE_FLOAT_KERNEL=blas`` they stay BLAS matrices on torch's threads; the same tokens (the fixed
    order and BLAS round differently, but not by a greedy token here)."""
    kernel, eng = _greedy(str(tiny_llama_dir), num_threads=2, dtype="float32")
    assert eng.runner.invariant_floats and eng.runner.work_pool_threads == 2 and ext.work_pool_threads() == 2
    monkeypatch.setenv("SLUICE_FLOAT_KERNEL", "blas")
    blas, eng = _greedy(str(tiny_llama_dir), num_threads=2, dtype="float32")
    assert not eng.runner.invariant_floats and eng.runner.work_pool_threads == 0 and ext.work_pool_threads() == 0
    assert torch.get_num_threads() == 2
    assert kernel == blas
    monkeypatch.setenv("SLUICE_FLOAT_KERNEL", "openblas")
    with pytest.raises(ValueError, match="SLUICE_FLOAT_KERNEL='openblas': use kernel"):
        _greedy(str(tiny_llama_dir), num_threads=2, dtype="float32")


def test_engines_in_one_process_each_run_on_their_own_threads(
    restore_pool: None, tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE(engine-threads): a float model built before a quantized one got torch's one thread from the
    second (its BLAS ran single-threaded); each runner now puts its own settings back for its step."""
    path = str(write_tiny_gguf(tiny_llama_dir, tmp_path / "tiny-q4_1.gguf", "Q4_1", "Q8_0"))
    monkeypatch.setenv("SLUICE_FLOAT_KERNEL", "blas")  # a float model on BLAS (NOTE(float-kernel))
    dense_toks, dense = _greedy(str(tiny_llama_dir), num_threads=2, dtype="float32")
    monkeypatch.delenv("SLUICE_FLOAT_KERNEL")
    quant_toks, quant = _greedy(path, num_threads=2)
    assert (torch.get_num_threads(), ext.work_pool_threads()) == (1, 2), "the last built set the process"
    seen: list[tuple[int, int]] = []
    forward = dense.runner.model.forward

    def spy(*a: object, **kw: object) -> object:
        seen.append((torch.get_num_threads(), ext.work_pool_threads()))
        return forward(*a, **kw)

    dense.runner.model.forward = spy  # type: ignore[method-assign]
    dense.add_request(EngineRequest(request_id="again", prompt_token_ids=[5, 6, 7],
                                    sampling=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))  # fmt: skip
    while dense.has_unfinished_requests():
        dense.step()
    assert seen and set(seen) == {(2, 0)}, "the float model's steps ran on torch's two threads, no pool"
    quant.add_request(EngineRequest(request_id="q", prompt_token_ids=[5, 6, 7],
                                    sampling=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))  # fmt: skip
    while quant.has_unfinished_requests():
        quant.step()
    assert (torch.get_num_threads(), ext.work_pool_threads()) == (1, 2), "and the quantized one's on the pool"
