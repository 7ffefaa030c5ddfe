"""The engine core's speculation: one owner for the proposer, the acceptance rates and the counters.

    EngineCore.step():
      speculator.plan(...)          k per running decode (NOTE(adaptive-k)) -> Request.spec_k
      scheduler.schedule(...)       a decode gets 1 + spec_k tokens (blocks for them too)
      speculator.propose(sched)     the drafts -> ScheduledRequest.spec_token_ids (fewer: the step shrinks)
      runner.execute(...)           one sampling row per position (speculator.rows)
      speculator.verify(...)        each request's emitted run (NOTE(coupled-verification))
      scheduler.update_from_output  appends the run, checking stops token by token, gives rejected slots back

The scheduler decides how many tokens a request computes, as before; the
drafts are a decode's extra query tokens.  What is drafted, kept and emitted is
counted here and published in ``EngineStats`` (``spec_*``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sluice.engine.spec.policy import Acceptance, SpecCandidate, choose_k
from sluice.engine.spec.proposer import Proposer
from sluice.engine.spec.verify import accepted_run
from sluice.engine.spec_config import KPolicy, SpeculativeConfig

if TYPE_CHECKING:
    from sluice.engine.protocol import TokenLogprobs
    from sluice.engine.request import Request
    from sluice.engine.sampler import SamplingRow
    from sluice.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
    from sluice.engine.step_model import StepTimeModel
    from sluice.engine.structured import GrammarState

__all__ = ["Speculator", "SpecCounters"]


@dataclass
class SpecCounters:
    """Cumulative; ``EngineStats.spec_*``."""

    num_drafted: int = 0  # draft tokens verified
    num_accepted: int = 0  # ... of them kept
    num_emitted: int = 0  # tokens emitted by steps that verified drafts (kept drafts + the target's own)
    num_verify_runs: int = 0  # (request, step) pairs that verified at least one draft
    num_planned: int = 0  # (request, step) pairs the policy chose k for
    k_counts: list[int] = field(default_factory=list)  # k_counts[k]: how often k was chosen (0: no drafts)


class Speculator:
    def __init__(self, spec: SpeculativeConfig, proposer: Proposer, max_model_len: int | None):
        self.spec = spec
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.acceptance: dict[str, Acceptance] = {}  # request_id -> its running acceptance
        self.counters = SpecCounters(k_counts=[0] * (spec.num_speculative_tokens + 1))
        self._planned: list[Request] = []  # this step's candidates (their spec_k set)

    # ------------------------------------------------------------ before the schedule

    def _max_k(self, req: Request) -> int:
        """Drafts the request may take: the config's k, less what max_tokens and the context leave
        (a step emits at most k + 1 tokens: never more than asked)."""
        sp = req.sampling
        k = min(self.spec.num_speculative_tokens, sp.max_tokens - req.num_output_tokens - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - req.num_tokens - 1)
        return max(0, k)

    def is_candidate(self, req: Request) -> bool:
        # a request with tokens jump-forward appended computes them as its decode chunk this step
        return req.is_prefill_done and req.num_forced_tokens == 0 and not req.is_waiting_for_grammar

    def plan(self, scheduler: Scheduler, step_model: StepTimeModel) -> None:
        """Set ``spec_k`` of every running request (0 for those that do not draft this step)."""
        for req in self._planned:
            req.spec_k = 0
        self._planned = []
        cands = [r for r in scheduler.running if self.is_candidate(r)]
        if not cands:
            return
        max_k = {r.request_id: self._max_k(r) for r in cands}
        if self.spec.k_policy is KPolicy.FIXED:
            k_by_id = max_k
        else:
            # NOTE(adaptive-k): drafts are weighed against the decodes' own step; a prefill chunk beside them
            # is work due anyway, and counting it would make drafts look cheap in every step that has one
            decodes = sum(1 for r in scheduler.running if r.is_prefill_done)
            k_by_id = choose_k(
                [SpecCandidate(r.request_id, int(r.priority), self._acceptance(r).alpha, max_k[r.request_id]) for r in cands],
                base=step_model.base, per_token=step_model.per_token, per_seq=step_model.per_seq,
                num_tokens=decodes, num_seqs=decodes, num_emitted=decodes, draft_cost=self.proposer.draft_cost,
            )  # fmt: skip
        c = self.counters
        for r in cands:
            r.spec_k = k_by_id.get(r.request_id, 0)
            c.num_planned += 1
            c.k_counts[r.spec_k] += 1
        self._planned = cands

    def _acceptance(self, req: Request) -> Acceptance:
        a = self.acceptance.get(req.request_id)
        if a is None:
            a = self.acceptance[req.request_id] = Acceptance()
        return a

    # ------------------------------------------------------------ after the schedule

    def propose(self, sched: SchedulerOutput, generators: dict[str, torch.Generator]) -> None:
        """Draft for the scheduled decodes given draft slots; a request drafted fewer gives its slots back."""
        batch = [(s.request, s.num_spec) for s in sched.scheduled if s.num_spec > 0]
        if not batch:
            return
        drafts = self.proposer.propose(batch, generators)
        for s in sched.scheduled:
            if s.num_spec <= 0:
                continue
            d = drafts.get(s.request.request_id, [])[: s.num_spec]
            g = s.request.grammar
            if g is not None and d:  # NOTE(spec-grammar): the drafts up to the first one the grammar refuses
                if g.num_accepted != s.request.num_output_tokens:  # as the engine's own rows do
                    g.sync(s.request.output_token_ids)
                d = d[: g.matcher.validate_tokens(d)]
            unused = s.num_spec - len(d)
            s.num_new_tokens -= unused
            sched.num_batched_tokens -= unused
            s.num_spec = len(d)
            s.spec_token_ids = d

    def rows(self, s: ScheduledRequest, make_row: Callable[[list[int], int], SamplingRow]) -> list[SamplingRow]:
        """The sampling rows of a drafting request: one per position, each seeing the drafts before it
        (penalties, min_tokens) and recording its generator's state after its draw (NOTE(coupled-verification)).
        ``make_row(token_ids, num_output_tokens)`` builds a row as the engine does without drafts."""
        req = s.request
        states: list[Any] = []
        out = []
        for j in range(s.num_spec + 1):
            row = make_row(req.token_ids + s.spec_token_ids[:j], req.num_output_tokens + j)
            row.states = states
            out.append(row)
        return out

    def grammar_states(self, s: ScheduledRequest) -> list[GrammarState]:
        """A constrained drafting request's grammar state at each of its positions.

        NOTE(spec-grammar): drafts are cut at the first token the grammar refuses before they are
        verified (``propose``), and position j is masked by the state after the drafts before it (a
        copy of the request's matcher that consumed them), so every row samples what the grammar
        allows there, as it would without drafts.  The request's own state takes the emitted run in
        ``update_from_output``.
        """
        from sluice.engine.structured import GrammarState

        g = s.request.grammar
        assert g is not None and g.matcher is not None
        states = [g]
        for j in range(1, s.num_spec + 1):
            st = GrammarState(g.key, g.started, g.jump_forward)
            st.matcher = g.matcher.deep_copy()
            st.matcher.consume_tokens(s.spec_token_ids[:j])
            st.num_accepted = g.num_accepted + j
            states.append(st)
        return states

    def verify(
        self, sched: SchedulerOutput, tokens: list[int], logprobs: list[TokenLogprobs | None],
        rows: list[SamplingRow], generators: dict[str, torch.Generator],
    ) -> tuple[list[int], list[TokenLogprobs | None], dict[str, tuple[list[int], list[TokenLogprobs | None]]]]:  # fmt: skip
        """Per-row samples -> one token per sampling request (what ``update_from_output`` takes) and each
        drafting request's emitted run; a request's generator is set back to after its last emitted draw."""
        first: list[int] = []
        first_lps: list[TokenLogprobs | None] = []
        runs: dict[str, tuple[list[int], list[TokenLogprobs | None]]] = {}
        i = 0
        c = self.counters
        for s in sched.scheduled:
            if not s.samples:
                continue
            n = s.num_spec + 1
            sampled, lps = tokens[i : i + n], logprobs[i : i + n]
            states = rows[i].states
            i += n
            first.append(sampled[0])
            first_lps.append(lps[0])
            if s.num_spec == 0:
                continue
            run = accepted_run(s.spec_token_ids, sampled)
            runs[s.request.request_id] = (run, lps[: len(run)])
            gen = generators.get(s.request.request_id)
            if gen is not None and states:
                gen.set_state(states[len(run) - 1])
            c.num_drafted += s.num_spec
            c.num_accepted += len(run) - 1
            c.num_emitted += len(run)
            c.num_verify_runs += 1
        return first, first_lps, runs

    def observe(self, sched: SchedulerOutput, runs: dict[str, tuple[list[int], list[TokenLogprobs | None]]]) -> None:
        """Feed each scheduled decode's outcome to its acceptance and the proposer."""
        for s in sched.scheduled:
            req = s.request
            if not s.samples or req.request_id not in self.acceptance and s.num_spec == 0:
                continue
            run = runs.get(req.request_id)
            accepted = len(run[0]) - 1 if run is not None else 0
            self._acceptance(req).observe(s.num_spec, accepted)
            self.proposer.observe(req, s.num_spec, accepted)

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.acceptance.pop(rid, None)
            self.proposer.forget(rid)

    def has_state(self) -> bool:
        """Whether anything is kept for some request (tests: nothing after every request finished)."""
        p: Any = self.proposer
        return bool(self.acceptance) or bool(getattr(p, "states", None)) or bool(len(getattr(p, "index", ())))

    def make_stats(self) -> dict[str, Any]:
        c = self.counters
        return dict(
            spec_method=self.spec.method.value,
            spec_drafted_tokens=c.num_drafted,
            spec_accepted_tokens=c.num_accepted,
            spec_emitted_tokens=c.num_emitted,
            spec_verify_runs=c.num_verify_runs,
            spec_k_counts=list(c.k_counts),
        )
