"""Sliding windows free their KV blocks (NOTE(window-blocks) in sluice/engine/block_manager.py).

A tiny random Mistral (every layer slides, window 32 = two blocks) generates past several windows:
the blocks out of the window go back to the pool as it goes, the pool's books stay exact every step,
the greedy tokens are transformers', and nothing leaks after a finish, an abort or a preemption.
Draft-model speculation frees nothing (NOTE(window-scope)); interleaved models (global layers) free
the sliding layers' own pool (tests/engine/test_hybrid_blocks.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_factory import make_tiny_model_dir

from sluice.engine.block_manager import FREED_BLOCK, BlockManager
from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineRequest, SamplingParams
from sluice.engine.request import Request

BS = 16
WINDOW = 32
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, fp32


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-mistral"), "mistral", seed=2, sliding_window=WINDOW)


@functools.cache
def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, each from the whole sequence (no cache: its window mask on every step)."""
    hf = hf_model(model_dir)
    ids: list[int] = list(prompt)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: on a busy host, idle OpenMP workers spinning cost 30x
    try:
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].argmax()))
    finally:
        torch.set_num_threads(threads)
    return ids[len(prompt) :]


def make_engine(model_dir: Path, num_blocks: int = 64, **kw: object) -> EngineCore:
    opts: dict[str, object] = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=4, num_threads=1,
                                   kv_cache_memory=num_blocks * BLOCK_BYTES)  # fmt: skip
    return EngineCore(model=str(model_dir), **{**opts, **kw})


def prompts(*lens: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lens]


def check_blocks(engine: EngineCore) -> None:
    """The pool's books are exact, and each running request holds just the blocks its window reads."""
    sch, bm = engine.scheduler, engine.block_manager
    bm.check_invariants(sch.requests.values())
    for req in sch.running:
        freed = max(0, req.num_computed_tokens - WINDOW + 1) // BS
        assert req.block_ids[:freed] == [FREED_BLOCK] * freed, f"{req}: a block wholly out of the window is still held"
        assert FREED_BLOCK not in req.block_ids[freed:], f"{req}: a block the window still reads was freed"


def run(engine: EngineCore, reqs: list[tuple[str, list[int], int]], abort_at: dict[str, int] | None = None,
        check: Callable[[EngineCore], None] | None = None) -> dict[str, list[int]]:  # fmt: skip
    """Run requests (id, prompt, max_tokens) to the end, checking the blocks every step (``check``, default
    ``check_blocks``); their output tokens.  Nothing may stay held after the last one."""
    for rid, p, n in reqs:
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=p,
                                         sampling=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))  # fmt: skip
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if abort_at and len(out[o.request_id]) == abort_at.get(o.request_id):
                engine.abort([o.request_id])
        (check or check_blocks)(engine)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked after every request ended"
    bm.check_invariants([])
    return out


def test_generation_past_several_windows_frees_blocks_and_matches_transformers(tiny_mistral: Path) -> None:
    engine = make_engine(tiny_mistral)
    assert engine.scheduler.sliding_window == WINDOW, "every layer slides: blocks out of the window are freed"
    ps = prompts(5, 40, 70)  # 70 > the 32-token budget: a chunked prefill
    most_held = 0
    freed_seen = False
    for i, p in enumerate(ps):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p,
                                         sampling=SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)))  # fmt: skip
    got: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        check_blocks(engine)
        bm = engine.block_manager
        held = {b for r in engine.scheduler.requests.values() for b in r.block_ids if b != FREED_BLOCK}
        assert bm.num_free_blocks == bm.num_blocks - len(held), "free blocks: the pool less what requests hold"
        most_held = max(most_held, len(held))
        freed_seen |= any(FREED_BLOCK in r.block_ids for r in engine.scheduler.running)
    assert freed_seen, "no block was ever freed out of the window"
    # after a step a request holds the blocks of its last 31 computed tokens: at most 3 (without freeing,
    # the three would end holding ceil(125/16) + ceil(160/16) + ceil(190/16) = 30 blocks)
    assert most_held <= 3 * 3, f"at most a window's blocks per request: held {most_held} blocks at once"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"
    for i, p in enumerate(ps):
        assert got[str(i)] == hf_greedy(tiny_mistral, p, 120), f"prompt {i}: greedy tokens differ from transformers"


def test_preempted_and_aborted_requests_leak_nothing(tiny_mistral: Path) -> None:
    # 5 blocks: one running request holds up to 3 of them, so the second one, admitted when the first
    # held 2, is preempted when the first needs its next block; each recomputes to the same tokens
    engine = make_engine(tiny_mistral, num_blocks=5, max_num_batched_tokens=64)
    a, b = prompts(40, 40, seed=11)
    out = run(engine, [("a", a, 40), ("b", b, 40)])
    assert engine.scheduler.num_preemptions > 0, "the test must preempt a request that had freed blocks"
    assert out["a"] == hf_greedy(tiny_mistral, a, 40)
    assert out["b"] == hf_greedy(tiny_mistral, b, 40), "a preempted request recomputes to the same tokens"
    engine = make_engine(tiny_mistral)
    out = run(engine, [("a", a, 100), ("b", b, 100)], abort_at={"a": 60})
    assert len(out["a"]) == 60 and len(out["b"]) == 100, "aborted after its blocks slid out of the window"


def test_freed_blocks_serve_a_prefix_only_while_they_hold_it(tiny_mistral: Path) -> None:
    """A freed block keeps its key until it is reused: a later request with the prefix may take it (its
    K/V are still that prefix's), and once another request wrote over it, the key is gone."""
    (p,) = prompts(40, seed=13)
    engine = make_engine(tiny_mistral, num_blocks=16)
    first = run(engine, [("a", p, 60)])["a"]
    longer = p + first[:56]  # 96 tokens: blocks 0-5 are the first request's, 0-3 of them freed as it went
    got = run(engine, [("b", longer, 20)])["b"]
    assert got == hf_greedy(tiny_mistral, longer, 20)
    hits = engine.block_manager.num_prefix_hits
    assert hits == 80, f"the first request's blocks (freed out of its window) serve the prefix: {hits} tokens"
    # other prompts take every block: the freed ones are written over and lose their keys
    for i, q in enumerate(prompts(120, 120, 120, 120, seed=17)):
        run(engine, [(f"c{i}", q, 8)])
    got = run(engine, [("d", longer, 20)])["d"]
    assert got == hf_greedy(tiny_mistral, longer, 20), "a reused block must never serve a prefix"
    assert engine.block_manager.num_prefix_hits == hits, "the prefix's blocks were reused: no hit"


def oracle_drafts(ref: list[int]) -> Callable[[list[tuple[Request, int]], object], dict[str, list[int]]]:
    """A proposer whose drafts are the reference tokens (transformers'), every third call with a wrong second
    draft: every step drafts whatever a random model says, and some drafts are rejected."""
    calls = [0]

    def oracle(batch: list[tuple[Request, int]], generators: object) -> dict[str, list[int]]:
        calls[0] += 1
        out = {}
        for req, k in batch:
            drafts = ref[req.num_output_tokens : req.num_output_tokens + k]
            if calls[0] % 3 == 0 and len(drafts) > 1:
                drafts[1] = (drafts[1] + 1) % 4000
            out[req.request_id] = drafts
        return out

    return oracle


def test_speculative_runs_free_blocks_and_keep_the_greedy_tokens(tiny_mistral: Path) -> None:
    """Verified drafts advance a request by several tokens a step, and rejected ones leave slots to trim:
    the window frees blocks through both.  The drafts come from an oracle (transformers' own tokens, every
    third step with a wrong second draft), so that every step drafts whatever this random model says."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "k_policy": "fixed"}
    engine = make_engine(tiny_mistral, speculative_config=spec)
    assert engine.scheduler.sliding_window == WINDOW, "n-gram drafts read no K/V: the window frees blocks"
    (p,) = prompts(30, seed=19)
    ref = hf_greedy(tiny_mistral, p, 100)
    assert engine.speculator is not None
    engine.speculator.proposer.propose = oracle_drafts(ref)  # type: ignore[method-assign]
    assert run(engine, [("a", p, 100)])["a"] == ref
    stats = engine.speculator.make_stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_drafted_tokens"] > stats["spec_accepted_tokens"], stats


def test_draft_models_free_nothing_where_every_layer_slides(tiny_mistral: Path) -> None:
    spec = {"method": "draft_model", "model": str(tiny_mistral), "num_speculative_tokens": 2}
    assert make_engine(tiny_mistral, speculative_config=spec).scheduler.sliding_window is None, (
        "a draft model reads the blocks from its own, lagging progress: none may be freed")


def _req(rid: int, tokens: list[int]) -> Request:
    return Request(str(rid), tokens, SamplingParams(max_tokens=64))


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "grow", "slide", "free"]), st.integers(0, 7), st.integers(1, 70)),
                    min_size=1, max_size=60), num_blocks=st.integers(4, 40), window=st.integers(1, 48))  # fmt: skip
def test_random_window_frees_keep_the_pool_exact(ops: list[tuple[str, int, int]], num_blocks: int, window: int) -> None:
    """Requests that share prefixes, grow, slide their windows and end, in any order: every block's
    ref_count is its number of holders, and nothing is left held after the last request ends."""
    bm = BlockManager(num_blocks, BS)
    live: list[Request] = []
    shared = [[p * 1000 + i for i in range(48)] for p in range(3)]
    for n, (op, k, count) in enumerate(ops):
        if op == "new":
            req = _req(n, shared[k % 3][: count % 49] + [n * 100 + i for i in range(count)])
            if bm.allocate(req, req.num_tokens, bm.lookup_prefix(req)):
                req.num_computed_tokens = req.num_tokens
                bm.cache_full_blocks(req, req.num_tokens)
                live.append(req)
        elif op == "grow" and live:
            req = live[k % len(live)]
            req.token_ids.extend(range(count % 20 + 1))
            if bm.allocate(req, req.num_tokens):
                req.num_computed_tokens = req.num_tokens
                bm.cache_full_blocks(req, req.num_tokens)
            else:
                del req.token_ids[req.num_computed_tokens :]
        elif op == "slide" and live:
            req = live[k % len(live)]
            before = bm.num_held_blocks(req)
            freed = bm.free_before(req, req.num_computed_tokens - window + 1)
            assert bm.num_held_blocks(req) == before - freed
            assert freed == 0 or bm.free_before(req, req.num_computed_tokens - window + 1) == 0, "freed twice"
        elif op == "free" and live:
            bm.free_request(live.pop(k % len(live)))
        bm.check_invariants(live)
    for req in live:
        bm.free_request(req)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks
