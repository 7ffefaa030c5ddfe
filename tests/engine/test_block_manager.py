"""BlockManager property tests: no leak, no double free, prefix sharing and LRU eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.engine.block_manager import BlockManager
from sluice.engine.protocol import SamplingParams
from sluice.engine.request import Request

BS = 16
PARAMS = SamplingParams(max_tokens=64)


def _req(rid: int, tokens: list[int]) -> Request:
    return Request(str(rid), tokens, PARAMS)


ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "append", "free", "compute"]),
        st.integers(0, 7),  # which live request / which shared prefix
        st.integers(1, 70),  # token count
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(ops=ops, num_blocks=st.integers(4, 40), caching=st.booleans())
def test_random_operations_never_leak_or_double_free(ops: list[tuple[str, int, int]], num_blocks: int, caching: bool) -> None:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    live: list[Request] = []
    prefixes = [[p * 1000 + i for i in range(48)] for p in range(4)]  # shared prompt starts
    n = 0
    for op, k, count in ops:
        if op == "new":
            tokens = prefixes[k % 4][: count % 49] + [n * 7 + i for i in range(count)]
            req = _req(n, tokens)
            n += 1
            cached = bm.lookup_prefix(req)
            if bm.allocate(req, req.num_tokens - len(cached) * BS, cached or None):
                assert len(req.block_ids) == -(-req.num_tokens // BS), "a request holds ceil(tokens/16) blocks"
                live.append(req)
        elif op == "compute" and live:
            req = live[k % len(live)]
            req.num_computed_tokens = req.num_tokens
            bm.cache_full_blocks(req)
        elif op == "append" and live:
            req = live[k % len(live)]
            req.num_computed_tokens = req.num_tokens
            bm.cache_full_blocks(req)
            req.token_ids.extend(range(count % 20 + 1))
            bm.allocate(req, req.num_tokens - req.num_computed_tokens)
        elif op == "free" and live:
            bm.free_request(live.pop(k % len(live)))
        bm.check_invariants()
        held = {b for r in live for b in r.block_ids}
        assert bm.num_used_blocks == len(held), "used blocks must be exactly the blocks requests hold"
    for req in live:
        bm.free_request(req)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "after every request is freed, all blocks are free"


def test_second_request_reuses_cached_prefix_blocks() -> None:
    bm = BlockManager(16, BS)
    a = _req(1, list(range(64)) + [900, 901])
    assert bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    b = _req(2, list(range(64)) + [700])
    cached = bm.lookup_prefix(b)
    assert cached == a.block_ids[:4], "the 4 full blocks of the shared 64-token prefix are reused"
    assert bm.allocate(b, b.num_tokens - 64, cached)
    assert b.num_computed_tokens == 64
    assert bm.ref_counts[cached[0]] == 2
    bm.free_request(a)
    bm.free_request(b)
    assert bm.num_free_blocks == 16


def test_unheld_cached_blocks_are_evicted_lru() -> None:
    bm = BlockManager(4, BS)
    old = _req(1, list(range(32)) + [1])
    bm.allocate(old, old.num_tokens)
    old.num_computed_tokens = old.num_tokens
    bm.cache_full_blocks(old)
    bm.free_request(old)
    assert len(bm.block_by_hash) == 2, "freed blocks keep their cached content"
    new = _req(2, [5000 + i for i in range(40)])
    assert bm.allocate(new, new.num_tokens)  # needs 3 of 4 blocks: evicts cached ones
    assert len(bm.block_by_hash) <= 1
    again = _req(3, list(range(32)) + [1])
    assert len(bm.lookup_prefix(again)) <= 1, "evicted prefixes are no longer found"
    bm.free_request(new)
    bm.check_invariants()


def test_whole_prompt_never_taken_from_cache() -> None:
    bm = BlockManager(8, BS)
    a = _req(1, list(range(32)))
    bm.allocate(a, 32)
    a.num_computed_tokens = 32
    bm.cache_full_blocks(a)
    b = _req(2, list(range(32)))
    assert len(bm.lookup_prefix(b)) == 1, "the last token must be computed to get logits"


def test_prefix_hit_capacity_check_counts_blocks_after_the_prefix() -> None:
    # regression (found by the property test): with one cached block held by another
    # request and no free block, a 28-token request that hits a 16-token prefix still
    # needs one new block, so it must not be admitted
    bm = BlockManager(2, BS)
    a = _req(1, list(range(16)) + [900])
    assert bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    assert bm.num_free_blocks == 0
    c = _req(2, list(range(16)) + list(range(500, 512)))
    cached = bm.lookup_prefix(c)
    assert cached == a.block_ids[:1]
    assert not bm.can_allocate(c, c.num_tokens - BS, cached)
    assert not bm.allocate(c, c.num_tokens - BS, cached), "allocation must fail cleanly, not raise"
    bm.check_invariants()
