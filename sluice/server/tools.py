"""Tool calling: the prompt that offers tools, the grammar that holds calls to them, the parser that reads them.

One call format on every model (the Hermes / Qwen format):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

NOTE(tool-format): the format is written into the prompt and into the grammar,
so what the model is told, what it may produce and what is parsed always agree:

- a chat template that takes ``tools`` and itself describes this format (it
  renders ``<tool_call>``, as Qwen2.5's and Hermes' do) gets the tools, the
  assistant ``tool_calls`` and the ``tool`` messages as they are;
- any other template (SmolLM2's, a template for another call format) gets the
  default tool prompt (``DEFAULT_TOOL_PROMPT``) in its system message, earlier
  calls as the assistant's text in this format and tool results as user turns
  wrapped in ``<tool_response>``.

NOTE(tool-grammar): the calls are constrained by an llguidance Lark grammar whose
arguments are ``%json {the function's parameters}``, so they always parse and
match the schema.  ``required`` / a named function: the answer is one call (or,
with ``parallel_tool_calls``, one or more).  ``auto``: free text that never
contains ``<tool_call>``, or such text followed by calls; the trigger is a lazy
lexeme, so a call may start anywhere and is held to the grammar from its first
token.  ``none``: no tools in the prompt, no grammar.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sluice.errors import InvalidRequestError
from sluice.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool

__all__ = [
    "CALL_OPEN",
    "CALL_CLOSE",
    "DEFAULT_TOOL_PROMPT",
    "ToolPlan",
    "ToolCallParser",
    "CallDelta",
    "ParsedCalls",
    "plan_tools",
    "template_messages",
    "template_is_native",
    "tool_grammar",
    "parse_tool_calls",
]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_HEAD = '\n{"name": "'  # after CALL_OPEN
_MID = '", "arguments": '  # between the name and the arguments
_TAIL = "}\n" + CALL_CLOSE  # after the arguments
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
# no free whitespace inside the arguments, as for the engine's JSON schemas (NOTE(json-whitespace)
# in sluice.engine.structured): a small model given it runs on in newlines until max_tokens
_ARGS_FORMAT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}

DEFAULT_TOOL_PROMPT = """You can call functions to help answer. They are described here as JSON schemas:
<tools>
{tools}
</tools>
To call a function, answer with a JSON object holding its name and arguments between tags, like this:
<tool_call>
{{"name": "<function name>", "arguments": {{<the arguments as a JSON object>}}}}
</tool_call>
{choice}"""

_CHOICE_LINE = {
    "auto": "Call a function only when it helps; otherwise answer the user directly.",
    "required": "You must call at least one of the functions.",
}


@dataclass
class ToolPlan:
    """What a chat request's tools ask of the prompt, the grammar and the answer."""

    tools: list[Tool]  # offered in the prompt (empty with tool_choice 'none')
    choice: str  # 'auto' | 'required' | 'named'
    named: str | None = None  # the function, with choice 'named'
    parallel: bool = True  # more than one call per answer


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """Check the request's tools and tool_choice; None when no tool may be called."""
    tools = req.tools or []
    for i, t in enumerate(tools):
        if not _NAME.match(t.function.name):
            raise InvalidRequestError(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {t.function.name!r}",
                param=f"tools[{i}].function.name",
            )
        p = t.function.parameters
        if p is not None and p.get("type", "object") != "object":
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema of type 'object'",
                                      param=f"tools[{i}].function.parameters")  # fmt: skip
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct function names", param="tools")
    choice = req.tool_choice
    if choice is None:
        choice = "auto"
    if not tools:
        if choice != "none" and req.tool_choice is not None:
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools {names}",
                                      param="tool_choice")  # fmt: skip
        return ToolPlan(tools, "named", name, parallel=False)
    return ToolPlan(tools, choice, parallel=req.parallel_tool_calls)


# -- grammar -----------------------------------------------------------------------


def _parameters(t: Tool) -> dict[str, Any]:
    p = t.function.parameters
    schema: dict[str, Any] = _closed(p) if p is not None else {"type": "object", "properties": {},
                                                                 "additionalProperties": False}  # fmt: skip
    schema.setdefault("type", "object")  # arguments are an object even when the schema leaves the type out
    schema["x-guidance"] = {**_ARGS_FORMAT, **schema.get("x-guidance", {})}
    return schema


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def _closed(schema: Any) -> Any:
    """A copy of ``schema`` whose objects with ``properties`` and no ``additionalProperties`` are closed.

    NOTE(closed-args): JSON Schema lets an object hold properties it does not name, and a
    small model given that freedom fills the arguments with made-up keys (SmolLM2 copies the
    schema's own keywords) until max_tokens.  An argument object holds only the properties its
    schema names unless the schema says otherwise: still valid against the schema, and what
    OpenAI's ``strict`` function calling requires anyway.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _closed(v) for name, v in out[k].items()}
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_closed(v) for v in out[k]]
    if isinstance(out.get("items"), dict):
        out["items"] = _closed(out["items"])
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_grammar(plan: ToolPlan) -> str:
    """The llguidance Lark grammar for the answer (NOTE(tool-grammar))."""
    q = json.dumps
    fns = [t for t in plan.tools if plan.named is None or t.function.name == plan.named]
    lines = ["%llguidance {}"]
    if plan.choice == "auto":
        lines += [f"start: TEXT | lead {'calls' if plan.parallel else 'body'}",
                  f"lead[lazy]: TEXT {q(CALL_OPEN)}"]  # fmt: skip
    else:
        lines.append(f"start: {q(CALL_OPEN)} {'calls' if plan.parallel else 'body'}")
    lines.append(f"calls: body ({q(chr(10) + CALL_OPEN)} body)*")
    lines.append("body: " + " | ".join(f"fn_{i}" for i in range(len(fns))))
    for i, t in enumerate(fns):
        lines.append(f"fn_{i}: {q(_HEAD + t.function.name + _MID)} args_{i} {q(_TAIL)}")
        lines.append(f"args_{i}: %json {json.dumps(_parameters(t))}")
    # any text that does not contain the trigger (NOTE(tool-grammar))
    lines.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(CALL_OPEN)}(?s:.*)/")
    return "\n".join(lines) + "\n"


# -- prompt ------------------------------------------------------------------------


def _call_text(name: str, arguments: str) -> str:
    try:
        args = json.dumps(json.loads(arguments))
    except ValueError:
        args = arguments  # replayed as sent
    return f"{CALL_OPEN}{_HEAD}{name}{_MID}{args}{_TAIL}"


def _tool_prompt(plan: ToolPlan) -> str:
    tools = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in plan.tools)
    line = _CHOICE_LINE.get(plan.choice, f"You must call the function {plan.named}.")
    return DEFAULT_TOOL_PROMPT.format(tools=tools, choice=line)


def template_messages(
    req: ChatCompletionRequest, plan: ToolPlan | None, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages for the chat template and the tools to pass to it (None: pass none).

    ``native``: the template takes tools and describes this module's call format (NOTE(tool-format)).
    """
    if native:
        msgs = [_native(m) for m in req.messages]
        return msgs, [t.model_dump(exclude_none=True) for t in plan.tools] if plan else None
    out: list[dict[str, Any]] = []
    for m in req.messages:
        if m.role == "tool":
            text = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1].get("is_tool_turn"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "is_tool_turn": True})
            continue
        content = m.text()
        if m.tool_calls:
            calls = "\n".join(_call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m.role, "content": content})
    for d in out:
        d.pop("is_tool_turn", None)
    if plan is not None:
        prompt = _tool_prompt(plan)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _native(m: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                           for c in m.tool_calls]  # fmt: skip
    if m.role == "tool" and m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    return d


def _json_or_text(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        return s


PROBE_NAME = "sluice_probe_function"


def template_is_native(render: Callable[[list[dict[str, Any]], list[dict[str, Any]]], str]) -> bool:
    """Whether a chat template takes tools and describes calls as ``<tool_call>`` (NOTE(tool-format))."""
    probe = [{"type": "function", "function": {"name": PROBE_NAME, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    try:
        text = render([{"role": "user", "content": "hi"}], probe)
    except Exception:  # noqa: BLE001 -- a template that chokes on tools does not take them
        return False
    return PROBE_NAME in text and CALL_OPEN in text


# -- answers -----------------------------------------------------------------------


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class CallDelta:
    """One streamed change to a call: its start (id and name) or a fragment of its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": self.arguments}
        d: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            d["id"], d["type"] = self.id, "function"
            fn["name"] = self.name
        d["function"] = fn
        return d


@dataclass
class ParsedCalls:
    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI message.tool_calls entries


class ToolCallParser:
    """Streamed answer text -> content text and tool-call deltas (one parser per choice).

    States: ``text`` (content; a tail that could begin ``<tool_call>`` is held back),
    ``head`` (inside a call, before its arguments), ``args`` (argument fragments; the
    tail from the last ``}`` on is held back, since the call's own closing ``}`` is the
    last one before ``</tool_call>``), ``done`` (the answer is over: the rest is ignored).

    NOTE(repeated-call): the grammar lets a call be followed by another one or by the
    end, and a model with no tool training (SmolLM2) goes on repeating its call until
    max_tokens.  A call identical to an earlier one (same name, same arguments) ends the
    answer: it is dropped, ``is_done`` turns True and the generation stops it (finish
    reason ``tool_calls``).  So that a dropped call was never shown, the first call
    streams its arguments in fragments and each later call comes whole once it closes.
    """

    def __init__(self) -> None:
        self.state = "text"
        self.buf = ""
        self.calls: list[dict[str, Any]] = []  # complete and started calls, OpenAI shape
        self.is_broken = False  # a call's head did not parse (unconstrained output): the rest is content
        self._is_held = False  # the current call is shown only once it closes (NOTE(repeated-call))

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    @property
    def is_done(self) -> bool:
        return self.state == "done"

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Content to show and call deltas, for the next piece of the answer."""
        if self.state == "done":
            return "", []
        self.buf += text
        out_text: list[str] = []
        deltas: list[CallDelta] = []
        while True:
            if self.is_broken:
                out_text.append(self.buf)
                self.buf = ""
                break
            if self.state == "text":
                i = self.buf.find(CALL_OPEN)
                if i == -1 and self.calls and CALL_OPEN.startswith(self.buf.lstrip()):
                    break  # blanks between calls are not content
                if i == -1:
                    hold = _partial_suffix(self.buf, CALL_OPEN)
                    out_text.append(self.buf[: len(self.buf) - hold])
                    self.buf = self.buf[len(self.buf) - hold :]
                    break
                if not (self.calls and not self.buf[:i].strip()):
                    out_text.append(self.buf[:i])
                self.buf = self.buf[i + len(CALL_OPEN) :]
                self.state = "head"
            elif self.state == "head":
                m = _HEAD_RE.match(self.buf)
                if m is None:
                    head = self.buf.lstrip()
                    if (head and not head.startswith("{")) or len(self.buf) > _MAX_HEAD:
                        self.is_broken = True  # not this format (an unconstrained answer): the rest is text
                        self.buf = CALL_OPEN + self.buf
                        continue
                    break
                call_id, name = new_call_id(), str(json.loads(f'"{m.group(1)}"'))
                self._is_held = bool(self.calls)
                self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
                if not self._is_held:
                    deltas.append(CallDelta(len(self.calls) - 1, call_id, name))
                self.buf = self.buf[m.end() :]
                self.state = "args"
            elif self.state == "args":
                fn = self.calls[-1]["function"]
                j = self.buf.find(CALL_CLOSE)
                if j == -1:
                    k = self.buf.rfind("}")  # from the last '}' on may be the call's own closing
                    k = len(self.buf) if k == -1 else k
                    self._args(fn, self.buf[:k], deltas)
                    self.buf = self.buf[k:]
                    break
                tail = self.buf[:j].rstrip()
                if tail.endswith("}"):
                    tail = tail[:-1].rstrip()
                self._args(fn, tail, deltas)
                self.buf = self.buf[j + len(CALL_CLOSE) :].lstrip()
                self.state = "text"
                if self._is_held:
                    self._release(deltas)
            else:  # done
                self.buf = ""
                break
        return "".join(out_text), deltas

    def _args(self, fn: dict[str, Any], piece: str, deltas: list[CallDelta]) -> None:
        if not piece:
            return
        fn["arguments"] += piece
        if self._is_held:
            return
        i = len(self.calls) - 1
        if deltas and deltas[-1].index == i:
            deltas[-1].arguments += piece  # one fragment per call per delta
        else:
            deltas.append(CallDelta(i, arguments=piece))

    def _release(self, deltas: list[CallDelta]) -> None:
        """A held call closed: show it whole, or end the answer if it repeats one (NOTE(repeated-call))."""
        self._is_held = False
        call = self.calls[-1]
        fn = call["function"]
        if any(c["function"] == fn for c in self.calls[:-1]):
            self.calls.pop()
            self.state, self.buf = "done", ""
            return
        i = len(self.calls) - 1
        deltas.append(CallDelta(i, call["id"], fn["name"]))
        if fn["arguments"]:
            deltas.append(CallDelta(i, arguments=fn["arguments"]))

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What was held back, at the end of the answer.

        An answer cut off (max_tokens) in the middle of a later call drops that call, which
        was never shown; the first call, already streamed, keeps its arguments as they stand.
        """
        text, deltas = "", list[CallDelta]()
        if self.is_broken or (self.state == "text" and not (self.calls and CALL_OPEN.startswith(self.buf.lstrip()))):
            text = self.buf
        elif self.state == "args" and self._is_held:
            self.calls.pop()
        elif self.state == "args" and self.buf:
            self._args(self.calls[-1]["function"], self.buf, deltas)
        elif self.state == "head" and not self.calls:  # cut off before a name: show it as text
            text = CALL_OPEN + self.buf
        self.buf, self._is_held = "", False
        return text, deltas


# up to the first character of the arguments (so a streamed call's fragments never start with blanks)
_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_MAX_HEAD = 256  # characters of a call's head (up to its arguments) before it is taken for text


def _partial_suffix(text: str, word: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``word``."""
    for k in range(min(len(text), len(word) - 1), 0, -1):
        if word.startswith(text[-k:]):
            return k
    return 0


def parse_tool_calls(text: str) -> ParsedCalls:
    """A whole answer -> its content and its complete calls (non-streaming responses)."""
    p = ToolCallParser()
    content, _ = p.feed(text)
    rest, _ = p.finish()
    return ParsedCalls(content + rest, p.calls)
