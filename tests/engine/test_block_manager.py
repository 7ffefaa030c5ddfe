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
            if bm.allocate(req, req.num_tokens, cached):
                assert len(req.block_ids) == -(-req.num_tokens // BS), "a request holds ceil(tokens/16) blocks"
                live.append(req)
        elif op == "compute" and live:
            req = live[k % len(live)]
            bm.cache_full_blocks(req, req.num_tokens)
        elif op == "append" and live:
            req = live[k % len(live)]
            bm.cache_full_blocks(req, req.num_tokens)
            req.token_ids.extend(range(count % 20 + 1))
            bm.allocate(req, req.num_tokens)
        elif op == "free" and live:
            bm.free_request(live.pop(k % len(live)))
        bm.check_invariants()
        held = {b for r in live for b in r.block_ids}
        assert bm.num_used_blocks == len(held), "used blocks must be exactly the blocks requests hold"
    for req in live:
        bm.free_request(req)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "after every request is freed, all blocks are free"


def _computed(bm: BlockManager, tokens: list[int], rid: int) -> Request:
    """A request whose tokens are all computed and whose full blocks are cached."""
    req = _req(rid, tokens)
    assert bm.allocate(req, req.num_tokens, bm.lookup_prefix(req))
    bm.cache_full_blocks(req, req.num_tokens)
    return req


def test_second_request_reuses_cached_prefix_blocks() -> None:
    bm = BlockManager(16, BS)
    a = _computed(bm, list(range(64)) + [900, 901], 1)
    b = _req(2, list(range(64)) + [700])
    cached = bm.lookup_prefix(b)
    assert cached == a.block_ids[:4], "the 4 full blocks of the shared 64-token prefix are reused"
    assert bm.allocate(b, b.num_tokens, cached)
    assert b.block_ids[:4] == cached and len(b.block_ids) == 5, "prefix blocks head the table, one new block follows"
    assert bm.ref_counts[cached[0]] == 2
    bm.free_request(a)
    bm.free_request(b)
    assert bm.num_free_blocks == 16


def test_allocate_leaves_progress_to_the_scheduler() -> None:
    bm = BlockManager(16, BS)
    _computed(bm, list(range(64)) + [900], 1)
    b = _req(2, list(range(64)) + [700])
    assert bm.allocate(b, b.num_tokens, bm.lookup_prefix(b))
    assert b.num_computed_tokens == 0, "only the scheduler advances num_computed_tokens, even over a prefix hit"


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    bm = BlockManager(4, BS)
    a_tokens, b_tokens = list(range(16)) + [1], list(range(100, 116)) + [1]
    a = _computed(bm, a_tokens, 1)  # one full (cached) block + one partial block
    b = _computed(bm, b_tokens, 2)
    bm.free_request(a)
    bm.free_request(b)
    assert len(bm.block_by_hash) == 2, "freed blocks keep their cached content"
    # reusing a's prefix makes it the most recently used cached block
    bm.free_request(_computed(bm, a_tokens, 3))
    # 3 blocks: the two uncached partial blocks, then the least recently used cached block (b's)
    c = _computed(bm, [5000 + i for i in range(40)], 4)
    assert bm.lookup_prefix(_req(5, b_tokens)) == [], "b's prefix was used least recently: evicted first"
    assert len(bm.lookup_prefix(_req(6, a_tokens))) == 1, "a's prefix was used more recently: still cached"
    # one more block: now a's prefix goes too
    d = _req(7, [9000])
    assert bm.allocate(d, d.num_tokens)
    assert bm.lookup_prefix(_req(8, a_tokens)) == [], "with every other block held, a's prefix is evicted last"
    bm.free_request(c)
    bm.free_request(d)
    bm.check_invariants()


def test_whole_prompt_never_taken_from_cache() -> None:
    bm = BlockManager(8, BS)
    _computed(bm, list(range(32)), 1)
    b = _req(2, list(range(32)))
    assert len(bm.lookup_prefix(b)) == 1, "the last token must be computed to get logits"


def test_prefix_hit_capacity_check_counts_blocks_after_the_prefix() -> None:
    # regression (found by the property test): with one cached block held by another
    # request and no free block, a 28-token request that hits a 16-token prefix still
    # needs one new block, so it must not be admitted
    bm = BlockManager(2, BS)
    a = _computed(bm, list(range(16)) + [900], 1)
    assert bm.num_free_blocks == 0
    c = _req(2, list(range(16)) + list(range(500, 512)))
    cached = bm.lookup_prefix(c)
    assert cached == a.block_ids[:1]
    assert not bm.can_allocate(c, c.num_tokens, cached)
    assert not bm.allocate(c, c.num_tokens, cached), "allocation must fail cleanly, not raise"
    assert c.block_ids == [] and bm.ref_counts[cached[0]] == 1, "a failed allocation changes nothing"
    bm.check_invariants()
