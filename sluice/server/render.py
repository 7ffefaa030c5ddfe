"""OpenAI response shapes for completions and chat completions.

Plain dicts encoded with msgspec (the streaming path runs once per token per
client, so it builds no pydantic objects).  ``Renderer`` is the one interface;
``CompletionRenderer`` and ``ChatRenderer`` are its two shapes.  A chat answer
to a request with tools has its calls (read by the choice's ``ToolCallParser``
in ``sluice.server.generation``) in ``message.tool_calls``, streamed as
OpenAI's deltas: the id and name first, then fragments of the arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from sluice.engine.protocol import TokenLogprobs
from sluice.server.generation import Choice, Delta

__all__ = ["Renderer", "CompletionRenderer", "ChatRenderer", "sse_event", "SSE_DONE"]

_json = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(doc: object) -> bytes:
    return b"data: " + _json.encode(doc) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Renderer:
    object_full = ""
    object_chunk = ""

    def __init__(self, response_id: str, model: str, created: int, token_text: Callable[[int], str]):
        self.id = response_id
        self.model = model
        self.created = created
        self.token_text = token_text  # token id -> its text (for logprobs)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        doc = self._envelope(self.object_full, [self.full_choice(c) for c in choices])
        doc["usage"] = usage(prompt_tokens, sum(c.num_tokens for c in choices))
        return doc

    def chunk(self, d: Delta) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [self.chunk_choice(d)])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        doc = self._envelope(self.object_chunk, [])
        doc["usage"] = usage(prompt_tokens, completion_tokens)
        return doc

    def full_choice(self, c: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, d: Delta) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def _logprobs(self, lps: list[TokenLogprobs] | None, offset: int = 0) -> dict[str, Any] | None:
        if lps is None:
            return None
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets = []
        pos = offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def full_choice(self, c: Choice) -> dict[str, Any]:
        return {
            "index": c.index,
            "text": "".join(c.text),
            "logprobs": self._logprobs(c.logprobs) if c.logprobs else None,
            "finish_reason": c.finish_reason,
        }

    def chunk_choice(self, d: Delta) -> dict[str, Any]:
        return {
            "index": d.choice.index,
            "text": d.text,
            "logprobs": self._logprobs(d.logprobs),
            "finish_reason": d.finish_reason,
        }


class ChatRenderer(Renderer):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._role_sent: set[int] = set()

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, lps: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        if lps is None:
            return None
        content = []
        for lp in lps:
            e = self._entry(lp.token_id, lp.logprob)
            e["top_logprobs"] = [self._entry(t, v) for t, v in lp.top]
            content.append(e)
        return {"content": content}

    def full_choice(self, c: Choice) -> dict[str, Any]:
        text = "".join(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if c.tools is not None and c.tools.calls:
            message["content"] = text if text.strip() else None
            message["tool_calls"] = c.tools.calls
        return {
            "index": c.index,
            "message": message,
            "logprobs": self._logprobs(c.logprobs) if c.logprobs else None,
            "finish_reason": c.finish_reason,
        }

    def chunk_choice(self, d: Delta) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        i = d.choice.index
        if i not in self._role_sent:
            self._role_sent.add(i)
            delta["role"] = "assistant"
        if d.text or "role" in delta:
            # an answer that may be only calls opens with null content, as OpenAI's do
            delta["content"] = d.text or (None if d.choice.tools is not None else "")
        if d.calls:
            delta["tool_calls"] = [c.to_openai() for c in d.calls]
        return {
            "index": i,
            "delta": delta,
            "logprobs": self._logprobs(d.logprobs),
            "finish_reason": d.finish_reason,
        }
