"""The OpenAI API of ``sluice serve`` through the official ``openai`` client
(fake engine: deterministic letters, one token per step; see sluice.server.testing)."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from tests.server.conftest import ServerThread, scrape


@pytest.fixture(scope="module")
def client(fake_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def greedy_letters(prompt_ids: list[int], n: int) -> str:
    start = sum(prompt_ids) % 26
    return "".join(chr(97 + (start + i) % 26) for i in range(n))


def test_completion_text_and_exact_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(model="fake", prompt="hello", max_tokens=7, temperature=0)
    ids = [256, *b"hello"]
    assert r.choices[0].text == greedy_letters(ids, 7), "greedy text must be the engine's tokens, detokenized"
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 7, 13), (
        "usage must count the BOS + 5 prompt bytes and every generated token"
    )


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake"]


def test_chat_completion_uses_template_and_reports_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    prompt = "<|user|>hi\n<|assistant|>"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == greedy_letters(list(prompt.encode()), 4)
    assert r.usage.prompt_tokens == len(prompt.encode()), "chat prompt tokens come from the template, no extra BOS"


def test_streaming_chat_deltas_join_to_the_full_text_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = "<|user|>hi\n<|assistant|>"
    assert text == greedy_letters(list(prompt.encode()), 6)
    assert chunks[0].choices[0].delta.role == "assistant", "the first delta must carry the role"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6, "include_usage adds a usage chunk"


def test_streaming_completion_ends_with_done(fake_server: ServerThread) -> None:
    with httpx.stream("POST", fake_server.url + "/v1/completions",
                      json={"prompt": "x", "max_tokens": 3, "stream": True}, timeout=10) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]", "SSE streams must end with data: [DONE]"
    assert len(lines) == 4, f"3 token events + DONE expected, got {lines}"


def test_stop_string_truncates_and_counts_generated_tokens(client: openai.OpenAI) -> None:
    ids = [256, *b"hello"]
    full = greedy_letters(ids, 10)
    stop = full[3:5]
    r = client.completions.create(model="fake", prompt="hello", max_tokens=10, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:3], "text must end before the stop string"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 5, "usage counts the tokens generated up to the stop string"


def test_stop_string_in_stream(client: openai.OpenAI) -> None:
    ids = [256, *b"abc"]
    full = greedy_letters(ids, 12)
    stream = client.completions.create(model="fake", prompt="abc", max_tokens=12, temperature=0,
                                       stop=full[6:8], stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full[:6]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_first_token_makes_a_chunk_even_when_its_text_is_held_back(client: openai.OpenAI) -> None:
    # the first letter could start the stop string, so its text is held back until a later token
    # shows the stop string does not match; the stream's first chunk still comes with the first
    # token (empty text), so a client's TTFT is the engine's, not one step later
    full = greedy_letters([256, *b"abc"], 6)
    stream = client.completions.create(model="fake", prompt="abc", max_tokens=6, temperature=0,
                                       stop=[full[0] + "!"], stream=True)  # fmt: skip
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks]
    assert texts[0] == "", f"the first token's chunk comes at once, with its text held back: {texts}"
    assert "".join(texts) == full and len(chunks) == 6


def test_n_choices_and_prompt_lists(client: openai.OpenAI) -> None:
    r = client.completions.create(model="fake", prompt=["ab", "cd"], n=2, max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == greedy_letters([256, *b"ab"], 3)
    assert r.choices[2].text == greedy_letters([256, *b"cd"], 3)
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 12, "prompts count once, choices add up"


def test_token_id_prompt(client: openai.OpenAI) -> None:
    r = client.completions.create(model="fake", prompt=[104, 105], max_tokens=2, temperature=0)
    assert r.choices[0].text == greedy_letters([104, 105], 2)
    assert r.usage.prompt_tokens == 2


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    kw = dict(model="fake", prompt="s", max_tokens=12, temperature=1.0)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = client.completions.create(seed=8, **kw).choices[0].text
    assert a == b, "the same seed must give the same sample"
    assert a != c, "a different seed should give a different sample (26^12 space)"
    r = client.completions.create(seed=7, n=2, **kw)
    assert r.choices[0].text == a and r.choices[1].text != a, "choice j uses seed + j"


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="fake", prompt="q", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens == list(r.choices[0].text)
    assert lp.token_logprobs == [-0.25] * 3
    assert all(len(t) == 2 for t in lp.top_logprobs), "top_logprobs must have k entries per token"
    assert lp.text_offset == [0, 1, 2]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "q"}],
                                       max_tokens=2, temperature=0, logprobs=True, top_logprobs=1)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == list(r.choices[0].message.content)
    assert all(len(c.top_logprobs) == 1 and c.top_logprobs[0].token == c.token for c in content)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "bogus_field": 1}, 400, "bogus_field"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "x", "model": "nope"}, 404, "model"),
        ({"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
        ({"prompt": "x" * 600}, 400, "prompt"),
        ({"prompt": [1, 99999]}, 400, "prompt"),
        ({"prompt": "x", "priority": "p7"}, 400, "priority"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    ],
)
def test_bad_input_gets_openai_error(fake_server: ServerThread, body: dict, status: int, param: str) -> None:
    r = httpx.post(fake_server.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, f"the error must name the offending parameter: {err}"
    assert err["message"] and err["type"]


def test_context_error_names_the_limits(fake_server: ServerThread) -> None:
    r = httpx.post(fake_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 600}, timeout=10)
    msg = r.json()["error"]["message"]
    assert "512" in msg and "600" in msg, f"the message must name the context window and max_tokens: {msg}"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_invalid_json_and_wrong_shapes(fake_server: ServerThread) -> None:
    for raw in (b"{bad", b"[]", b"null", b'"x"', b""):
        r = httpx.post(fake_server.url + "/v1/chat/completions", content=raw, timeout=10)
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="fake", messages=[], max_tokens=1)


def test_unknown_route_is_openai_404(fake_server: ServerThread) -> None:
    r = httpx.get(fake_server.url + "/v1/nothing", timeout=5)
    assert r.status_code == 404 and "error" in r.json()


def test_request_id_echoed_and_traceparent_continued(fake_server: ServerThread, span_exporter) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = httpx.post(
        fake_server.url + "/v1/completions",
        json={"prompt": "t", "max_tokens": 2, "priority": "p2"},
        headers={"x-request-id": "req-123", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        timeout=10,
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-123", "a client's x-request-id must be echoed"
    assert r.headers["traceparent"].split("-")[1] == trace_id, "the response must continue the client's trace"
    spans = [s for s in span_exporter.get_finished_spans() if s.context.trace_id == int(trace_id, 16)]
    names = {s.name for s in spans}
    assert {"POST /v1/completions", "tokenize", "queue", "prefill", "decode"} <= names, names
    root = next(s for s in spans if s.name == "POST /v1/completions")
    assert root.attributes["sluice.model"] == "fake" and root.attributes["sluice.priority"] == "p2"
    assert root.parent is not None and root.parent.span_id == 0x00F067AA0BA902B7


def test_request_ids_are_generated_when_absent(fake_server: ServerThread) -> None:
    a = httpx.get(fake_server.url + "/health", timeout=5).headers["x-request-id"]
    b = httpx.get(fake_server.url + "/health", timeout=5).headers["x-request-id"]
    assert a and b and a != b


def test_metrics_have_design_names(fake_server: ServerThread) -> None:
    httpx.post(fake_server.url + "/v1/completions", json={"prompt": "m", "max_tokens": 3, "priority": "p0"}, timeout=10)
    m = scrape(fake_server.url)
    for name in (
        'sluice_time_to_first_token_seconds_count{priority="p0"}',
        'sluice_time_per_output_token_seconds_count{priority="p0"}',
        'sluice_e2e_request_latency_seconds_count{priority="p0"}',
        'sluice_queue_time_seconds_count{priority="p0"}',
        "sluice_num_requests_running",
        "sluice_num_requests_waiting",
        "sluice_kv_cache_usage_ratio",
        "sluice_prefix_cache_hits_total",
        "sluice_preemptions_total",
        'sluice_requests_total{priority="p0",status="200"}',
        "sluice_host_cpu_utilization_ratio",
        "sluice_host_memory_used_ratio",
    ):
        assert name in m, f"{name} missing from /metrics"
    assert m['sluice_time_to_first_token_seconds_count{priority="p0"}'] >= 1
    assert 0.0 <= m["sluice_host_memory_used_ratio"] <= 1.0


def test_one_json_log_line_per_request(fake_server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sluice.request"):
        r = httpx.post(fake_server.url + "/v1/completions", json={"prompt": "log", "max_tokens": 2},
                       headers={"x-request-id": "log-1"}, timeout=10)
        assert r.status_code == 200
    recs = [rec for rec in caplog.records if getattr(rec, "fields", {}).get("request_id") == "log-1"]
    assert len(recs) == 1, "exactly one log line per finished request"
    from sluice.obs.logging import JsonFormatter

    doc = json.loads(JsonFormatter().format(recs[0]))
    assert doc["prompt_tokens"] == 4 and doc["completion_tokens"] == 2 and doc["priority"] == "p1"
    assert {"queue_s", "prefill_s", "decode_s", "ttft_s", "e2e_s"} <= doc.keys()


async def test_same_client_request_id_twice_concurrently_keeps_streams_apart(fake_server: ServerThread) -> None:
    import asyncio

    async with httpx.AsyncClient(base_url=fake_server.url, timeout=30) as c:
        a, b = await asyncio.gather(
            c.post("/v1/completions", json={"prompt": "aaaa", "max_tokens": 20, "temperature": 0},
                   headers={"x-request-id": "dup"}),
            c.post("/v1/completions", json={"prompt": "zz", "max_tokens": 20, "temperature": 0},
                   headers={"x-request-id": "dup"}),
        )
    assert a.json()["choices"][0]["text"] == greedy_letters([256, *b"aaaa"], 20)
    assert b.json()["choices"][0]["text"] == greedy_letters([256, *b"zz"], 20), "duplicate ids must not mix outputs"
    assert a.headers["x-request-id"] == b.headers["x-request-id"] == "dup"
