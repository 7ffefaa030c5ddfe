"""apply_output: how one engine output moves a completion's text and ends it (stop strings, engine finishes)."""

from __future__ import annotations

from collections.abc import Sequence

from sluice.engine.protocol import EngineOutput
from sluice.engine.stop import apply_output


class _Detok:
    """Characters are token ids; stops on 'XY' (holds back a trailing 'X')."""

    def __init__(self) -> None:
        self.stopped = False
        self.held = ""

    def push(self, token_ids: Sequence[int]) -> str:
        text = self.held + "".join(chr(t) for t in token_ids)
        if "XY" in text:
            self.stopped, self.held = True, ""
            return text[: text.index("XY")]
        self.held = "X" if text.endswith("X") else ""
        return text[: len(text) - len(self.held)]

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def _out(text: str, finished: bool = False, reason: str | None = None) -> EngineOutput:
    return EngineOutput(request_id="r", new_token_ids=[ord(c) for c in text], finished=finished, finish_reason=reason)


def test_plain_output_is_a_delta_and_not_finished() -> None:
    d = apply_output(_Detok(), _out("ab"))
    assert (d.text, d.finish_reason, d.needs_abort) == ("ab", None, False)


def test_a_stop_string_ends_the_completion_and_asks_to_abort_the_engine_request() -> None:
    det = _Detok()
    assert apply_output(det, _out("aX")).text == "a", "a possible stop-string start is held back"
    d = apply_output(det, _out("Yb"))
    assert (d.text, d.finish_reason, d.needs_abort) == ("", "stop", True)


def test_a_stop_string_in_the_engine_s_last_output_is_still_a_stop_without_abort() -> None:
    d = apply_output(_Detok(), _out("aXY", finished=True, reason="length"))
    assert (d.text, d.finish_reason, d.needs_abort) == ("a", "stop", False)


def test_an_engine_finish_flushes_held_back_text_with_the_engine_s_reason() -> None:
    det = _Detok()
    apply_output(det, _out("a"))
    d = apply_output(det, _out("X", finished=True, reason="length"))
    assert (d.text, d.finish_reason, d.needs_abort) == ("X", "length", False)
