"""How many tokens each request drafts this step: the most emitted tokens per second of engine time.

NOTE(adaptive-k): a step costs ``a + b * tokens + c * seqs`` (``StepTimeModel``)
plus what the proposer spends (a draft model's own steps; n-gram: nothing).  A
request whose drafts are accepted with probability ``alpha`` each (until the
first rejection) emits ``1 + alpha + ... + alpha^k`` tokens for ``k`` drafts, so
its ``j``-th draft adds ``alpha^j`` expected tokens and costs one more row.  A
draft row is priced as a decode row, ``b + c``: it attends over the whole
context and is sampled (the logits over the vocabulary, the sampler), which is
what the per-sequence term measures (NOTE(per-seq-cost) in step_model); priced
as a prefill token (``b``) drafts looked 8x cheaper than they are and 8
n-gram requests on SmolLM2 ran 25% slower with them than without.  Starting from the step without drafts (``E`` tokens emitted in ``t``
seconds), drafts are added one at a time, P0 first, then by gain, while each
still raises ``E / t``: a draft pays when ``alpha^j * t > E * dt``.  With one
decode on a memory-bound machine ``dt`` is a small share of ``t`` and a
request drafts while its acceptance holds; with many decodes the step is
compute-bound (``E * dt / t`` near 1) and k falls to 0.  ``t`` and ``E`` are
the decodes' own (``a + (b + c) * D`` for ``D`` tokens): the alternative to a
draft is more decode steps of the same requests, and a prefill chunk in the
step is work due anyway (counted in, a 512-token chunk made every draft of 32
decodes look free: k=2.6 at c=32 on SmolLM2, 12% slower than without drafts).

NOTE(k-explore): while every step has the same shape (one decode, step after
step) the step-time model cannot tell ``a`` from ``b`` and charges everything
per token (NOTE(flat-fit)): drafts then look as dear as the step itself and
would never start, and so never give the fit the spread it needs.  So while
the fit is flat, one request (the first in P0-first order) drafts one token a
step: at one decode the step sizes alternate and the fit separates within a few
steps; at many, the one row costs at most its share of the batch.

Each request's ``alpha`` is its decayed count of accepted drafts over drafts
tried up to a rejection (the geometric model's estimate), started from a prior
(``PRIOR_ALPHA``, ``PRIOR_WEIGHT`` pseudo-drafts); a request that drafts
nothing drifts back to the prior, so one bad run does not turn it off for good.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Acceptance", "SpecCandidate", "choose_k", "PRIOR_ALPHA"]

PRIOR_ALPHA = 0.5  # acceptance a request starts from
PRIOR_WEIGHT = 2.0  # ... worth this many drafts
DECAY = 0.9  # per step that drafted: the memory of a request's acceptance (~10 steps)
IDLE_DECAY = 0.98  # per step that drafted nothing: the pull back toward the prior


class Acceptance:
    """A request's running acceptance rate (NOTE(adaptive-k))."""

    __slots__ = ("accepted", "tried")

    def __init__(self) -> None:
        self.accepted = 0.0  # decayed accepted drafts
        self.tried = 0.0  # decayed drafts accepted or first rejected (the geometric model's trials)

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            self.accepted *= IDLE_DECAY
            self.tried *= IDLE_DECAY
            return
        rejected = 1 if num_accepted < num_drafted else 0
        self.accepted = self.accepted * DECAY + num_accepted
        self.tried = self.tried * DECAY + num_accepted + rejected


@dataclass
class SpecCandidate:
    request_id: str
    priority: int  # 0 = P0 (drafts first)
    alpha: float  # its acceptance estimate
    max_k: int  # most drafts it may take (the config's k, less what max_tokens / the context leave)


def choose_k(
    candidates: Sequence[SpecCandidate],
    *,
    base: float,  # a: seconds per step
    per_token: float,  # b: seconds per batched token
    per_seq: float,  # c: seconds per scheduled sequence
    num_tokens: int,  # tokens the step batches without drafts
    num_seqs: int,  # sequences it schedules
    num_emitted: int,  # tokens it emits without drafts (its decodes, and the prefills that finish)
    draft_cost: Callable[[int, int], float] | None = None,  # (draft depth j, rows drafting at depth j) -> seconds
) -> dict[str, int]:
    """request_id -> drafts this step (NOTE(adaptive-k)); requests left out draft nothing.

    ``draft_cost(j, m)``: the proposer's cost of its ``j``-th draft position (1-based) run for ``m``
    requests (a draft model runs one batched step per depth: the first row at a depth pays its
    step's fixed cost, the others one row each); None: drafting is free (n-gram).
    """
    if not candidates or per_token <= 0.0:
        return {}
    if base <= 0.0 and per_seq <= 0.0:  # NOTE(k-explore)
        c = min((c for c in candidates if c.max_k > 0), key=lambda c: (c.priority, -c.alpha), default=None)
        return {} if c is None else {c.request_id: 1}
    t = base + per_token * num_tokens + per_seq * num_seqs
    emitted = float(max(1, num_emitted))
    k_by_id: dict[str, int] = {}
    rows_at_depth: list[int] = []  # rows_at_depth[j-1]: requests drafting a j-th token
    heap: list[tuple[int, float, int, str]] = []  # (priority, -gain of its next draft, index, request_id)
    for i, c in enumerate(candidates):
        if c.max_k > 0 and c.alpha > 0.0:
            heapq.heappush(heap, (c.priority, -c.alpha, i, c.request_id))
    while heap:
        prio, neg_gain, i, rid = heapq.heappop(heap)
        c = candidates[i]
        j = k_by_id.get(rid, 0) + 1
        dt = per_token + per_seq
        if draft_cost is not None:
            m = rows_at_depth[j - 1] if j <= len(rows_at_depth) else 0
            dt += draft_cost(j, m + 1) - (draft_cost(j, m) if m else 0.0)
        gain = -neg_gain
        if gain * t <= emitted * dt:
            continue  # this request's later drafts gain less still: it stops here
        k_by_id[rid] = j
        if j > len(rows_at_depth):
            rows_at_depth.append(0)
        rows_at_depth[j - 1] += 1
        t += dt
        emitted += gain
        if j < c.max_k:
            heapq.heappush(heap, (prio, -(c.alpha ** (j + 1)), i, rid))
    return k_by_id
