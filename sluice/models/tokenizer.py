"""Tokenizers, chat templates and incremental, UTF-8-safe detokenization.

``load_tokenizer(spec)`` accepts the same specs as the engine ('smollm2', a
.gguf file, a HF directory).  For a GGUF file the tokenizer (vocab, merges,
chat template) is built once by transformers from the GGUF metadata and cached
as ``tokenizer.json`` under ``~/.cache/sluice/tokenizers/<file hash>/``, so
later start-ups skip the conversion.

``IncrementalDetokenizer`` turns streamed token ids into text with the Rust
``tokenizers.decoders.DecodeStream`` (a multi-byte character split over tokens
is held until complete), and applies stop strings: text that could be the
start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sluice.errors import InvalidRequestError, ModelLoadError
from sluice.models.source import ModelSource, cache_dir, file_digest, resolve_model

__all__ = ["Tokenizer", "IncrementalDetokenizer", "load_tokenizer"]


class Tokenizer:
    def __init__(self, hf: Any, extra_eos: Sequence[int] = ()):
        self.hf = hf
        self.backend = hf.backend_tokenizer  # tokenizers.Tokenizer (Rust)
        eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
        self.eos_token_ids: list[int] = sorted({int(e) for e in [*eos, *extra_eos]})
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size = len(hf)
        self.has_chat_template = bool(getattr(hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """The text of one token, for logprobs (bytes that are not valid UTF-8 stay escaped)."""
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template: use the completions API", param="messages")
        try:
            return str(
                self.hf.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
                )
            )
        except Exception as e:  # jinja errors on unexpected message shapes
            raise InvalidRequestError(f"cannot apply the chat template: {e}", param="messages") from e

    def detokenizer(
        self, stop: Sequence[str] = (), skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, stop=stop, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)


class IncrementalDetokenizer:
    """Streamed ids -> text deltas, with stop strings removed.

    ``push(ids)`` returns the text that is safe to show now; ``stopped`` turns
    True once a stop string is seen (the text before it has been returned, the
    stop string and anything after it never are); ``flush()`` returns what was
    held back when generation ends for another reason.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ):
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer.backend
        # NOTE(detok-context): a few prompt ids give SentencePiece-style
        # tokenizers the context to keep a leading space on the first word.
        ctx = list(prompt_ids[-4:])
        self._stream = DecodeStream(ctx, skip_special_tokens=skip_special_tokens) if ctx else DecodeStream(
            skip_special_tokens=skip_special_tokens
        )
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._pending = ""
        self.stopped = False
        self.stop_string: str | None = None
        self.text = ""  # everything released so far

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        new = []
        for t in token_ids:
            piece = self._stream.step(self._tok, int(t))
            if piece:
                new.append(piece)
        if not new:
            return ""
        if not self._stop:
            out = "".join(new)
            self.text += out
            return out
        self._pending += "".join(new)
        return self._release()

    def _release(self) -> str:
        p = self._pending
        hit = -1
        for s in self._stop:
            i = p.find(s)
            if i != -1 and (hit == -1 or i < hit):
                hit, self.stop_string = i, s
        if hit != -1:
            out, self._pending, self.stopped = p[:hit], "", True
            self.text += out
            return out
        hold = 0
        for k in range(min(len(p), self._max_stop - 1), 0, -1):
            tail = p[-k:]
            if any(s.startswith(tail) for s in self._stop):
                hold = k
                break
        out = p[: len(p) - hold]
        self._pending = p[len(p) - hold :]
        self.text += out
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        self.text += out
        return out


def _load_hf_tokenizer(folder: Path, gguf_file: str | None = None) -> Any:
    import logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    return AutoTokenizer.from_pretrained(str(folder), **kwargs)


def load_tokenizer(spec: str | ModelSource) -> Tokenizer:
    source = spec if isinstance(spec, ModelSource) else resolve_model(spec)
    try:
        if source.kind == "hf":
            hf = _load_hf_tokenizer(source.path)
        else:
            target = cache_dir() / "tokenizers" / file_digest(source.path)
            if not (target / "tokenizer.json").is_file():
                hf = _load_hf_tokenizer(source.path.parent, gguf_file=source.path.name)
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
                try:
                    hf.save_pretrained(str(tmp))
                    os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
                except OSError:
                    shutil.rmtree(tmp, ignore_errors=True)
            else:
                hf = _load_hf_tokenizer(target)
    except (ModelLoadError, InvalidRequestError):
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer of {source.path}: {type(e).__name__}: {e}") from e
    extra: list[int] = []
    return Tokenizer(hf, extra_eos=extra)
