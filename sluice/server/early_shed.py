"""Answer a request that admission refuses whatever it says before the app reads it.

NOTE(early-shed): under overload most requests end in a 429, and on a small machine every
millisecond of CPU the API process spends on a request it refuses is taken from the engine's steps.
This middleware answers at once what admission would refuse whatever the body says
(``refuse_early``), the class taken from the ``x-priority`` header and capped by the caller's key:

- a class below one being refused for its predicted wait (NOTE(refused-above) in
  sluice.server.admission), before its body is read;
- a class itself refused for its predicted wait in the last ``EARLY_SHED_S``, after its body is read but
  not validated or tokenized: that refusal's best case for a 1-token prompt, less the time since, is
  over the class's bound for the longest prompt the body may hold (``prompt_bound``, ``ChatBound``: a
  token is at least a byte of text, plus what the tokenizer or chat template adds).

What the full path checks first still comes first (503 draining or dead engine, 401, 400 for a bad
class header); what it checks after is skipped, so a request shed early gets the 429 even where its
body would have got 400 or 404 (a retry gets the full path's answer).  A class given in the body only
goes the full path.  Counted and logged as the full path counts it (``"early_shed": true``), no trace
span.  P0 is never refused this way.  What it saves: docs/design/overload.md, "Early shedding".
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.errors import OverloadedError, SluiceError
from sluice.http_errors import error_response
from sluice.obs.logging import REQUEST_LOGGER
from sluice.types import Priority, parse_priority

if TYPE_CHECKING:
    from sluice.auth import KeyInfo
    from sluice.server.codec import TextCodec
    from sluice.server.state import ServerState

__all__ = ["ChatBound", "EarlyShedMiddleware", "ROUTES", "prompt_bound"]

ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
SPECIAL_TOKENS = 4  # at most this many tokens a tokenizer adds to a completion prompt (BOS, EOS)
request_log = logging.getLogger(REQUEST_LOGGER)


class EarlyShedMiddleware:
    """NOTE(early-shed): a 429 before the body is read, for a request that admission refuses whatever it says."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app, self.state = app, state
        self._chat = ChatBound()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        caller = self._caller(scope) if scope["type"] == "http" and scope["method"] == "POST" else None
        if caller is not None:
            key, priority = caller
            admission = self.state.admission
            refused = admission.refuse_early(priority)
            if refused is None and admission.has_floor(priority):
                body, receive = await _buffered(receive, self.state.settings.max_request_bytes)
                bound = None if body is None else self._bound(scope["path"], body)
                if bound is not None:
                    refused = admission.refuse_early(priority, bound)
            if refused is not None:
                await self._answer(scope, receive, send, refused, key, priority)
                return
        await self.app(scope, receive, send)

    def _bound(self, path: str, body: bytes) -> int | None:
        if path == "/v1/completions":
            return prompt_bound(body)
        serving = self.state.serving
        return None if serving is None else self._chat.bound(body, serving.codec)

    def _caller(self, scope: Scope) -> tuple[KeyInfo, Priority] | None:
        """The key and class of a completion request whose class is in its header; None: the full path decides."""
        serving = self.state.serving
        if serving is None or scope["path"] not in ROUTES:
            return None
        header = authorization = None
        for k, v in scope["headers"]:
            if k == b"x-priority":
                header = v.decode("latin-1")
            elif k == b"authorization":
                authorization = v.decode("latin-1")
        if header is None:
            return None
        try:
            serving.check_available()
            key = serving.keys.authenticate(authorization)
            priority = key.cap(parse_priority(header))
        except (SluiceError, ValueError):
            return None  # the full path answers it (503, 401, 400)
        return key, priority

    async def _answer(self, scope: Scope, receive: Receive, send: Send, e: OverloadedError, key: KeyInfo,
                      priority: Priority) -> None:  # fmt: skip
        label, metrics = priority.label, self.state.metrics
        metrics.observe_rejected(label, e.code or "overloaded")
        metrics.count_request(e.status_code, label)
        metrics.observe_slo(label, False)
        meta: dict[str, Any] = scope.get("state", {}).get("sluice", {})  # RequestIdMiddleware's
        request_log.info("request", extra={"fields": {
            "request_id": meta.get("request_id"), "status": e.status_code, "priority": label, "key": key.name,
            "early_shed": True, "error": e.message}})  # fmt: skip
        await error_response(e)(scope, receive, send)  # the full path's 429; RequestIdMiddleware adds the id


class _Completion(msgspec.Struct):
    prompt: str | list[str | int | list[int]] = ""
    n: int = 1


_decode_completion = msgspec.json.Decoder(_Completion)


def prompt_bound(body: bytes) -> int | None:
    """At most how many prompt tokens a completion request's body holds, times its choices (as admission counts
    them); None when the body does not parse (the full path answers it).  A token is at least one byte of text,
    and the tokenizer adds at most ``SPECIAL_TOKENS`` to a text prompt."""
    try:
        req = _decode_completion.decode(body)
    except msgspec.DecodeError:
        return None
    items = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    tokens = sum(len(p.encode()) + SPECIAL_TOKENS if isinstance(p, str) else 1 if isinstance(p, int) else len(p)
                 for p in items)  # fmt: skip
    return max(1, tokens) * max(1, req.n)


class _TextPart(msgspec.Struct):
    text: str = ""


class _Message(msgspec.Struct):
    role: str = "user"
    content: str | list[_TextPart] | None = None


class _Chat(msgspec.Struct):
    messages: list[_Message] = []
    n: int = 1
    add_generation_prompt: bool = True


_decode_chat = msgspec.json.Decoder(_Chat)


class ChatBound:
    """At most how many prompt tokens a chat request's body holds, times its choices; None: the full path decides.

    The chat template's own tokens are those of the same messages with empty contents (rendered and
    tokenized once per sequence of roles, ``MAX_SKELETONS`` of them kept); each content adds at most its
    bytes, and ``JOIN_SLACK`` tokens a message cover a token merged across a content's edges.
    """

    MAX_MESSAGES = 64
    MAX_SKELETONS = 256
    JOIN_SLACK = 4

    def __init__(self) -> None:
        self._skeletons: dict[tuple[tuple[str, ...], bool], int] = {}

    def bound(self, body: bytes, codec: TextCodec) -> int | None:
        try:
            req = _decode_chat.decode(body)
        except msgspec.DecodeError:
            return None
        if not req.messages or len(req.messages) > self.MAX_MESSAGES:
            return None
        key = (tuple(m.role for m in req.messages), req.add_generation_prompt)
        skeleton = self._skeletons.get(key)
        if skeleton is None:
            try:
                text = codec.apply_chat_template([{"role": r, "content": ""} for r in key[0]],
                                                 add_generation_prompt=key[1])  # fmt: skip
                skeleton = len(codec.encode(text, add_special_tokens=False))
            except Exception:  # noqa: BLE001 -- a template that refuses these roles: the full path says why
                return None
            if len(self._skeletons) >= self.MAX_SKELETONS:
                self._skeletons.clear()
            self._skeletons[key] = skeleton
        content = sum(len(m.content.encode()) if isinstance(m.content, str)
                      else sum(len(p.text.encode()) for p in m.content or ())
                      for m in req.messages)  # fmt: skip
        return (skeleton + content + self.JOIN_SLACK * len(req.messages)) * max(1, req.n)


async def _buffered(receive: Receive, limit: int) -> tuple[bytes | None, Receive]:
    """Read the request's body (None: over ``limit`` bytes, or the client went away) and a ``receive`` that
    gives the app the same messages again, then the rest."""
    messages: list[Message] = []
    size, complete = 0, False
    while size <= limit:
        msg = await receive()
        messages.append(msg)
        if msg["type"] != "http.request":
            break
        size += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            complete = size <= limit
            break
    pending = collections.deque(messages)

    async def replay() -> Message:
        return pending.popleft() if pending else await receive()

    return (b"".join(m.get("body", b"") for m in messages) if complete else None), replay
