"""``sluice bench`` workloads with constrained outputs: ``--constraint json_schema|tools``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from itertools import islice

import pytest

from sluice.bench.client import OpenAIStreamClient, build_body, decode_chunk
from sluice.bench.workload import (
    BENCH_TOOLS,
    Api,
    Constraint,
    RequestSpec,
    WorkloadSpec,
    generate_requests,
    workload_from_dict,
)
from tests.server.conftest import ServerThread
from tests.server.test_structured_api import start_scripted_server


def test_a_constraint_leaves_the_prompts_and_lengths_as_they_were() -> None:
    plain = list(islice(generate_requests(WorkloadSpec(), seed=3), 50))
    mixed = list(islice(generate_requests(WorkloadSpec(constraint=Constraint.TOOLS, constrained_fraction=0.5),
                                          seed=3), 50))  # fmt: skip
    assert [(r.prompt, r.max_tokens, r.priority) for r in plain] == [(r.prompt, r.max_tokens, r.priority) for r in mixed]
    n = sum(r.constraint is Constraint.TOOLS for r in mixed)
    assert 10 < n < 40, f"about half the requests must carry the constraint, got {n} of 50"


def test_the_body_asks_for_the_constraint_in_openai_shapes_and_drops_ignore_eos() -> None:
    spec = RequestSpec(0, "hi", 1, 64, constraint=Constraint.JSON_SCHEMA)
    body = build_body(spec, Api.CHAT, "m", True, {})
    assert body["response_format"]["type"] == "json_schema" and "ignore_eos" not in body
    body = build_body(RequestSpec(0, "hi", 1, 64, constraint=Constraint.TOOLS), Api.CHAT, "m", True, {})
    assert body["tools"] == BENCH_TOOLS and body["tool_choice"] == "required"
    assert build_body(RequestSpec(0, "hi", 1, 64), Api.CHAT, "m", True, {})["ignore_eos"] is True


def test_workload_keys_and_a_tools_workload_needs_chat() -> None:
    kw = workload_from_dict({"constraint": "json_schema", "constrained_fraction": 0.25})
    assert kw == {"constraint": Constraint.JSON_SCHEMA, "constrained_fraction": 0.25}
    with pytest.raises(ValueError, match="chat"):
        WorkloadSpec(api=Api.COMPLETIONS, constraint=Constraint.TOOLS)
    with pytest.raises(ValueError, match="json_schema or tools"):
        workload_from_dict({"constraint": "xml"})


def test_a_streamed_tool_call_counts_as_output() -> None:
    data = json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '{"city": '}}]}}]}).encode()  # fmt: skip
    assert decode_chunk(data).choices[0].output_text() == '{"city": '


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    srv = start_scripted_server()
    yield srv
    srv.stop()


async def test_the_bench_client_sends_a_tools_request_and_times_the_call(server: ServerThread) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    specs = [RequestSpec(0, f"SAY<<{call}>>SAY", 10, 300, constraint=Constraint.TOOLS),
             RequestSpec(1, "ECHO_CONSTRAINT", 10, 300, constraint=Constraint.JSON_SCHEMA)]  # fmt: skip
    async with OpenAIStreamClient(server.url, model="fake") as c:
        recs = [await c.send(s, time.perf_counter()) for s in specs]
    for r in recs:
        assert r.status == 200 and not r.error, r
        assert r.ttft_s is not None and r.num_output_tokens > 0, "a constrained answer must be timed like any other"
