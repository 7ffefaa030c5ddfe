"""Text <-> tokens for the API process: the one interface the server uses.

``TextCodec`` wraps the model's tokenizer (``sluice.models.tokenizer``): encode,
decode, chat template, and a fresh incremental detokenizer per completion
(UTF-8 safe, stop strings removed).  Tests inject a byte-level fake through
``build_app(codec_factory=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from sluice.engine.stop import Detokenizer

__all__ = ["Detokenizer", "TextCodec", "ModelCodec", "load_codec"]


class TextCodec(Protocol):
    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...

    def detokenizer(
        self, stop: list[str], skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ) -> Detokenizer: ...


class ModelCodec:
    """``TextCodec`` over ``sluice.models.tokenizer`` (the real tokenizer)."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """``tools``: passed to a template that takes them (sluice.server.tools, NOTE(tool-format))."""
        kwargs = {} if tools is None else {"tools": tools}
        return str(self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs))

    def detokenizer(
        self, stop: list[str], skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ) -> Detokenizer:
        det: Detokenizer = self._tok.detokenizer(
            stop=stop, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids
        )
        return det


def load_codec(model: str) -> TextCodec:
    from sluice.models.tokenizer import load_tokenizer

    return ModelCodec(load_tokenizer(model))
