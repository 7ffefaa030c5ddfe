"""Sliding layers interleaved with global ones keep a KV pool of their own and free it as the window moves
(NOTE(hybrid-blocks) in sluice/engine/hybrid_blocks.py).

A tiny random Qwen2 with one global layer and two sliding ones (window 32 = two blocks) generates past
several windows: its sliding table frees the blocks out of the window while the global table keeps
every block, both pools' books stay exact every step, the greedy tokens are transformers', and nothing
leaks after a finish, an abort or a preemption.  Prefix hits span both pools; a draft model drafts beside
a hybrid target; a KV disk tier keeps one pool.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_factory import make_tiny_model_dir

from sluice.engine.block_manager import FREED_BLOCK
from sluice.engine.core import EngineCore
from sluice.engine.hybrid_blocks import HybridBlockManager, PrefixHit
from sluice.engine.protocol import EngineRequest, SamplingParams
from sluice.engine.request import Request
from tests.engine.test_sliding_window_blocks import hf_greedy, prompts

BS = 16
WINDOW = 32
LAYER_BLOCK_BYTES = 2 * BS * 2 * 16 * 4  # K and V of one layer's block: 2 KV heads of 16, fp32


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Qwen2 slides from layer max_window_layers on: layer 0 global, layers 1 and 2 sliding
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-hybrid"), "qwen2", seed=3, num_hidden_layers=3,
                               use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)  # fmt: skip


def make_engine(model_dir: Path, one_pool_blocks: int = 64, **kw: object) -> EngineCore:
    """An engine whose KV budget would hold ``one_pool_blocks`` blocks of all three layers in one pool."""
    opts: dict[str, object] = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=4, num_threads=1,
                                   kv_cache_memory=one_pool_blocks * 3 * LAYER_BLOCK_BYTES)  # fmt: skip
    return EngineCore(model=str(model_dir), **{**opts, **kw})


def check_blocks(engine: EngineCore) -> None:
    """Both pools' books are exact; a running request's sliding table holds just the blocks its window
    reads, its global table every block."""
    sch, bm = engine.scheduler, engine.block_manager
    assert isinstance(bm, HybridBlockManager)
    bm.check_invariants(sch.requests.values())
    for req in sch.running:
        freed = max(0, req.num_computed_tokens - WINDOW + 1) // BS
        win = req.window_block_ids
        assert win[:freed] == [FREED_BLOCK] * freed, f"{req}: a sliding block wholly out of the window is still held"
        assert FREED_BLOCK not in win[freed:], f"{req}: a sliding block the window still reads was freed"
        assert FREED_BLOCK not in req.block_ids, f"{req}: the global layers' blocks must all stay"


def run(engine: EngineCore, reqs: list[tuple[str, list[int], int]], abort_at: dict[str, int] | None = None) -> dict[str, list[int]]:
    for rid, p, n in reqs:
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=p,
                                         sampling=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))  # fmt: skip
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if abort_at and len(out[o.request_id]) == abort_at.get(o.request_id):
                engine.abort([o.request_id])
        check_blocks(engine)
    bm = engine.block_manager
    assert isinstance(bm, HybridBlockManager)
    assert bm.full.num_free_blocks == bm.full.num_blocks and bm.win.num_free_blocks == bm.win.num_blocks, "leak"
    bm.check_invariants([])
    return out


def test_the_sliding_pool_frees_as_the_window_moves_and_tokens_match_transformers(tiny_hybrid: Path) -> None:
    engine = make_engine(tiny_hybrid)
    assert engine.runner.window_layers == [1, 2] and engine.scheduler.sliding_window == WINDOW
    bm = engine.block_manager
    assert isinstance(bm, HybridBlockManager)
    # the budget of 64 three-layer blocks: the sliding pool takes what 4 windows and one step need, the
    # global pool (one layer a block) the rest, so it holds more blocks than one pool would
    assert bm.win.num_blocks == 4 * (WINDOW // BS + 2) + 32 // BS
    assert bm.full.num_blocks == (64 * 3 - 2 * bm.win.num_blocks) > 64
    assert engine.runner.kv_cache.num_bytes <= 64 * 3 * LAYER_BLOCK_BYTES
    ps = prompts(5, 40, 70)  # 70 > the 32-token budget: a chunked prefill
    for i, p in enumerate(ps):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p,
                                         sampling=SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)))  # fmt: skip
    got: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    most_win = most_full = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        check_blocks(engine)
        most_win = max(most_win, bm.win.num_used_blocks)
        most_full = max(most_full, bm.full.num_used_blocks)
    # each request's sliding table ends holding the blocks of its last 31 tokens (at most 3); its global
    # table holds all of them: ceil(125/16) + ceil(160/16) + ceil(190/16) = 30 at the end
    assert most_win <= 3 * 3, f"at most a window's sliding blocks per request: {most_win} held at once"
    assert most_full >= 25, f"the global layers keep every block: {most_full}"
    for i, p in enumerate(ps):
        assert got[str(i)] == hf_greedy(tiny_hybrid, p, 120), f"prompt {i}: greedy tokens differ from transformers"
    run(engine, [])  # the books after the last request ended


def test_preempted_and_aborted_requests_leak_nothing_from_either_pool(tiny_hybrid: Path) -> None:
    # a budget of 8 three-layer blocks: 8 sliding blocks and 8 global ones (one layer each); two requests of
    # 80 tokens need 5 global blocks each, so the newer one is preempted and recomputes to the same tokens
    engine = make_engine(tiny_hybrid, one_pool_blocks=8, max_num_batched_tokens=64)
    bm = engine.block_manager
    assert isinstance(bm, HybridBlockManager) and (bm.full.num_blocks, bm.win.num_blocks) == (8, 8)
    a, b = prompts(40, 40, seed=11)
    out = run(engine, [("a", a, 40), ("b", b, 40)])
    assert engine.scheduler.num_preemptions > 0, "the test must preempt a request"
    assert out["a"] == hf_greedy(tiny_hybrid, a, 40)
    assert out["b"] == hf_greedy(tiny_hybrid, b, 40), "a preempted request recomputes to the same tokens"
    engine = make_engine(tiny_hybrid)
    out = run(engine, [("a", a, 100), ("b", b, 100)], abort_at={"a": 60})
    assert len(out["a"]) == 60 and len(out["b"]) == 100, "aborted after its sliding blocks slid out of the window"


def test_a_prefix_hit_needs_the_window_blocks_of_its_last_query(tiny_hybrid: Path) -> None:
    (p,) = prompts(40, seed=13)
    # one sequence: a sliding pool of 6 blocks (its window and one step), a global pool of 48
    engine = make_engine(tiny_hybrid, one_pool_blocks=20, max_num_seqs=1)
    bm = engine.block_manager
    assert isinstance(bm, HybridBlockManager) and (bm.full.num_blocks, bm.win.num_blocks) == (48, 6)
    first = run(engine, [("a", p, 60)])["a"]
    longer = p + first[:56]  # 96 tokens: 5 full blocks to take; the sliding layers need blocks 3 and 4
    got = run(engine, [("b", longer, 20)])["b"]
    assert got == hf_greedy(tiny_hybrid, longer, 20)
    hits = engine.block_manager.num_prefix_hits
    assert hits == 80, f"the first request's blocks (sliding ones freed as it went) serve the prefix: {hits}"
    # other prompts take every sliding block: the prefix's sliding blocks are written over, the hit shrinks
    for i, q in enumerate(prompts(120, 120, 120, seed=17)):
        run(engine, [(f"c{i}", q, 8)])
    req = Request("probe", longer, SamplingParams(max_tokens=1))
    assert len(bm.full.lookup_prefix(req)) == 5, "the global pool (larger) still holds the prefix"
    hit = bm.lookup_prefix(req)
    assert len(hit) < 5, "without the sliding blocks its last query reads, the longest hit is shorter"
    got = run(engine, [("d", longer, 20)])["d"]
    assert got == hf_greedy(tiny_hybrid, longer, 20), "a shorter hit recomputes the rest to the same tokens"


def test_a_draft_model_drafts_beside_a_hybrid_target(tiny_hybrid: Path) -> None:
    """The draft reads the global table only (never freed); the sliding pool frees as without drafts."""
    spec = {"method": "draft_model", "model": str(tiny_hybrid), "num_speculative_tokens": 3, "k_policy": "fixed"}
    engine = make_engine(tiny_hybrid, speculative_config=spec)
    assert engine.scheduler.sliding_window == WINDOW
    (p,) = prompts(30, seed=19)
    assert run(engine, [("a", p, 80)])["a"] == hf_greedy(tiny_hybrid, p, 80)
    assert engine.speculator is not None
    stats = engine.speculator.make_stats()
    assert stats["spec_accepted_tokens"] > 0, stats


def test_a_kv_disk_tier_keeps_one_pool(tiny_hybrid: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_hybrid, kv_disk_dir=str(tmp_path / "kv"))
    assert engine.runner.window_layers == [] and engine.scheduler.sliding_window is None
    assert not isinstance(engine.block_manager, HybridBlockManager)
    (p,) = prompts(20, seed=23)
    assert run_plain(engine, p, 60) == hf_greedy(tiny_hybrid, p, 60)


def run_plain(engine: EngineCore, p: list[int], n: int) -> list[int]:
    engine.add_request(EngineRequest(request_id="a", prompt_token_ids=p,
                                     sampling=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))  # fmt: skip
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
        for r in engine.scheduler.running:
            assert FREED_BLOCK not in r.block_ids and not r.window_block_ids
    return out


def _req(rid: int, tokens: list[int]) -> Request:
    return Request(str(rid), tokens, SamplingParams(max_tokens=64))


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "grow", "slide", "free"]), st.integers(0, 7), st.integers(1, 70)),
                    min_size=1, max_size=60), num_blocks=st.integers(4, 40), num_window_blocks=st.integers(3, 20),
       window=st.integers(1, 48))  # fmt: skip
def test_random_use_keeps_both_pools_exact(ops: list[tuple[str, int, int]], num_blocks: int, num_window_blocks: int,
                                           window: int) -> None:  # fmt: skip
    """Requests that share prefixes, grow, slide their windows and end, in any order: both pools' ref counts
    are their holders, a prefix hit's sliding head holds the blocks of exactly the keys its first query
    reads, and nothing is held after the last request ends."""
    bm = HybridBlockManager(num_blocks, num_window_blocks, window, BS)
    live: list[Request] = []
    shared = [[p * 1000 + i for i in range(48)] for p in range(3)]

    def slide(req: Request) -> None:
        bm.free_before(req, req.num_computed_tokens - window + 1)

    for n, (op, k, count) in enumerate(ops):
        if op == "new":
            req = _req(n, shared[k % 3][: count % 49] + [n * 100 + i for i in range(count)])
            hit = bm.lookup_prefix(req)
            assert isinstance(hit, PrefixHit) and len(hit.window) == len(hit)
            first = max(0, len(hit) * BS - window + 1) // BS
            keys = bm.win.prefix_hashes(req, len(hit))
            assert hit.window[:first] == [FREED_BLOCK] * first
            assert [bm.win.hash_by_block[b] for b in hit.window[first:]] == keys[first:]
            if bm.allocate(req, req.num_tokens, hit):
                req.num_computed_tokens = req.num_tokens
                bm.cache_full_blocks(req, req.num_tokens)
                slide(req)
                live.append(req)
            else:
                assert not req.block_ids and not req.window_block_ids, "a failed allocation changes nothing"
        elif op == "grow" and live:
            req = live[k % len(live)]
            req.token_ids.extend(range(count % 20 + 1))
            if bm.allocate(req, req.num_tokens):
                req.num_computed_tokens = req.num_tokens
                bm.cache_full_blocks(req, req.num_tokens)
            else:
                del req.token_ids[req.num_computed_tokens :]
        elif op == "slide" and live:
            slide(live[k % len(live)])
        elif op == "free" and live:
            bm.free_request(live.pop(k % len(live)))
        bm.check_invariants(live)
    for req in live:
        bm.free_request(req)
    bm.check_invariants([])
    assert bm.full.num_free_blocks == num_blocks and bm.win.num_free_blocks == num_window_blocks
