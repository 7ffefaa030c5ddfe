"""Stop strings: one engine output in, a text delta and how the completion ends out (torch-free).

The engine core stops on token ids; stop *strings* are matched on text, by the
incremental detokenizer of whoever turns tokens into text (the API server's
``Generation``, the offline ``LLM``).  Both apply each engine output through
``apply_output``:

    detok.push(new tokens) ─┬─ a stop string matched -> finish "stop"; the text
                            │    before it is the last delta; abort the engine
                            │    request if the engine has not finished it
                            ├─ the engine finished    -> flush held-back text;
                            │    finish with the engine's reason
                            └─ otherwise              -> the delta, not finished
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sluice.engine.protocol import EngineOutput, FinishReason

__all__ = ["Detokenizer", "TextDelta", "apply_output"]


class Detokenizer(Protocol):
    """Streamed token ids -> text, holding back what could be the start of a stop string."""

    stopped: bool  # a stop string matched: stop generating

    def push(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


@dataclass
class TextDelta:
    text: str  # new text to show (stop strings and what follows them removed)
    finish_reason: str | None  # FinishReason.*, once the completion has ended
    needs_abort: bool  # a stop string ended it first: abort the engine request


def apply_output(detok: Detokenizer, out: EngineOutput) -> TextDelta:
    text = detok.push(out.new_token_ids)
    if detok.stopped:
        return TextDelta(text, FinishReason.STOP, needs_abort=not out.finished)
    if out.finished:
        return TextDelta(text + detok.flush(), out.finish_reason or FinishReason.STOP, needs_abort=False)
    return TextDelta(text, None, needs_abort=False)
