"""One HTTP request's generation: engine outputs in, text deltas out.

A request with several prompts and ``n`` choices each has one engine request
per choice (``<request id>-<choice index>``), all feeding one
``RequestStream``.  ``Generation.deltas()`` yields, per batch of engine
outputs, the ``Delta`` of each choice that moved: new text (incrementally
detokenized, stop strings removed), its logprobs and, at the end, the finish
reason.  A stop string ends a choice here and aborts its engine request.
A choice of a request with tools reads its text through a ``ToolCallParser``:
the delta carries the content and the call deltas, a call that repeats an
earlier one ends the choice like a stop string (NOTE(repeated-call) in
``sluice.server.tools``), and an answer with calls finishes ``tool_calls``.

Cleanup is in one place (``close``): whatever way the generation ends
(finished, error, client gone), unfinished engine requests are aborted so
their KV blocks are freed at the engine's next step.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from sluice.engine.protocol import EngineOutput, RequestTimings, TokenLogprobs
from sluice.engine.stop import Detokenizer, apply_output
from sluice.errors import SluiceError
from sluice.server.engine_client import RequestStream, engine_error
from sluice.server.lanes import AnyClient
from sluice.server.tools import CallDelta, ToolCallParser

__all__ = ["Choice", "Delta", "Generation"]


@dataclass
class Choice:
    index: int
    request_id: str  # engine request id
    prompt_index: int
    detok: Detokenizer
    num_tokens: int = 0  # generated so far (exact: every token the engine produced)
    text: list[str] = field(default_factory=list)  # kept only for non-streaming responses
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # idem
    finish_reason: str | None = None
    timings: RequestTimings | None = None
    first_token_at: float | None = None  # monotonic, API side
    tools: ToolCallParser | None = None  # the answer may hold tool calls

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Delta:
    choice: Choice
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    calls: list[CallDelta] = field(default_factory=list)  # tool-call deltas (the text is then content only)


class Generation:
    def __init__(
        self,
        client: AnyClient,
        stream: RequestStream,
        choices: list[Choice],
        *,
        arrival: float,
        keep_text: bool,
        on_started: Callable[[], None],
        on_choice_done: Callable[[Choice], None],
        priority_label: str = "p1",
        stall_limit: float | None = None,
    ):
        self.priority_label = priority_label
        self.stall_limit = stall_limit  # seconds without output, once started, before it is shed (NOTE(stalled))
        self.client = client
        self.stream = stream
        self.choices = choices
        self.by_request_id = {c.request_id: c for c in choices}
        self.keep_text = keep_text
        self.arrival = arrival  # monotonic, when the HTTP request arrived
        self._on_started = on_started
        self._on_choice_done = on_choice_done
        self.is_started = False
        self._num_done = 0
        self.is_closed = False
        self.last_output_at = arrival  # monotonic, the last output of any choice

    @property
    def is_done(self) -> bool:
        return self._num_done == len(self.choices)

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        while not self.is_done:
            batch = await self.stream.get_batch()
            out: list[Delta] = []
            for item in batch:
                if isinstance(item, SluiceError):
                    raise item
                d = self._apply(item)
                if d is not None:
                    out.append(d)
            if out:
                yield out

    def _apply(self, o: EngineOutput) -> Delta | None:
        c = self.by_request_id.get(o.request_id)
        if c is None or c.is_done:
            return None
        if o.error is not None:
            raise engine_error(o)
        self.last_output_at = time.monotonic()
        if not self.is_started:
            self.is_started = True
            self._on_started()
        if o.timings is not None:
            c.timings = o.timings
        is_first = bool(o.new_token_ids) and c.first_token_at is None
        if is_first:
            c.first_token_at = time.monotonic()
        c.num_tokens += len(o.new_token_ids)
        delta = apply_output(c.detok, o)
        text, reason = delta.text, delta.finish_reason
        if delta.needs_abort:
            self.client.abort([c.request_id])
        calls: list[CallDelta] = []
        if c.tools is not None:
            text, calls = c.tools.feed(text)
            if c.tools.is_done and reason is None:  # NOTE(repeated-call) in sluice.server.tools
                self.client.abort([c.request_id])
                reason = "stop"
            if reason is not None:
                rest, more = c.tools.finish()
                text, calls = text + rest, calls + more
                if c.tools.num_calls and reason == "stop":
                    reason = "tool_calls"  # max_tokens still says 'length'
        lps = o.logprobs
        if self.keep_text:
            c.text.append(text)
            if lps:
                c.logprobs.extend(lps)
        if reason is not None:
            c.finish_reason = reason
            if c.timings is None:
                c.timings = RequestTimings(arrival=self.arrival)
            if c.timings.finished is None:
                c.timings.finished = time.monotonic()
            if c.timings.first_token is None:
                c.timings.first_token = c.first_token_at
            self._num_done += 1
            self._on_choice_done(c)
        elif not text and not lps and not calls and not is_first:
            # NOTE(first-token-delta): the first token always makes a delta, even with no text
            # (a skipped special token, text held back for a stop string or an incomplete
            # UTF-8 sequence): a stream's first chunk marks its TTFT, not the first visible text.
            return None
        return Delta(c, text, lps, reason, calls)

    def is_stalled(self, now: float) -> bool:
        """Started, unfinished, and no output for longer than ``stall_limit`` (NOTE(stalled))."""
        return (self.stall_limit is not None and self.is_started and not self.is_done and not self.is_closed
                and now - self.last_output_at > self.stall_limit)  # fmt: skip

    def close(self) -> None:
        """Abort what is still running (client gone, error, shed); idempotent."""
        if self.is_closed:
            return
        self.is_closed = True
        live = [c.request_id for c in self.choices if not c.is_done]
        if live:
            self.client.abort(live)
        self.client.release(self.stream.request_ids)

    @property
    def num_generated(self) -> int:
        return sum(c.num_tokens for c in self.choices)
