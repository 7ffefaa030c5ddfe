"""A request inside the engine core: its tokens, blocks, progress and timings.

One owner per state (STYLE.md): the scheduler moves requests between queues,
sets ``status``, advances ``num_computed_tokens`` and appends sampled tokens
(``Scheduler.update_from_output``); the block manager owns ``block_ids`` and
``block_hashes``, and takes the token counts it needs as arguments.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sluice.engine.protocol import EngineError, EngineRequest, RequestTimings, SamplingParams
from sluice.types import Priority

if TYPE_CHECKING:
    from sluice.engine.structured import GrammarState

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, its KV freed, to be recomputed
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        priority: Priority = Priority.P1,
        arrival_time: float | None = None,
        trace_id: str | None = None,
        ttft_target: float = 0.0,
        lora_name: str | None = None,
        traceparent: str | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.priority = Priority(priority)
        self.trace_id = trace_id
        self.ttft_target = ttft_target  # seconds after arrival the first token is due; 0: no target
        self.traceparent = traceparent
        self.lora_name = lora_name  # adapter asked for; None: the base model
        self.lora_id = 0  # the adapter's engine id once resolved (``LoRAManager.acquire``); 0: the base model
        # NOTE(lora-prefix): mixed into every block key, so a prefix computed under one
        # adapter never serves another (b"" for the base model; see lora_manager.cache_salt)
        self.cache_salt = b""
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output, grows
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks registered so far
        # NOTE(hybrid-blocks): the sliding-window layers' tables and hashes, one per group of them, where global
        # layers are interleaved (gemma2/3: HybridBlockManager); empty otherwise
        self.window_block_ids: list[list[int]] = []
        self.window_block_hashes: list[list[int]] = []
        self.status = RequestStatus.WAITING
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache; -1: not looked up yet
        self.num_preemptions = 0
        self.stop_token_id: int | None = None
        self.timings = RequestTimings(arrival=arrival_time if arrival_time else time.monotonic())
        self.num_emitted = 0  # output tokens already published
        self.grammar: GrammarState | None = None  # its constraint (SamplingParams.structured), once added
        # NOTE(jump-forward): tokens the grammar forced after the last sampled one, appended to token_ids
        # without a decode step each; the next step computes them with that token, as one chunk
        self.num_forced_tokens = 0
        self.error: EngineError | None = None  # why it was ended, when the engine ended it (its grammar failed)
        self.spec_k = 0  # tokens it may draft this step (set by the engine's Speculator before the schedule)

    @classmethod
    def from_engine_request(cls, req: EngineRequest, clock: Callable[[], float] = time.monotonic) -> Request:
        """The engine's request; one without an arrival time arrives now, by ``clock`` (the engine's)."""
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling,
            Priority(req.priority),
            req.arrival_time or clock(),
            req.trace_id,
            req.ttft_target,
            req.lora_name,
            req.traceparent,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefill_done(self) -> bool:
        # NOTE(decode): a request decodes when only its newest token lacks K/V (and the tokens
        # jump-forward appended after it: they are computed in its next decode step).
        return self.num_computed_tokens >= self.num_tokens - 1 - self.num_forced_tokens

    @property
    def is_waiting_for_grammar(self) -> bool:
        return self.grammar is not None and not self.grammar.is_ready

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.priority.label}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.block_ids)})"
        )
