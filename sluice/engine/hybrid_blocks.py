"""Two KV pools for models that interleave sliding-window layers with global ones (gemma2/3).

NOTE(hybrid-blocks): a global layer reads every key of a request, a sliding
layer only the last ``window``.  With one pool every block holds both kinds of
layer, so no block can go back while the request runs (NOTE(window-scope) in
core.py).  Here each kind has its own pool and its own block table:

    global layers:   req.block_ids          [b7 b2 b9 b4 b1]   every block, as for any model
    sliding layers:  req.window_block_ids   [-1 -1 w3 w8 w5]   blocks out of the window freed

Both tables index positions the same way (position p in entry p // 16).  The
sliding pool frees a block once every token in it is out of the window of the
request's next query (``BlockManager.free_before``, NOTE(window-blocks)); the
global pool never frees one early.  So a request holds ``ceil(window / 16) + 1``
sliding blocks however long it runs, and the memory the sliding layers would
have taken for the whole context goes to the global pool (model_runner sizes
the two).

The prefix cache spans both pools with the same keys (the chained hash of the
tokens): a prefix of ``n`` blocks is a hit when the global pool holds all ``n``
and the sliding pool holds the blocks the first new query sees (those in the
window before position ``16 n``); the longest such ``n`` wins.  Speculation's
draft model reads the global table only (its own cache, NOTE(draft-blocks)), so
it drafts beside a hybrid target unchanged.  The KV disk tier copies one pool's
blocks and is not offered with two (core.py falls back to one pool then).

The manager answers the scheduler's calls as a ``BlockManager`` does; an
allocation succeeds only where both pools have room, and changes neither
otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sluice.engine.block_manager import FREED_BLOCK, BlockManager
from sluice.engine.request import Request

__all__ = ["HybridBlockManager", "PrefixHit"]


class PrefixHit(list[int]):
    """A prefix-cache hit: the global pool's blocks (the list) and the sliding table's head (``window``:
    as long as the list, FREED_BLOCK where no query of the request reads)."""

    def __init__(self, blocks: Iterable[int] = (), window: Sequence[int] = ()):
        super().__init__(blocks)
        self.window = list(window)


def _window_head(cached: Sequence[int]) -> list[int]:
    return cached.window if isinstance(cached, PrefixHit) else [FREED_BLOCK] * len(cached)


class HybridBlockManager:
    def __init__(self, num_blocks: int, num_window_blocks: int, window: int, block_size: int = 16,
                 enable_prefix_caching: bool = True):  # fmt: skip
        if window < 1:
            raise ValueError(f"the sliding window must be at least 1 token, got {window}")
        self.full = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.win = BlockManager(num_window_blocks, block_size, enable_prefix_caching, window_table=True)
        self.window = window
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.track_new_blocks = False  # no KV tier with two pools

    # ------------------------------------------------------------ the pools' figures

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def usage(self) -> float:
        """The fuller pool's share in use (the one that turns requests away first)."""
        return max(self.full.usage, self.win.usage)

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

    def num_held_blocks(self, req: Request) -> int:
        return self.full.num_held_blocks(req)

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.full.record_lookup(num_prompt_tokens, num_hit_tokens)

    # ------------------------------------------------------------ prefix cache

    def prefix_hashes(self, req: Request, num_blocks: int) -> list[int]:
        return self.full.prefix_hashes(req, num_blocks)

    def _first_window_block(self, num_tokens: int) -> int:
        """The first table entry a query at position ``num_tokens`` reads."""
        return max(0, num_tokens - self.window + 1) // self.block_size

    def lookup_prefix(self, req: Request) -> PrefixHit:
        """The longest prefix both pools hold: global blocks, and the sliding blocks its first new query reads."""
        full = self.full.lookup_prefix(req)
        if not full:
            return PrefixHit()
        keys = self.win.prefix_hashes(req, len(full))
        for n in range(len(full), 0, -1):
            first = self._first_window_block(n * self.block_size)
            head = [self.win.block_by_hash.get(h) for h in keys[first:n]]
            if all(b is not None for b in head):
                return PrefixHit(full[:n], [FREED_BLOCK] * first + head)  # type: ignore[list-item]
        return PrefixHit()

    # ------------------------------------------------------------ allocation

    def num_blocks_to_allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> int:
        return self.full.num_blocks_to_allocate(req, num_tokens, cached)

    def _window_cached(self, req: Request, cached: Sequence[int]) -> list[int]:
        # a table freed out of the window at its first allocation: a hit's head, else nothing
        return _window_head(cached) if cached else []

    def can_allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        return self.full.can_allocate(req, num_tokens, cached) and self.win.can_allocate(
            req, num_tokens, self._window_cached(req, cached)
        )

    def fits_after_preempting(self, req: Request, num_tokens: int, cached: Sequence[int], victims: Sequence[Request]) -> bool:
        return self.full.fits_after_preempting(req, num_tokens, cached, victims) and self.win.fits_after_preempting(
            req, num_tokens, self._window_cached(req, cached), victims
        )

    def allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        if not self.can_allocate(req, num_tokens, cached):
            return False
        self.full.allocate(req, num_tokens, cached)
        self.win.allocate(req, num_tokens, self._window_cached(req, cached))
        return True

    def free_request(self, req: Request) -> None:
        self.full.free_request(req)
        self.win.free_request(req)

    def free_before(self, req: Request, position: int) -> int:
        """Sliding blocks only: a global layer reads every key."""
        return self.win.free_before(req, position)

    def trim(self, req: Request, num_tokens: int) -> None:
        self.full.trim(req, num_tokens)
        self.win.trim(req, num_tokens)

    def cache_full_blocks(self, req: Request, num_computed_tokens: int) -> None:
        self.full.cache_full_blocks(req, num_computed_tokens)
        self.win.cache_full_blocks(req, num_computed_tokens)

    def take_newly_cached(self) -> list[tuple[int, int]]:
        return []

    def cached_blocks(self) -> list[tuple[int, int]]:
        return self.full.cached_blocks()

    def check_invariants(self, requests: Iterable[Request] | None = None) -> None:
        reqs = list(requests) if requests is not None else None
        self.full.check_invariants(reqs)
        self.win.check_invariants(reqs)
        for r in reqs or ():
            if r.window_block_ids and len(r.window_block_ids) != len(r.block_ids):
                raise AssertionError(f"{r.request_id}: sliding table {r.window_block_ids} and global "
                                     f"table {r.block_ids} cover different positions")  # fmt: skip
