"""What a request's new tokens make: the stop rules, the grammar's next step, the ``EngineOutput``.

    tok sampled -> stop_status(req, tok)        EOS / stop id / max_tokens / the context
                -> advance_grammar(req, tok)    the constraint accepts it; jump-forward appends
                                                what it forces next
                -> emit(req, tok, lp)           the output: tokens not yet published, logprobs

The scheduler applies a step (``Scheduler.update_from_output``: progress, blocks,
finishing) and asks an ``OutputMaker`` what each token means and what to publish;
``make_output`` builds every message, aborts' included.  The counters of
constrained tokens live here, where they are counted.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.engine.protocol import EngineError, EngineOutput, TokenLogprobs
from sluice.engine.request import Request, RequestStatus
from sluice.errors import InvalidRequestError

__all__ = ["OutputMaker", "make_output"]


class OutputMaker:
    def __init__(self, eos_token_ids: Sequence[int] = (), max_model_len: int | None = None):
        self.eos_token_ids = tuple(eos_token_ids)  # end a request unless it asks ignore_eos
        self.max_model_len = max_model_len  # prompt + output cap; None: no cap
        self.num_structured_tokens = 0  # output tokens of constrained requests (sampled and forced)
        self.num_jump_forward_tokens = 0  # ... of them appended by jump-forward (NOTE(jump-forward))

    def stop_status(self, req: Request, tok: int) -> RequestStatus | None:
        """How ``req`` ends with its newest token ``tok``; None: it goes on."""
        sp = req.sampling
        n_out = req.num_output_tokens
        is_stop = (not sp.ignore_eos and tok in self.eos_token_ids) or tok in sp.stop_token_ids
        if n_out >= sp.min_tokens and is_stop:
            req.stop_token_id = tok
            return RequestStatus.FINISHED_STOPPED
        if n_out >= sp.max_tokens or self._at_context_end(req):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _at_context_end(self, req: Request) -> bool:
        return self.max_model_len is not None and req.num_tokens >= self.max_model_len

    def run_status(self, req: Request, run: Sequence[int]) -> tuple[int, RequestStatus | None]:
        """Append a drafting decode's run (kept drafts, then the target's token) token by token; (tokens
        appended, how it ends).  A stop inside the run ends the request there and drops the rest
        (NOTE(spec-update) in the scheduler)."""
        status = None
        n = 0
        for tok in run:
            req.token_ids.append(tok)
            n += 1
            status = self.stop_status(req, tok)
            g = req.grammar
            if g is not None and status is not RequestStatus.FINISHED_STOPPED:
                if n == len(run):  # the run's last token: what the grammar forces next is appended (jump-forward)
                    status = self.advance_grammar(req, tok)
                elif not g.accept(tok):  # never: the drafts were validated and every row masked
                    req.error = grammar_error(f"the grammar refused token {tok}: {g.error or 'no reason given'}")
                    status = RequestStatus.FINISHED_ABORTED
                elif g.is_done:
                    status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                break
        return n, status

    def advance_grammar(self, req: Request, tok: int) -> RequestStatus | None:
        """Feed a sampled token to the request's grammar; append what it forces next (jump-forward).

        NOTE(jump-forward): where the grammar admits exactly one continuation (``{"name": "`` of a
        schema), its tokens, as llguidance tokenizes them canonically, are appended at once, up to
        ``max_tokens``: they are output tokens, published with the sampled one, and the next step
        computes them with it as one chunk of several query tokens instead of a decode step each.
        With jump-forward off, the mask allows only the first of those tokens each step, so the
        tokens are the same either way; jump-forward saves the steps (docs/structured_outputs.md).
        """
        g = req.grammar
        assert g is not None
        if not g.accept(tok):
            req.error = grammar_error(f"the grammar refused token {tok}: {g.error or 'no reason given'}")
            return RequestStatus.FINISHED_ABORTED
        if g.is_done:  # complete: nothing but EOS may follow
            return RequestStatus.FINISHED_STOPPED
        if not g.jump_forward:
            return None
        sp = req.sampling
        room = sp.max_tokens - req.num_output_tokens
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - req.num_tokens)
        forced = g.forced()[: max(0, room)]
        if forced:
            g.accept_forced(forced)
            req.token_ids.extend(forced)
            req.num_forced_tokens = len(forced)
            self.num_jump_forward_tokens += len(forced)
            if g.is_done:
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or self._at_context_end(req):
            return RequestStatus.FINISHED_LENGTH
        return None

    def emit(self, req: Request, tok: int, lp: TokenLogprobs | None) -> EngineOutput:
        """The output of a sampled token ``tok``: with the tokens jump-forward put before and after it."""
        new = self._unpublished(req)
        if len(new) == 1:
            return make_output(req, new, [lp] if lp is not None else None)
        lps = None
        if lp is not None:  # a forced token is the only one its masked distribution allows: logprob 0
            at = len(new) - 1 - req.num_forced_tokens  # the sampled token, before the forced ones after it
            lps = [lp if j == at else _forced_logprob(req, t) for j, t in enumerate(new)]
        return make_output(req, new, lps)

    def emit_run(self, req: Request, lps: list[TokenLogprobs | None]) -> EngineOutput:
        """The output of an emitted run (and of the tokens jump-forward appended after it: logprob 0)."""
        new = self._unpublished(req)
        kept = [lp for lp in lps if lp is not None]
        if not kept or len(kept) != len(lps):
            return make_output(req, new, None)
        kept += [_forced_logprob(req, t) for t in new[len(kept) :]]
        return make_output(req, new, kept)

    def _unpublished(self, req: Request) -> list[int]:
        """The request's output tokens not published yet, now marked published."""
        new = req.token_ids[req.num_prompt_tokens + req.num_emitted :]
        req.num_emitted = req.num_output_tokens
        if req.grammar is not None:
            self.num_structured_tokens += len(new)
        return new


def _forced_logprob(req: Request, tok: int) -> TokenLogprobs:
    return TokenLogprobs(tok, 0.0, [(tok, 0.0)] if (req.sampling.logprobs or 0) > 0 else [])


def make_output(req: Request, new_token_ids: list[int], logprobs: list[TokenLogprobs] | None = None) -> EngineOutput:
    """The message publishing ``new_token_ids`` of ``req`` (its end too, once it is finished)."""
    out = EngineOutput(
        request_id=req.request_id,
        new_token_ids=new_token_ids,
        logprobs=logprobs,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(0, req.num_cached_tokens),
        num_generated_tokens=req.num_output_tokens,
        num_preemptions=req.num_preemptions,
    )
    if req.error is not None:
        out.error = req.error
    if req.status.is_finished:
        out.finished = True
        out.finish_reason = req.status.finish_reason
        out.stop_token_id = req.stop_token_id
        out.timings = req.timings
    elif new_token_ids and req.num_output_tokens == len(new_token_ids):
        out.timings = req.timings  # the first token(s; with the ones jump-forward put first): stage timings so far
    return out


def grammar_error(message: str) -> EngineError:
    return EngineError.from_exception(InvalidRequestError(message, param="structured_outputs"))
