"""Sliding layers interleaved with global ones read block tables of their own over one pool, and free
them as the window moves (NOTE(hybrid-blocks) in sluice/engine/hybrid_blocks.py).

A tiny random Qwen2 with one global layer and two sliding ones (window 32 = two blocks; a block holds one
layer, so the sliding layers are two groups) generates past several windows: its sliding tables free
the blocks out of the window while the global table keeps every block, the pool's books stay exact every
step, the greedy tokens are transformers', and nothing leaks after a finish, an abort or a preemption.
Prefix hits span the tables; a draft model or a KV disk tier keeps one table of all-layer blocks.
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
from sluice.engine.model_runner import ModelRunner
from sluice.engine.protocol import EngineRequest, SamplingParams
from sluice.engine.request import Request
from tests.engine.test_sliding_window_blocks import hf_greedy, oracle_drafts, prompts
from tests.engine.test_sliding_window_blocks import run as run_checked

BS = 16
WINDOW = 32
LAYER_BLOCK_BYTES = 2 * BS * 2 * 16 * 4  # K and V of one layer's block (a page here): 2 KV heads of 16, fp32


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Qwen2 slides from layer max_window_layers on: layer 0 global, layers 1 and 2 sliding
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-hybrid"), "qwen2", seed=3, num_hidden_layers=3,
                               use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)  # fmt: skip


def make_engine(model_dir: Path, pages: int = 192, **kw: object) -> EngineCore:
    """An engine whose KV budget holds ``pages`` one-layer blocks (one pool of all three layers: a third)."""
    opts: dict[str, object] = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=4, num_threads=1,
                                   kv_cache_memory=pages * LAYER_BLOCK_BYTES)  # fmt: skip
    return EngineCore(model=str(model_dir), **{**opts, **kw})


def check_blocks(engine: EngineCore) -> None:
    """The pool's books are exact; a running request's sliding tables hold just the blocks its window
    reads, its global table every block."""
    sch, bm = engine.scheduler, engine.block_manager
    assert isinstance(bm, HybridBlockManager)
    bm.check_invariants(sch.requests.values())
    for req in sch.running:
        freed = max(0, req.num_computed_tokens - WINDOW + 1) // BS
        assert len(req.window_block_ids) == 2
        for win in req.window_block_ids:
            assert win[:freed] == [FREED_BLOCK] * freed, f"{req}: a sliding block wholly out of the window is held"
            assert FREED_BLOCK not in win[freed:], f"{req}: a sliding block the window still reads was freed"
        assert FREED_BLOCK not in req.block_ids, f"{req}: the global layers' blocks must all stay"


def run(engine: EngineCore, reqs: list[tuple[str, list[int], int]], abort_at: dict[str, int] | None = None) -> dict[str, list[int]]:
    return run_checked(engine, reqs, abort_at, check_blocks)


def test_sliding_tables_free_as_the_window_moves_and_tokens_match_transformers(tiny_hybrid: Path) -> None:
    engine = make_engine(tiny_hybrid)
    assert engine.runner.window_layers == [1, 2] and engine.scheduler.sliding_window == WINDOW
    bm = engine.block_manager
    assert isinstance(bm, HybridBlockManager) and len(bm.groups) == 2
    assert bm.num_blocks == 192, "a block holds one layer: the budget's 192 one-layer blocks, one pool of pages"
    assert engine.runner.kv_cache.num_bytes == 192 * LAYER_BLOCK_BYTES
    ps = prompts(5, 40, 70)  # 70 > the 32-token budget: a chunked prefill
    for i, p in enumerate(ps):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p,
                                         sampling=SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)))  # fmt: skip
    got: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    most = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        check_blocks(engine)
        most = max(most, bm.num_used_blocks)
    # at the end the three hold ceil(125/16) + ceil(160/16) + ceil(190/16) = 30 global blocks and at most 3
    # sliding blocks per group each (18); blocks of all three layers would have been 3 x 30 one-layer blocks
    assert most <= 30 + 18, f"pages held at once: {most}"
    for i, p in enumerate(ps):
        assert got[str(i)] == hf_greedy(tiny_hybrid, p, 120), f"prompt {i}: greedy tokens differ from transformers"
    run(engine, [])  # the books after the last request ended


def test_preempted_and_aborted_requests_leak_nothing(tiny_hybrid: Path) -> None:
    # 20 pages: two requests of 80 tokens hold 5 global and up to 2 x 3 sliding pages each after a step,
    # 22 together, so the newer one is preempted and recomputes to the same tokens
    engine = make_engine(tiny_hybrid, pages=20)
    a, b = prompts(40, 40, seed=11)
    out = run(engine, [("a", a, 40), ("b", b, 40)])
    assert engine.scheduler.num_preemptions > 0, "the test must preempt a request"
    assert out["a"] == hf_greedy(tiny_hybrid, a, 40)
    assert out["b"] == hf_greedy(tiny_hybrid, b, 40), "a preempted request recomputes to the same tokens"
    engine = make_engine(tiny_hybrid)
    out = run(engine, [("a", a, 100), ("b", b, 100)], abort_at={"a": 60})
    assert len(out["a"]) == 60 and len(out["b"]) == 100, "aborted after its sliding blocks slid out of the window"


def test_prefix_hits_span_the_tables_and_serve_the_same_tokens(tiny_hybrid: Path) -> None:
    (p,) = prompts(40, seed=13)
    engine = make_engine(tiny_hybrid, pages=60, max_num_seqs=1)
    first = run(engine, [("a", p, 60)])["a"]
    longer = p + first[:56]  # 96 tokens: 5 full blocks to take; the sliding layers need blocks 3 and 4
    got = run(engine, [("b", longer, 20)])["b"]
    assert got == hf_greedy(tiny_hybrid, longer, 20)
    hits = engine.block_manager.num_prefix_hits
    assert hits == 80, f"the first request's blocks (sliding ones freed as it went) serve the prefix: {hits}"
    for i, q in enumerate(prompts(120, 120, 120, seed=17)):  # other prompts reuse the pages
        run(engine, [(f"c{i}", q, 8)])
    got = run(engine, [("d", longer, 20)])["d"]
    assert got == hf_greedy(tiny_hybrid, longer, 20), "whatever is left of the prefix serves the same tokens"


def test_a_hit_is_as_long_as_every_sliding_group_holds_its_first_querys_window() -> None:
    bm = HybridBlockManager(40, 2, WINDOW, BS)
    tokens = list(range(100, 196))  # 96 tokens: 6 full blocks
    a = _req(0, tokens)
    assert bm.allocate(a, 96, bm.lookup_prefix(a))
    a.num_computed_tokens = 96
    bm.cache_full_blocks(a, 96)
    assert bm.free_before(a, 96 - WINDOW + 1) == 2 * 4, "blocks 0-3 of both groups leave the window"
    bm.free_request(a)  # every page back, keys kept
    b = _req(1, [*tokens, *range(24)])
    hit = bm.lookup_prefix(b)
    assert len(hit) == 6 and hit.window == [[FREED_BLOCK] * 4 + a_w[4:] for a_w in _window_pages(bm, tokens, 6)]
    bm.groups[1]._unname(bm.groups[1].block_by_hash[bm.prefix_hashes(b, 6)[5]])  # group 1 loses block 5
    assert len(bm.lookup_prefix(b)) == 5, "a query at 80 reads blocks 3 and 4: still held by both groups"
    bm.groups[0]._unname(bm.groups[0].block_by_hash[bm.prefix_hashes(b, 6)[3]])  # group 0 loses block 3
    hit = bm.lookup_prefix(b)
    assert len(hit) == 3 and all(w[:1] == [FREED_BLOCK] and FREED_BLOCK not in w[1:] for w in hit.window), (
        "a query at 48 reads blocks 1 and 2")
    assert bm.allocate(b, b.num_tokens, hit)
    bm.check_invariants([b])
    bm.free_request(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 40


def _window_pages(bm: HybridBlockManager, tokens: list[int], n: int) -> list[list[int]]:
    keys = bm.prefix_hashes(_req(99, tokens), n)
    return [[g.block_by_hash[h] for h in keys] for g in bm.groups]


def test_a_draft_model_or_a_kv_disk_tier_keeps_blocks_of_every_layer(tiny_hybrid: Path, tmp_path: Path) -> None:
    """Both copy whole blocks of every layer (a draft's cache has one per target block): one table, none freed."""
    spec = {"method": "draft_model", "model": str(tiny_hybrid), "num_speculative_tokens": 3, "k_policy": "fixed"}
    for kw in ({"speculative_config": spec}, {"kv_disk_dir": str(tmp_path / "kv")}):
        engine = make_engine(tiny_hybrid, **kw)
        assert engine.runner.window_layers == [] and engine.scheduler.sliding_window is None, kw
        assert not isinstance(engine.block_manager, HybridBlockManager)
        (p,) = prompts(20, seed=23)
        assert run_plain(engine, p, 60) == hf_greedy(tiny_hybrid, p, 60)


def test_speculative_runs_trim_and_free_every_table(tiny_hybrid: Path) -> None:
    """Verified drafts advance a request several tokens a step and rejected ones leave slots to trim, in the
    global table and in each sliding one.  The drafts come from an oracle (transformers' tokens, every
    third step a wrong second draft), so that every step drafts whatever this random model says."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "k_policy": "fixed"}
    engine = make_engine(tiny_hybrid, speculative_config=spec)
    assert isinstance(engine.block_manager, HybridBlockManager), "n-gram drafts read no K/V: the tables stay"
    (p,) = prompts(30, seed=19)
    ref = hf_greedy(tiny_hybrid, p, 100)
    assert engine.speculator is not None
    engine.speculator.proposer.propose = oracle_drafts(ref)  # type: ignore[method-assign]
    assert run(engine, [("a", p, 100)])["a"] == ref
    stats = engine.speculator.make_stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_drafted_tokens"] > stats["spec_accepted_tokens"], stats


@pytest.mark.parametrize("kv_dtype", ["int8", "bf16"])
def test_a_quantized_kv_cache_gives_the_tokens_of_one_pool(tiny_hybrid: Path, kv_dtype: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The scales of a quantized cache follow their layer's slot: the same K/V bits as in blocks of every layer."""
    (p,) = prompts(30, seed=29)
    hybrid = run(make_engine(tiny_hybrid, kv_cache_dtype=kv_dtype), [("a", p, 70)])["a"]
    monkeypatch.setattr(ModelRunner, "_window_layers", lambda self: [])
    engine = make_engine(tiny_hybrid, kv_cache_dtype=kv_dtype)
    assert not isinstance(engine.block_manager, HybridBlockManager)
    assert run_plain(engine, p, 70) == hybrid


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
                    min_size=1, max_size=60), num_blocks=st.integers(4, 60), groups=st.integers(1, 3),
       window=st.integers(1, 48))  # fmt: skip
def test_random_use_keeps_the_pool_exact(ops: list[tuple[str, int, int]], num_blocks: int, groups: int, window: int) -> None:
    """Requests that share prefixes, grow, slide their windows and end, in any order: every page's ref count
    is its holders over every table, a prefix hit's sliding heads hold the pages of exactly the keys its
    first query reads, a failed allocation changes nothing, and nothing is held after the last request."""
    bm = HybridBlockManager(num_blocks, groups, window, BS)
    live: list[Request] = []
    shared = [[p * 1000 + i for i in range(48)] for p in range(3)]

    def slide(req: Request) -> None:
        bm.free_before(req, req.num_computed_tokens - window + 1)

    for n, (op, k, count) in enumerate(ops):
        if op == "new":
            req = _req(n, shared[k % 3][: count % 49] + [n * 100 + i for i in range(count)])
            hit = bm.lookup_prefix(req)
            assert isinstance(hit, PrefixHit) and len(hit.window) == (groups if hit else 0)
            first = max(0, len(hit) * BS - window + 1) // BS
            keys = bm.prefix_hashes(req, len(hit))
            for g, head in zip(bm.groups, hit.window):
                assert len(head) == len(hit) and head[:first] == [FREED_BLOCK] * first
                assert [g.hash_by_block[b] for b in head[first:]] == keys[first:]
                assert all(g.block_by_hash[h] == b for h, b in zip(keys[first:], head[first:]))
            free_before = bm.num_free_blocks
            if bm.allocate(req, req.num_tokens, hit):
                req.num_computed_tokens = req.num_tokens
                bm.cache_full_blocks(req, req.num_tokens)
                slide(req)
                live.append(req)
            else:
                assert not req.block_ids and not any(req.window_block_ids), "a failed allocation changes nothing"
                assert bm.num_free_blocks == free_before
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
    assert bm.num_free_blocks == num_blocks
