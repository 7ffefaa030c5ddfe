"""Proposers behind one interface: each drafts up to k tokens for each speculating request.

    make_proposer(spec, ...)  ->  NgramProposer | DraftModelProposer
    propose([(request, k), ...])  -> request_id -> drafts (at most k; [] drafts nothing)
    observe(request, num_drafted, num_accepted)   after verification
    forget(request_id)                            finished or aborted

NOTE(coupled-drafts): a sampled position is verified by sampling it as the
target would without speculation (``spec.verify``): the target's token at
position j is ``argmax p_j / E_j`` with ``E_j`` the j-th exponential noise
vector of the request's own generator.  A draft model that samples its token
at position j with the same ``E_j`` (``argmax q_j / E_j``, peeked from a copy
of the generator) matches the target's token whenever the two distributions
agree under that noise, which is most of the time where ``q`` is close to
``p``; greedy requests draft the argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sluice.engine.spec.ngram import NgramIndex, propose_ngram
from sluice.engine.spec_config import SpecMethod, SpeculativeConfig

if TYPE_CHECKING:
    from sluice.engine.request import Request
    from sluice.engine.spec.draft import DraftModel

__all__ = ["Proposer", "NgramProposer", "DraftModelProposer", "make_proposer"]


class Proposer:
    method: SpecMethod

    def propose(self, batch: Sequence[tuple[Request, int]], generators: dict[str, torch.Generator]) -> dict[str, list[int]]:
        raise NotImplementedError

    def observe(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """The target accepted ``num_accepted`` of the request's ``num_drafted`` drafts (``num_drafted`` 0: it drafted nothing)."""

    def forget(self, request_id: str) -> None:
        """The request finished: drop what is kept for it."""

    @property
    def draft_cost(self) -> Callable[[int, int], float] | None:
        """(depth, rows) -> seconds of drafting (NOTE(adaptive-k)); None: free."""
        return None


class NgramProposer(Proposer):
    method = SpecMethod.NGRAM

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.index = NgramIndex()

    def propose(self, batch: Sequence[tuple[Request, int]], generators: dict[str, torch.Generator]) -> dict[str, list[int]]:
        del generators
        out = {}
        for req, k in batch:
            drafts = propose_ngram(self.index.tokens(req.request_id, req.token_ids), k, self.n_min, self.n_max)
            if drafts:
                out[req.request_id] = drafts
        return out

    def forget(self, request_id: str) -> None:
        self.index.forget(request_id)


@dataclass
class _DraftState:
    num_computed: int = 0  # tokens the draft has K/V for
    base: int = 0  # the request's token count when it last drafted
    num_preemptions: int = 0  # its count when the state was made (a preemption freed the draft K/V too)


class DraftModelProposer(Proposer):
    method = SpecMethod.DRAFT_MODEL

    def __init__(self, draft: DraftModel):
        self.draft = draft
        self.states: dict[str, _DraftState] = {}

    def _state(self, req: Request) -> _DraftState:
        st = self.states.get(req.request_id)
        if st is None or st.num_preemptions != req.num_preemptions:
            st = self.states[req.request_id] = _DraftState(num_preemptions=req.num_preemptions)
        return st

    def propose(self, batch: Sequence[tuple[Request, int]], generators: dict[str, torch.Generator]) -> dict[str, list[int]]:
        from sluice.engine.sampler import Sampler

        batch = [(r, k) for r, k in batch if k > 0]
        if not batch:
            return {}
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in batch}
        tokens = {r.request_id: list(r.token_ids) for r, _ in batch}
        noise: dict[str, torch.Generator] = {}  # NOTE(coupled-drafts): a copy of each sampled request's generator
        for r, _ in batch:
            gen = generators.get(r.request_id)
            if not r.sampling.is_greedy and gen is not None:
                noise[r.request_id] = torch.Generator().set_state(gen.get_state())
        depth = 0
        active = list(batch)
        while active:
            rows = []
            for r, _ in active:
                st = self._state(r)
                toks = tokens[r.request_id]
                if depth == 0:
                    st.num_computed = min(st.num_computed, len(toks) - 1)
                    st.base = len(toks)
                start = st.num_computed if depth == 0 else len(toks) - 1
                rows.append((toks, start, len(toks) - start, r.block_ids))
            logits = self.draft.forward(rows)  # (rows, vocab)
            for i, (r, _) in enumerate(active):
                rid = r.request_id
                gen = noise.get(rid)
                if gen is None:  # greedy (or no generator of its own): the draft's argmax
                    tok = int(logits[i].argmax())
                else:
                    probs = Sampler._probs(logits[i : i + 1].cpu(), [r.sampling])[0]
                    e = torch.empty_like(probs).exponential_(1.0, generator=gen)
                    tok = int((probs / e).argmax())
                drafts[rid].append(tok)
                tokens[rid].append(tok)
            depth += 1
            active = [(r, k) for r, k in active if k > depth]
        for r, _ in batch:  # the drafts fed back hold K/V only once the target accepted them (observe)
            st = self._state(r)
            st.num_computed = st.base
        return drafts

    def observe(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        st = self.states.get(req.request_id)
        if st is None or num_drafted <= 0:
            return
        # valid draft K/V: the tokens it drafted from, and the accepted drafts it fed back (all but its last)
        st.num_computed = st.base + min(num_accepted, num_drafted - 1)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    @property
    def draft_cost(self) -> Callable[[int, int], float] | None:
        return self.draft.cost


def make_proposer(spec: SpeculativeConfig, load_draft: Callable[[str], DraftModel]) -> Proposer:
    """The config's proposer; ``load_draft(model)`` builds a draft model (the engine's, with its block count)."""
    if spec.method is SpecMethod.NGRAM:
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    assert spec.model is not None
    return DraftModelProposer(load_draft(spec.model))
