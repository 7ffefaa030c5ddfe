"""The scheduler's plan of one step, as the model runner and the engine read it.

    SchedulerOutput.scheduled = [ScheduledRequest(req, num_new_tokens), ...]   decodes first, then prefills

Each entry computes ``num_new_tokens`` tokens of its request from ``num_computed_tokens``
on; whether it samples, whether it is a prefill and how many of its slots are drafts
follow from the request's progress when it was planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.engine.request import Request

__all__ = ["ScheduledRequest", "SchedulerOutput"]


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens (drafts included)
    samples: bool = field(init=False)  # a token is sampled: the chunk reaches the last known token
    is_prefill: bool = field(init=False)  # not a one-token decode
    num_spec: int = field(init=False)  # of num_new_tokens, draft slots after its known tokens (speculation)
    spec_token_ids: list[int] = field(init=False, default_factory=list)  # the drafts (the engine's Speculator)

    def __post_init__(self) -> None:
        req = self.request
        self.samples = req.num_computed_tokens + self.num_new_tokens >= req.num_tokens
        self.num_spec = max(0, req.num_computed_tokens + self.num_new_tokens - req.num_tokens)
        # a decode computes its newest token, and the ones jump-forward appended after it (and its drafts)
        self.is_prefill = not (req.is_prefill_done and self.num_new_tokens - self.num_spec <= 1 + req.num_forced_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first, then prefills
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    token_budget: int = 0  # this step's budget (max_num_batched_tokens, or less to bound the step's time)
    express: bool = False  # only P0 prefills, no decodes (NOTE(express-step))
    prefill_tokens_by_priority: list[int] = field(default_factory=lambda: [0, 0, 0])

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
