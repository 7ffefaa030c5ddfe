"""Tool calling through the OpenAI API of ``sluice serve`` (sluice.server.tools).

Fast tests: the grammar (checked with llguidance on SmolLM2's tokenizer), the
call parser, and the server on a scripted fake engine (tests/server/scripted_fake.py:
``SAY<<...>>SAY`` scripts the answer, ``ECHO_CONSTRAINT`` / ``ECHO_PROMPT`` show what
reached the engine).  Slow tests: ``sluice serve --model smollm2``, where every
``required`` / named call must parse and match its function's schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from sluice.server.protocol import ChatCompletionRequest
from sluice.server.tools import (
    CALL_OPEN,
    ToolCallParser,
    parse_tool_calls,
    plan_tools,
    tool_grammar,
)
from tests.server.conftest import ServerThread
from tests.server.test_structured_api import smollm2_url, start_scripted_server  # noqa: F401 -- fixture

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now in a timezone.",
                                         "parameters": {"type": "object", "properties": {
                                             "tz": {"type": "string", "enum": ["UTC", "CET"]}},
                                             "required": ["tz"]}}}  # fmt: skip


def call_text(name: str, args: dict[str, Any]) -> str:
    return f'{CALL_OPEN}\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


# -- grammar (llguidance on SmolLM2's tokenizer) ------------------------------------


@pytest.fixture(scope="module")
def matcher_for() -> Any:
    import llguidance
    import llguidance.hf

    from sluice.models.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2")
    lltok = llguidance.hf.from_tokenizer(tok.hf)

    def accepts(body: dict[str, Any], text: str) -> tuple[bool, bool]:
        """(every token of ``text`` allowed, grammar complete after it)"""
        plan = plan_tools(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                                 **body}))  # fmt: skip
        assert plan is not None
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(tool_grammar(plan)))
        assert not m.is_error(), m.get_error()
        ok = m.consume_tokens(tok.encode(text, add_special_tokens=False))
        return ok and not m.is_error(), m.is_accepting()

    return accepts


def test_required_grammar_takes_only_calls_whose_arguments_match_the_schema(matcher_for: Any) -> None:
    body = {"tools": [WEATHER, TIME], "tool_choice": "required"}
    assert matcher_for(body, call_text("get_weather", {"city": "Paris", "unit": "celsius"})) == (True, True)
    assert matcher_for(body, call_text("get_time", {"tz": "UTC"})) == (True, True)
    assert matcher_for(body, "Hello")[0] is False, "required: plain text must not be allowed"
    assert matcher_for(body, call_text("get_weather", {"city": "Paris", "unit": "kelvin"}))[0] is False, (
        "an argument outside its enum must be masked"
    )
    assert matcher_for(body, call_text("get_weather", {"town": "Paris"}))[0] is False
    assert matcher_for(body, call_text("delete_all", {}))[0] is False, "only the offered functions may be called"
    two = call_text("get_time", {"tz": "UTC"}) + "\n" + call_text("get_time", {"tz": "CET"})
    assert matcher_for(body, two) == (True, True), "parallel_tool_calls (default true) allows several calls"
    assert matcher_for({**body, "parallel_tool_calls": False}, two)[0] is False


def test_named_grammar_calls_only_that_function(matcher_for: Any) -> None:
    body = {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    assert matcher_for(body, call_text("get_time", {"tz": "CET"})) == (True, True)
    assert matcher_for(body, call_text("get_weather", {"city": "Paris", "unit": "celsius"}))[0] is False


def test_arguments_are_an_object_even_without_parameters_or_type(matcher_for: Any) -> None:
    for fn in ({"name": "ping"}, {"name": "ping", "parameters": {}}):
        body = {"tools": [{"type": "function", "function": fn}], "tool_choice": "required"}
        assert matcher_for(body, call_text("ping", {})) == (True, True)
        assert matcher_for(body, '<tool_call>\n{"name": "ping", "arguments": 3')[0] is False
    closed = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}], "tool_choice": "required"}  # fmt: skip
    assert matcher_for(closed, call_text("f", {"a": 1})) == (True, True)
    assert matcher_for(closed, call_text("f", {"a": 1, "zz": 2}))[0] is False, "NOTE(closed-args)"


def test_auto_grammar_allows_text_or_text_then_a_constrained_call(matcher_for: Any) -> None:
    body = {"tools": [WEATHER]}
    assert matcher_for(body, "It is sunny, no tool needed.") == (True, True)
    assert matcher_for(body, "Let me look. " + call_text("get_weather", {"city": "Oslo", "unit": "celsius"})) == (
        True, True)  # fmt: skip
    assert matcher_for(body, "Let me look. " + call_text("get_weather", {"city": 3}))[0] is False, (
        "a call started mid-answer is constrained from its first token"
    )


# -- the parser ----------------------------------------------------------------------


def test_the_streaming_parser_gives_the_same_calls_however_the_text_is_cut() -> None:
    text = "Sure. " + call_text("get_weather", {"city": "Pa}ris {x}", "unit": "celsius"}) + "\n" + call_text(
        "get_time", {"tz": "UTC"})  # fmt: skip
    whole = parse_tool_calls(text)
    assert whole.content == "Sure. " and [c["function"]["name"] for c in whole.calls] == ["get_weather", "get_time"]
    for step in (1, 2, 3, 5, 11):
        p = ToolCallParser()
        content, args = "", ["", ""]
        pieces = [p.feed(text[i : i + step]) for i in range(0, len(text), step)] + [p.finish()]
        for t, deltas in pieces:
            content += t
            for d in deltas:
                args[d.index] += d.arguments
        assert content == whole.content, f"step {step}"
        assert [json.loads(a) for a in args] == [json.loads(c["function"]["arguments"]) for c in whole.calls]
        if step == 1:
            first = [d for _, deltas in pieces for d in deltas if d.index == 0]
            assert len(first) > 10, "the first call's arguments stream as they come, not at the closing brace"


def test_a_repeated_call_ends_the_answer_and_is_dropped() -> None:
    call = call_text("get_time", {"tz": "UTC"})
    p = ToolCallParser()
    shown = [p.feed(call + "\n" + call + "\n" + call_text("get_time", {"tz": "CET"}))]
    assert p.is_done and [json.loads(c["function"]["arguments"]) for c in p.calls] == [{"tz": "UTC"}], (
        "a call identical to an earlier one ends the answer (NOTE(repeated-call))"
    )
    assert {d.index for _, deltas in shown for d in deltas} == {0}, "the repeated call was never shown"


def test_text_that_is_not_a_call_stays_content() -> None:
    for text in ("a < b and <tool", "x <tool_call> is a tag name"):
        parsed = parse_tool_calls(text)
        assert parsed.content == text and not parsed.calls


# -- the server (scripted fake engine) ----------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    srv = start_scripted_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _chat(server: ServerThread, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": "fake", "max_tokens": 3000, **body},
                      timeout=30)  # fmt: skip


def test_required_tool_choice_reaches_the_engine_as_a_call_grammar(server: ServerThread) -> None:
    r = _chat(server, messages=[{"role": "user", "content": "ECHO_CONSTRAINT"}], tools=[WEATHER], tool_choice="required")
    assert r.status_code == 200, r.text
    got = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(got) == {"grammar"} and '"enum": ["celsius", "fahrenheit"]' in got["grammar"], (
        f"the function's parameters must be the grammar's %json, got {got}"
    )


def test_tool_choice_none_sends_no_grammar_and_no_tool_prompt(server: ServerThread) -> None:
    r = _chat(server, messages=[{"role": "user", "content": "ECHO_CONSTRAINT"}], tools=[WEATHER], tool_choice="none")
    assert r.json()["choices"][0]["message"]["content"] == "null"
    r = _chat(server, messages=[{"role": "user", "content": "ECHO_PROMPT"}], tools=[WEATHER], tool_choice="none")
    assert "get_weather" not in r.json()["choices"][0]["message"]["content"], "tool_choice none: no tool prompt"


def test_a_scripted_call_comes_back_as_message_tool_calls(client: openai.OpenAI) -> None:
    say = call_text("get_weather", {"city": "Paris", "unit": "celsius"})
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": f"SAY<<{say}>>SAY"}],
                                       tools=[WEATHER], tool_choice="required")  # type: ignore[list-item]
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.tool_calls is not None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_each_choice_of_n_has_its_own_calls(client: openai.OpenAI) -> None:
    say = call_text("get_time", {"tz": "CET"})
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": f"SAY<<{say}>>SAY"}],
                                       tools=[TIME], tool_choice="required", n=2)  # type: ignore[list-item]
    assert [c.finish_reason for c in r.choices] == ["tool_calls", "tool_calls"]
    ids = [c.message.tool_calls[0].id for c in r.choices]  # type: ignore[index]
    assert len(set(ids)) == 2, "call ids are unique across choices"


def test_auto_text_answer_has_no_tool_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "SAY<<It is sunny.>>SAY"}],
                                       tools=[WEATHER])  # type: ignore[list-item]
    assert r.choices[0].message.content == "It is sunny." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_a_repeated_call_stops_the_generation(client: openai.OpenAI) -> None:
    call = call_text("get_time", {"tz": "UTC"})
    say = "\n".join([call] * 3) + " and then a long tail " * 20
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": f"SAY<<{say}>>SAY"}],
                                       tools=[TIME], tool_choice="required")  # type: ignore[list-item]
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls or []) == 1
    assert r.usage is not None and r.usage.completion_tokens < len(say) // 2, "the engine request must be stopped"


def test_streamed_tool_call_deltas_accumulate_into_the_call(client: openai.OpenAI) -> None:
    say = "Checking. " + call_text("get_weather", {"city": "Oslo", "unit": "celsius"}) + "\n" + call_text(
        "get_time", {"tz": "CET"})  # fmt: skip
    stream = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": f"SAY<<{say}>>SAY"}],
                                            tools=[WEATHER, TIME], stream=True)  # type: ignore[list-item]
    chunks = [c for c in stream if c.choices]
    calls: dict[int, dict[str, Any]] = {}
    firsts = []
    for ch in chunks:
        for tc in ch.choices[0].delta.tool_calls or []:
            if tc.index not in calls:
                firsts.append(tc)
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}  # type: ignore[union-attr]
            calls[tc.index]["arguments"] += tc.function.arguments or ""  # type: ignore[union-attr]
    assert all(f.id and f.function and f.function.name for f in firsts), "a call's first delta carries id and name"
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"city": "Oslo", "unit": "celsius"}, {"tz": "CET"}]
    assert sum(len([tc for tc in ch.choices[0].delta.tool_calls or [] if tc.index == 0]) for ch in chunks) > 2, (
        "the arguments must come in fragments, not in one piece at the end"
    )
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert content == "Checking. "
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_openai_stream_helper_accumulates_a_valid_call(client: openai.OpenAI) -> None:
    say = call_text("get_time", {"tz": "UTC"})
    with client.chat.completions.stream(model="fake", messages=[{"role": "user", "content": f"SAY<<{say}>>SAY"}],
                                        tools=[TIME], tool_choice="required") as s:  # type: ignore[list-item]
        final = s.get_final_completion()
    message = final.choices[0].message
    call = message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"tz": "UTC"}
    assert message.content is None, "a streamed answer with only calls has no content"
    # the next turn sends the message back as the client built it (NOTE(replayed-message))
    messages = [{"role": "user", "content": "SAY<<It is noon.>>SAY"}, message,
                {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]  # fmt: skip
    r = client.chat.completions.create(model="fake", messages=messages, tools=[TIME])  # type: ignore[arg-type,list-item]
    assert r.choices[0].message.content == "It is noon."


def test_a_history_with_calls_and_results_is_rendered_with_the_default_tool_prompt(server: ServerThread) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "user", "content": "ECHO_PROMPT"},
    ]  # fmt: skip
    r = _chat(server, messages=messages, tools=[WEATHER])
    assert r.status_code == 200, r.text
    prompt = r.json()["choices"][0]["message"]["content"].replace("&lt;", "<")
    assert prompt.startswith("<|system|>You can call functions"), "the default tool prompt opens the system turn"
    assert '"name": "get_weather"' in prompt.split("<|user|>")[0], "the tools are described in it"
    assert '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in prompt, (
        "an earlier call is replayed in the call format"
    )
    assert '<|user|><tool_response>\n{"temp": 21}\n</tool_response>' in prompt, "a tool result is a user turn"


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "dependentRequired": {"a": ["b"]}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
])  # fmt: skip
def test_bad_tools_are_a_400_naming_the_parameter(server: ServerThread, body: dict, param: str) -> None:
    r = _chat(server, messages=[{"role": "user", "content": "hi"}], **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# -- SmolLM2 on the real engine (slow) -----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("tool_choice", "parallel"), [
    ("required", False), ({"type": "function", "function": {"name": "get_weather"}}, True), ("required", True),
])  # fmt: skip
def test_smollm2_required_and_named_calls_match_the_schema(smollm2_url: str, tool_choice: Any, parallel: bool) -> None:  # noqa: F811
    c = openai.OpenAI(base_url=smollm2_url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                  tools=[WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=parallel,
                                  max_tokens=80, temperature=0)  # type: ignore[list-item,arg-type]  # fmt: skip
    msg, reason = r.choices[0].message, r.choices[0].finish_reason
    assert msg.tool_calls, r
    # NOTE(smollm2-parallel): with parallel calls allowed SmolLM2 goes on calling with other
    # arguments until max_tokens ('length'); every complete call must still match its schema
    assert reason == "tool_calls" or (parallel and reason == "length"), r
    assert msg.content is None, "a required call leaves no text"
    for call in msg.tool_calls:
        schema = next(t["function"]["parameters"] for t in (WEATHER, TIME) if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.slow
def test_smollm2_streamed_required_call_is_valid(smollm2_url: str) -> None:  # noqa: F811
    c = openai.OpenAI(base_url=smollm2_url + "/v1", api_key="x", max_retries=0, timeout=120)
    with c.chat.completions.stream(model="smollm2", messages=[{"role": "user", "content": "Time in Berlin?"}],
                                   tools=[TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                   temperature=0) as s:  # type: ignore[list-item]  # fmt: skip
        final = s.get_final_completion()
    call = final.choices[0].message.tool_calls[0]  # type: ignore[index]
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])  # type: ignore[index]


@pytest.mark.slow
def test_smollm2_two_turn_tool_loop(smollm2_url: str) -> None:  # noqa: F811
    c = openai.OpenAI(base_url=smollm2_url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=80, temperature=0)  # type: ignore[list-item]  # fmt: skip
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages += [r.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    r2 = c.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=40, temperature=0)  # type: ignore[list-item]
    assert r2.choices[0].message.content or r2.choices[0].message.tool_calls


@pytest.mark.slow
def test_langchain_bind_tools(smollm2_url: str) -> None:  # noqa: F811
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class get_time(BaseModel):  # noqa: N801 -- the tool's name
        """The time now in a timezone."""

        tz: str = Field(json_schema_extra={"enum": ["UTC", "CET"]})

    llm = ChatOpenAI(model="smollm2", base_url=smollm2_url + "/v1", api_key="x", temperature=0, max_tokens=60)  # type: ignore[arg-type]
    msg = llm.bind_tools([get_time], tool_choice="any").invoke("What time is it in Berlin?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_time"  # type: ignore[attr-defined]
    assert msg.tool_calls[0]["args"]["tz"] in ("UTC", "CET")  # type: ignore[attr-defined]


# -- a chat template that takes tools (NOTE(tool-format)) ---------------------------

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_takes_tools_gets_them_and_the_history_as_it_is() -> None:
    from sluice.models.tokenizer import load_tokenizer
    from sluice.server.codec import ModelCodec
    from sluice.server.tools import template_is_native, template_messages

    plain = ModelCodec(load_tokenizer("smollm2"))
    assert not template_is_native(lambda m, t: plain.apply_chat_template(m, tools=t)), (
        "SmolLM2's template ignores tools: it gets the default tool prompt"
    )
    tok = load_tokenizer("smollm2")
    tok.hf.chat_template = HERMES_TEMPLATE
    codec = ModelCodec(tok)
    assert template_is_native(lambda m, t: codec.apply_chat_template(m, tools=t))
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}], "tools": [WEATHER]})  # fmt: skip
    msgs, tools = template_messages(req, plan_tools(req), native=True)
    text = codec.apply_chat_template(msgs, tools=tools)
    assert '"name": "get_weather"' in text.split("</tools>")[0], "the tools go to the template"
    assert "You can call functions" not in text, "no default tool prompt beside the template's own"
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text
