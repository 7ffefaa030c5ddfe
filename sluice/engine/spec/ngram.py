"""N-gram (prompt lookup) drafts: the continuation of the latest earlier occurrence of the sequence's tail.

    tokens   ... the cat sat on the mat . the cat sat | ?
                     ^^^^^^^^^^^ earlier match           the last n tokens ("the cat sat")
    draft    on the mat                                  the k tokens that followed it

The longest tail (``prompt_lookup_max`` tokens) is tried first, down to
``prompt_lookup_min``; among the matches of one length the latest wins (output
that repeats itself repeats what it said last).  It costs no model: numpy
compares the tail with every window of the sequence, which each request keeps
as a growing array (tokens are only ever appended).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["NgramIndex", "propose_ngram"]


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``tokens`` (1-D int array); [] when its tail occurs nowhere before."""
    length = int(tokens.shape[0])
    if k <= 0 or length < n_min + 1:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        tail = tokens[length - n :]
        # windows starting at 0 .. length-n-1: each has at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # (length - n, n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()  # type: ignore[no-any-return]
    return []


class NgramIndex:
    """Each request's tokens as a growing int32 array (appended from ``Request.token_ids`` as they grow)."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}  # request_id -> (buffer, tokens in it)

    def tokens(self, request_id: str, token_ids: Sequence[int]) -> np.ndarray:
        buf, n = self._arrays.get(request_id, (np.empty(0, dtype=np.int32), 0))
        total = len(token_ids)
        if total < n:  # never happens (tokens are only appended); start over rather than be wrong
            buf, n = np.empty(0, dtype=np.int32), 0
        if total > buf.shape[0]:
            grown = np.empty(max(total, 2 * buf.shape[0], 64), dtype=np.int32)
            grown[:n] = buf[:n]
            buf = grown
        if total > n:
            buf[n:total] = token_ids[n:total]
        self._arrays[request_id] = (buf, total)
        return buf[:total]

    def forget(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._arrays)
