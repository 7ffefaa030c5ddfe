"""KV block pool: free list, reference counts, prefix caching, LRU eviction.

    block table of a request (block_size = 16 tokens)
    ┌────────┬────────┬────────┬──────┐
    │ blk 7  │ blk 2  │ blk 9  │ blk 4│  <- last block partially filled
    └────────┴────────┴────────┴──────┘
      full     full     full    (no hash yet)
      h0=H(∅,t0..15)  h1=H(h0,t16..31) ...   chained hashes of full blocks

A full block is known by the chained hash of its tokens and its predecessor's
hash, so equal hashes mean equal prefixes.  A new request walks its prompt's
hashes and takes every leading block already cached (ref_count += 1); it then
computes only the rest.  A block whose ref_count drops to 0 keeps its hash and
content and goes to the *end* of the free list; allocation takes from the
*front*, so cached blocks nobody holds are evicted least-recently-used first.

Keys are ``kv_tiers.keys.hash_block_tokens`` (blake2b, the same in every
process), so a block's key in memory is its key in the disk tier.  A block
being loaded from a KV tier is registered under its key at once and held by
the load (``hold_for_load`` / ``release_load``), so requests that share it
wait for that one load; a block whose load failed loses its key.

NOTE(window-blocks): a model whose every layer attends within a sliding
window never reads a key ``window`` or more positions before its query, so a
request's leading blocks go back to the pool once every token in them is that
old for its next query (``free_before``, called by the scheduler).  Its table
keeps ``FREED_BLOCK`` in their place, so position p still lives in entry
p // 16; attention reads none of them (models/attention.py skips the blocks
before the window).  A freed block is released like any other: it keeps its
key while no one reuses it (its K/V are still those of its prefix, so a request
that looks the prefix up may take it and hold it again), and ``_take_free``
drops the key before the block is written again, so a key never names a block
that holds other K/V.  Where sliding layers are interleaved with global ones, the
sliding layers' pool of a ``HybridBlockManager`` frees this way and the global
pool never does (NOTE(hybrid-blocks) in hybrid_blocks.py).

Invariant (``check_invariants``, run by the property tests): every block is
either held (ref_count > 0) or in the free list, never both; its ref_count is
the number of requests (and KV tier loads) holding it; after every request is
freed, free blocks == total blocks.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from sluice.engine.kv_tiers.keys import hash_block_tokens
from sluice.engine.request import Request

__all__ = ["BlockManager", "hash_block", "FREED_BLOCK"]

FREED_BLOCK = -1  # a block table entry given back out of a sliding window (NOTE(window-blocks))


def hash_block(prev_hash: int | None, tokens: Sequence[int], salt: bytes = b"") -> int:
    """Key of a full block: its tokens chained to the previous block's key (NOTE(stable-hash) in kv_tiers.keys).

    ``salt`` keeps caches apart that share tokens but not K/V (a LoRA adapter's, ``Request.cache_salt``).
    """
    return hash_block_tokens(prev_hash, tokens, salt)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 *, pool: BlockManager | None = None):  # fmt: skip
        """``pool``: share that manager's blocks (free list, reference counts, keys) and keep a table and a
        prefix cache of this one's own: a table of a HybridBlockManager (NOTE(hybrid-blocks))."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_by_hash: dict[int, int] = {}  # this table's prefix cache
        if pool is not None:
            if pool.num_blocks != num_blocks or pool.block_size != block_size:
                raise ValueError("a shared pool's tables use its block count and size")
            self.ref_counts, self.hash_by_block, self.free = pool.ref_counts, pool.hash_by_block, pool.free
            self._key_owner = pool._key_owner
        else:
            self.ref_counts = [0] * num_blocks
            self.hash_by_block: list[int | None] = [None] * num_blocks
            # free blocks in eviction order (front = evicted first); value unused
            self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
            # the prefix cache (a table's block_by_hash) that names each keyed block
            self._key_owner: list[dict[int, int] | None] = [None] * num_blocks
        self.num_prefix_queries = 0  # prompt tokens looked up (cumulative)
        self.num_prefix_hits = 0  # prompt tokens found (cumulative)
        self.track_new_blocks = False  # a KV tier is attached: collect newly cached blocks for it
        self._newly_cached: list[tuple[int, int]] = []  # (key, block) registered since take_newly_cached()
        # request -> keys of its leading full blocks, computed once (tokens are only appended)
        self._keys_memo: weakref.WeakKeyDictionary[Request, tuple[bytes, list[int]]] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------ the request's table in this pool

    def table(self, req: Request) -> list[int]:
        return req.block_ids

    def hashes(self, req: Request) -> list[int]:
        return req.block_hashes

    def _reset(self, req: Request) -> None:
        req.block_ids = []
        req.block_hashes = []

    def _name(self, b: int, h: int) -> None:
        """Register block ``b`` under key ``h`` in this table's prefix cache."""
        self.block_by_hash[h] = b
        self.hash_by_block[b] = h
        self._key_owner[b] = self.block_by_hash

    def _unname(self, b: int) -> None:
        """Drop block ``b``'s key from whichever prefix cache names it."""
        h, owner = self.hash_by_block[b], self._key_owner[b]
        if h is not None and owner is not None and owner.get(h) == b:
            del owner[h]
        self.hash_by_block[b] = None
        self._key_owner[b] = None

    # ------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_held_blocks(self, req: Request) -> int:
        """Blocks the request holds (its table less the entries freed out of its window)."""
        return sum(1 for b in self.table(req) if b != FREED_BLOCK)

    def fits_after_preempting(self, req: Request, num_tokens: int, cached: Sequence[int], victims: Sequence[Request]) -> bool:
        """Whether ``allocate(req, num_tokens, cached)`` could succeed once every one of ``victims`` is freed."""
        need = self.num_blocks_to_allocate(req, num_tokens, cached)
        return need <= len(self.free) + sum(self.num_held_blocks(r) for r in victims)

    # ------------------------------------------------------------ prefix cache

    def prefix_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """Keys of the request's first ``num_blocks`` full blocks (memoised per request and cache salt)."""
        salt, keys = self._keys_memo.get(req, (None, []))
        if salt != req.cache_salt:  # an adapter assigned after a first lookup: start over
            keys = []
            self._keys_memo[req] = (req.cache_salt, keys)
        bs, ids = self.block_size, req.token_ids
        for i in range(len(keys), num_blocks):
            keys.append(hash_block(keys[-1] if keys else None, ids[i * bs : (i + 1) * bs], req.cache_salt))
        return keys[:num_blocks]

    def lookup_prefix(self, req: Request) -> list[int]:
        """Cached block ids for the request's leading full blocks (at least one token is left to compute)."""
        if not self.enable_prefix_caching:
            return []
        # NOTE(prefix-last-token): never take the whole prompt from cache: the
        # last token must run through the model to produce logits.
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self.prefix_hashes(req, max_blocks):
            b = self.block_by_hash.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    # ------------------------------------------------------------ allocation

    def _take_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        if self.hash_by_block[b] is not None:  # evict its cached content
            self._unname(b)
        self.ref_counts[b] = 1
        return b

    def _release(self, b: int, owner: str) -> None:
        """Drop one reference; a block no one holds goes to the free list, at the front if uncached."""
        self.ref_counts[b] -= 1
        if self.ref_counts[b] < 0:
            raise RuntimeError(f"block {b} freed twice ({owner})")
        if self.ref_counts[b] == 0:
            self.free[b] = None
            if self.hash_by_block[b] is None:
                self.free.move_to_end(b, last=False)  # uncached: reuse first

    def _hold(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            del self.free[b]
        self.ref_counts[b] += 1

    def num_blocks_to_allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> int:
        """Free-list blocks ``allocate(req, num_tokens, cached)`` would take."""
        # cached prefix blocks are shared, not allocated; the rest are new blocks (a window table's
        # cached head may start with FREED_BLOCK entries: positions no query of the request reads)
        need = self.blocks_needed(num_tokens) - len(self.table(req)) - len(cached)
        # cached blocks nobody holds sit in the free list: taking them uses free slots
        return need + sum(1 for b in cached if b != FREED_BLOCK and self.ref_counts[b] == 0)

    def can_allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether ``req`` can hold ``num_tokens`` tokens in all (computed + new), ``cached`` first."""
        return self.num_blocks_to_allocate(req, num_tokens, cached) <= len(self.free)

    def allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Give ``req`` blocks for ``num_tokens`` tokens in all (computed + new).

        ``cached`` (first allocation only) are prefix blocks from ``lookup_prefix``:
        they are shared and become the head of the block table.  Progress
        (``num_computed_tokens``) is the scheduler's: it counts the cached tokens
        as computed.  Returns False and changes nothing when the blocks do not fit.
        """
        if not self.can_allocate(req, num_tokens, cached):
            return False
        table = self.table(req)
        if cached:
            if table:
                raise RuntimeError(f"prefix blocks are only taken at the first allocation ({req.request_id})")
            for b in cached:
                if b != FREED_BLOCK:
                    self._hold(b)
            table.extend(cached)
            self.hashes(req).extend(self.prefix_hashes(req, len(cached)))  # the keys lookup found them by
        for _ in range(self.blocks_needed(num_tokens) - len(table)):
            table.append(self._take_free())
        return True

    def free_request(self, req: Request) -> None:
        """Release the request's blocks; tail blocks first so they are evicted first."""
        for b in reversed(self.table(req)):
            if b != FREED_BLOCK:
                self._release(b, f"request {req.request_id}")
        self._reset(req)

    def free_before(self, req: Request, position: int) -> int:
        """Give back the request's blocks whose tokens all lie before ``position`` (NOTE(window-blocks));
        their entries become ``FREED_BLOCK``.  Returns how many were freed now."""
        table = self.table(req)
        end = min(max(0, position) // self.block_size, len(table))
        start = end
        while start > 0 and table[start - 1] != FREED_BLOCK:  # freed entries are a prefix of the table
            start -= 1
        for i in range(end - 1, start - 1, -1):  # later blocks first, so they are evicted first
            self._release(table[i], f"request {req.request_id}")
            table[i] = FREED_BLOCK
        return end - start

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the request's blocks past its first ``num_tokens`` tokens (the slots of rejected
        speculative drafts: never registered, they are reused first)."""
        table = self.table(req)
        keep = max(self.blocks_needed(num_tokens), len(self.hashes(req)))
        while len(table) > keep:
            self._release(table.pop(), f"request {req.request_id}")

    def cache_full_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register hashes for the request's blocks that are full and computed."""
        if not self.enable_prefix_caching:
            return
        table, hashes = self.table(req), self.hashes(req)
        num_full = min(num_computed_tokens // self.block_size, len(table))
        if num_full <= len(hashes):
            return
        keys = self.prefix_hashes(req, num_full)
        for i in range(len(hashes), num_full):
            h = keys[i]
            hashes.append(h)
            b = table[i]
            if b != FREED_BLOCK and h not in self.block_by_hash and self.hash_by_block[b] is None:
                self._name(b, h)
                if self.track_new_blocks:
                    self._newly_cached.append((h, b))

    def take_newly_cached(self) -> list[tuple[int, int]]:
        """(key, block) pairs registered by ``cache_full_blocks`` since the last call (KV tier stores)."""
        out, self._newly_cached = self._newly_cached, []
        return out

    def cached_blocks(self) -> list[tuple[int, int]]:
        """Every (key, block) the prefix cache holds now."""
        return list(self.block_by_hash.items())

    # ------------------------------------------------------------ KV tier loads

    def hold_for_load(self, req: Request, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Blocks of ``req`` (right after its cached prefix) are being filled from a KV tier.

        Registers their keys now (requests that share the prefix take them and
        wait for the same load) and takes one reference for the load itself,
        so the blocks stay put until ``release_load`` even if ``req`` is aborted.
        """
        for b, h in zip(block_ids, hashes):
            if h not in self.block_by_hash and self.hash_by_block[b] is None:
                self._name(b, h)
            self._hold(b)
        self.hashes(req).extend(hashes)

    def release_load(self, block_ids: Sequence[int], num_loaded: int) -> None:
        """A load finished: blocks past ``num_loaded`` hold nothing valid and lose their keys."""
        for i, b in enumerate(block_ids):
            if i >= num_loaded and self.hash_by_block[b] is not None:
                self._unname(b)
            self._release(b, "a KV tier load")

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queries += num_prompt_tokens
        self.num_prefix_hits += num_hit_tokens

    def count_holders(self, req: Request, holders: list[int]) -> None:
        """Add the blocks ``req``'s table in this pool holds to ``holders`` (freed entries must lead the table)."""
        ids = self.table(req)
        freed = next((i for i, b in enumerate(ids) if b != FREED_BLOCK), len(ids))
        if any(b == FREED_BLOCK for b in ids[freed:]):
            raise AssertionError(f"{req.request_id}: a freed entry after a held block in {ids}")
        for b in ids[freed:]:
            holders[b] += 1

    def check_holders(self, holders: list[int]) -> None:
        """Every block's ref_count is its number of holders."""
        for b, n in enumerate(holders):
            if self.ref_counts[b] != n:
                raise AssertionError(f"block {b} has ref_count {self.ref_counts[b]} but {n} holders")

    def check_invariants(self, requests: Iterable[Request] | None = None) -> None:
        """Raise AssertionError where the pool's books disagree.  With ``requests`` (every request that
        holds blocks, while no KV tier load holds any), each block's ref_count must be its number of holders."""
        if requests is not None:
            holders = [0] * self.num_blocks
            for req in requests:
                self.count_holders(req, holders)
            self.check_holders(holders)
        for b in range(self.num_blocks):
            rc = self.ref_counts[b]
            if rc < 0:
                raise AssertionError(f"block {b} has ref_count {rc}")
            if (rc == 0) != (b in self.free):
                raise AssertionError(f"block {b}: ref_count {rc} but in free list = {b in self.free}")
        for h, b in self.block_by_hash.items():
            if self._key_owner[b] is not self.block_by_hash:
                raise AssertionError(f"block {b} is named {h} here but its key belongs to another table")
            if self.hash_by_block[b] != h:
                raise AssertionError(f"hash map points {h} -> {b} but block has {self.hash_by_block[b]}")
