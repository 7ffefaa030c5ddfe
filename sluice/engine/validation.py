"""Request validation against the served model's limits (torch-free).

One set of checks, three callers: the engine core's ``add_request``, the
tests' ``FakeEngineCore`` and the API server's pre-check (which answers 400 at
once instead of after a round trip to the engine core).  All limits come from
``ModelInfo``, which the engine core publishes when it is ready.

    validate_prompt   empty prompt, token ids outside the vocabulary, a prompt
                      that leaves no room for output
    validate_request  validate_prompt + sampling values + prompt + max_tokens
                      against the context window and the whole KV cache,
                      priority class
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.engine.config import ModelInfo
from sluice.engine.protocol import SamplingParams
from sluice.errors import ContextLengthError, InvalidRequestError

__all__ = ["validate_prompt", "validate_request"]


def validate_prompt(prompt_token_ids: Sequence[int], info: ModelInfo) -> None:
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    lo, hi = min(prompt_token_ids), max(prompt_token_ids)
    if lo < 0 or hi >= info.vocab_size:
        raise InvalidRequestError(
            f"prompt token ids must be in [0, {info.vocab_size}), got {lo if lo < 0 else hi}", param="prompt"
        )
    if n >= info.max_model_len:
        raise ContextLengthError(
            f"this model's maximum context length is {info.max_model_len} tokens; "
            f"the prompt has {n} tokens (at least one must be left for the output)"
        )


def validate_request(
    prompt_token_ids: Sequence[int], sampling: SamplingParams, info: ModelInfo, priority: int = 1
) -> None:
    """Raise ``InvalidRequestError`` / ``ContextLengthError`` unless the engine can serve the request."""
    validate_prompt(prompt_token_ids, info)
    sampling.validate()
    n, max_tokens = len(prompt_token_ids), sampling.max_tokens
    if n + max_tokens > info.max_model_len:
        raise ContextLengthError(
            f"this model's maximum context length is {info.max_model_len} tokens; the prompt ({n} tokens) "
            f"plus max_tokens ({max_tokens}) exceed it: lower max_tokens to at most {info.max_model_len - n}",
            param="max_tokens",
        )
    capacity = info.num_blocks * info.block_size
    if n + max_tokens > capacity:
        # NOTE(kv-capacity): a request that cannot fit the whole KV cache alone
        # would wait forever; reject it up front.
        raise ContextLengthError(
            f"the KV cache holds {capacity} tokens; the prompt ({n} tokens) plus max_tokens "
            f"({max_tokens}) exceed it (raise --kv-cache-memory)",
            param="max_tokens",
        )
    if priority not in (0, 1, 2):
        raise InvalidRequestError(f"invalid priority {priority}: expected 0, 1 or 2", param="priority")
