"""One KV pool for models that interleave sliding-window layers with global ones (gemma2/3).

NOTE(hybrid-blocks): a global layer reads every key of a request, a sliding
layer only the last ``window``.  With one block holding every layer, no block
can go back while the request runs.  Here a block (a *page*) holds G layers,
G the number of global layers, and a request has several tables over the one
pool of pages:

    global layers (G):            req.block_ids            [p7 p2 p9 p4 p1]  every block
    sliding layers, group q of G: req.window_block_ids[q]  [-1 -1 p3 p8 p5]  out of the window: freed

The sliding layers are split into R = ceil(sliding / G) groups of at most G,
each with its own table; the model's K/V cache is G tensors of pages, and
layer i reads its group's table in tensor ``i``'s slot (KVCache ``layer_slots``).
All tables index positions the same way (position p in entry p // 16).  A
sliding table frees a page once every token in it is out of the window of the
request's next query (``BlockManager.free_before``, NOTE(window-blocks)); the
global table never frees one early.  Freed pages go back to the one free list,
so the memory the sliding layers held past their window serves any table of
any request: a request of C tokens holds C / 16 + R (window / 16 + 1) pages
where one block of every layer cost (1 + R) C / 16 (about 6.5 pages a block for
Gemma 3's 5-to-1 layers, 7 here with the last group padded).

The prefix cache spans the tables with the same keys (the chained hash of the
tokens), one prefix cache per table: a prefix of ``n`` blocks is a hit when
the global table's cache holds all ``n`` and every sliding group's holds the
blocks the first new query sees (those in the window before position 16 n); the
longest such ``n`` wins.  A draft model's cache and the KV disk tier copy whole
blocks of every layer: with either, the model runs on one pool of all-layer
blocks and frees nothing (model_runner ``_window_layers``).

The manager answers the scheduler's calls as a ``BlockManager`` does: an
allocation succeeds only when the pool has pages for every table, and changes
nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sluice.engine.block_manager import FREED_BLOCK, BlockManager
from sluice.engine.request import Request

__all__ = ["HybridBlockManager", "PrefixHit"]


class PrefixHit(list[int]):
    """A prefix-cache hit: the global table's blocks (the list) and each sliding group's table head
    (``window[q]``: as long as the list, FREED_BLOCK where no query of the request reads)."""

    def __init__(self, blocks: Iterable[int] = (), window: Sequence[Sequence[int]] = ()):
        super().__init__(blocks)
        self.window = [list(w) for w in window]


class _GroupTable(BlockManager):
    """The table of sliding group ``group`` over a shared pool (its own prefix cache)."""

    def __init__(self, pool: BlockManager, group: int):
        super().__init__(pool.num_blocks, pool.block_size, pool.enable_prefix_caching, pool=pool)
        self.group = group

    def table(self, req: Request) -> list[int]:
        while len(req.window_block_ids) <= self.group:
            req.window_block_ids.append([])
        return req.window_block_ids[self.group]

    def hashes(self, req: Request) -> list[int]:
        while len(req.window_block_hashes) <= self.group:
            req.window_block_hashes.append([])
        return req.window_block_hashes[self.group]

    def _reset(self, req: Request) -> None:
        self.table(req).clear()
        self.hashes(req).clear()


class HybridBlockManager:
    def __init__(self, num_blocks: int, num_window_groups: int, window: int, block_size: int = 16,
                 enable_prefix_caching: bool = True):  # fmt: skip
        if window < 1:
            raise ValueError(f"the sliding window must be at least 1 token, got {window}")
        if num_window_groups < 1:
            raise ValueError(f"a hybrid pool has at least one sliding group, got {num_window_groups}")
        self.full = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.groups = [_GroupTable(self.full, q) for q in range(num_window_groups)]
        self.window = window
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.track_new_blocks = False  # no KV tier on a hybrid pool

    @property
    def tables(self) -> list[BlockManager]:
        return [self.full, *self.groups]

    # ------------------------------------------------------------ the pool's figures

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.full.num_used_blocks

    @property
    def usage(self) -> float:
        return self.full.usage

    @property
    def num_prefix_queries(self) -> int:
        return self.full.num_prefix_queries

    @property
    def num_prefix_hits(self) -> int:
        return self.full.num_prefix_hits

    @property
    def block_by_hash(self) -> dict[int, int]:
        return self.full.block_by_hash

    def blocks_needed(self, num_tokens: int) -> int:
        return self.full.blocks_needed(num_tokens)

    def window_blocks(self, step_tokens: int) -> int:
        """Most blocks a request's sliding tables hold during a step of ``step_tokens`` new tokens: in every
        group, the blocks of its window before the step and of the step's tokens."""
        return len(self.groups) * (-(-(self.window - 1 + step_tokens) // self.block_size) + 1)

    def num_held_blocks(self, req: Request) -> int:
        return sum(t.num_held_blocks(req) for t in self.tables)

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.full.record_lookup(num_prompt_tokens, num_hit_tokens)

    # ------------------------------------------------------------ prefix cache

    def prefix_hashes(self, req: Request, num_blocks: int) -> list[int]:
        return self.full.prefix_hashes(req, num_blocks)

    def _first_window_block(self, num_tokens: int) -> int:
        """The first table entry a query at position ``num_tokens`` reads."""
        return max(0, num_tokens - self.window + 1) // self.block_size

    def lookup_prefix(self, req: Request) -> PrefixHit:
        """The longest prefix every table holds: global blocks, and each group's blocks its first new query reads."""
        full = self.full.lookup_prefix(req)
        if not full:
            return PrefixHit()
        keys = self.full.prefix_hashes(req, len(full))
        for n in range(len(full), 0, -1):
            first = self._first_window_block(n * self.block_size)
            heads = [[g.block_by_hash.get(h) for h in keys[first:n]] for g in self.groups]
            if all(b is not None for head in heads for b in head):
                return PrefixHit(full[:n], [[FREED_BLOCK] * first + head for head in heads])  # type: ignore[operator]
        return PrefixHit()

    # ------------------------------------------------------------ allocation

    def _heads(self, cached: Sequence[int]) -> list[list[int]]:
        if not cached:
            return [[] for _ in self.groups]
        if not isinstance(cached, PrefixHit) or len(cached.window) != len(self.groups):
            raise ValueError("a hybrid pool's prefix blocks come from its own lookup_prefix")
        return cached.window

    def num_blocks_to_allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> int:
        """Free-list pages ``allocate(req, num_tokens, cached)`` would take, over every table."""
        heads = self._heads(cached)
        need = self.full.num_blocks_to_allocate(req, num_tokens, cached)
        return need + sum(g.num_blocks_to_allocate(req, num_tokens, h) for g, h in zip(self.groups, heads))

    def can_allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        return self.num_blocks_to_allocate(req, num_tokens, cached) <= self.full.num_free_blocks

    def fits_after_preempting(self, req: Request, num_tokens: int, cached: Sequence[int], victims: Sequence[Request]) -> bool:
        need = self.num_blocks_to_allocate(req, num_tokens, cached)
        return need <= self.full.num_free_blocks + sum(self.num_held_blocks(r) for r in victims)

    def allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        if not self.can_allocate(req, num_tokens, cached):
            return False
        heads = self._heads(cached)
        self.full.allocate(req, num_tokens, cached)
        for g, head in zip(self.groups, heads):
            g.allocate(req, num_tokens, head)
        return True

    def free_request(self, req: Request) -> None:
        for t in self.tables:
            t.free_request(req)
        req.window_block_ids, req.window_block_hashes = [], []

    def free_before(self, req: Request, position: int) -> int:
        """Sliding tables only: a global layer reads every key."""
        return sum(g.free_before(req, position) for g in self.groups)

    def trim(self, req: Request, num_tokens: int) -> None:
        for t in self.tables:
            t.trim(req, num_tokens)

    def cache_full_blocks(self, req: Request, num_computed_tokens: int) -> None:
        for t in self.tables:
            t.cache_full_blocks(req, num_computed_tokens)

    def take_newly_cached(self) -> list[tuple[int, int]]:
        return []

    def cached_blocks(self) -> list[tuple[int, int]]:
        return self.full.cached_blocks()

    def check_invariants(self, requests: Iterable[Request] | None = None) -> None:
        """The pool's books: every page held (its ref_count the holders over every table) or free, never both;
        each table's prefix cache names only pages whose key it owns; every table covers the same positions."""
        for t in self.tables:
            t.check_invariants(None)
        if requests is None:
            return
        holders = [0] * self.num_blocks
        for req in requests:
            for t in self.tables:
                t.count_holders(req, holders)
            if req.block_ids and any(len(w) != len(req.block_ids) for w in req.window_block_ids):
                raise AssertionError(f"{req.request_id}: sliding tables {req.window_block_ids} and global "
                                     f"table {req.block_ids} cover different positions")  # fmt: skip
        self.full.check_holders(holders)  # the tables share the pool's ref counts
