"""Structured outputs and tool calls through ``sluice gateway`` in front of a real ``sluice serve`` (SmolLM2).

The gateway passes the request body through as it is: the official ``openai``
client's ``parse()`` with a pydantic model and a ``tool_choice="required"`` call
(streamed and not) work through it as they do against the server, and a bad
schema's 400 comes back unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.gateway.conftest import gateway_config, serve_gateway
from tests.server.conftest import serve_smollm2_process

pytestmark = pytest.mark.slow

TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now in a timezone.",
                                         "parameters": {"type": "object", "properties": {
                                             "tz": {"type": "string", "enum": ["UTC", "CET", "EST"]}},
                                             "required": ["tz"]}}}  # fmt: skip


class Answer(BaseModel):
    city: str
    country: str
    size: Literal["small", "medium", "large"]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with serve_smollm2_process() as url:
        yield url


def _config(url: str):  # type: ignore[no-untyped-def]
    return gateway_config([url], model="smollm2", timeouts={"connect_s": 2.0, "first_byte_s": 60.0, "idle_s": 60.0})


async def test_parse_and_required_tool_call_through_the_gateway(server_url: str) -> None:
    async with serve_gateway(_config(server_url)) as (url, _app):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = await c.chat.completions.parse(model="smollm2",
                                           messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                                           response_format=Answer, max_tokens=80, temperature=0)  # fmt: skip
        assert isinstance(r.choices[0].message.parsed, Answer), r

        t = await c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Time in Paris?"}],
                                            tools=[TIME], tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=60, temperature=0)  # type: ignore[list-item]  # fmt: skip
        assert t.choices[0].finish_reason == "tool_calls", t
        call = t.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert call.function.name == "get_time"  # type: ignore[union-attr]
        jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])  # type: ignore[index,union-attr]

        async with c.chat.completions.stream(model="smollm2",
                                             messages=[{"role": "user", "content": "Time in New York?"}],
                                             tools=[TIME], tool_choice="required", parallel_tool_calls=False,
                                             max_tokens=60, temperature=0) as s:  # type: ignore[list-item]  # fmt: skip
            final = await s.get_final_completion()
        streamed = final.choices[0].message.tool_calls[0]  # type: ignore[index]
        jsonschema.validate(json.loads(streamed.function.arguments), TIME["function"]["parameters"])  # type: ignore[index,union-attr]

        async with httpx.AsyncClient(timeout=60) as http:
            bad = await http.post(url + "/v1/chat/completions", json={
                "model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}})  # fmt: skip
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "response_format.json_schema.schema", bad.json()
