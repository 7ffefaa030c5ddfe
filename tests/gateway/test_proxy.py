"""The request path against fake replicas: forwarding, streaming, headers, errors."""

from __future__ import annotations

import json

import httpx

from tests.gateway.conftest import fake_backends, gateway_config, serve_gateway


def _completion(stream: bool = False, **extra: object) -> dict:
    return {"model": "m", "prompt": "hello there", "max_tokens": 8, "stream": stream, **extra}


async def test_forwards_completion_and_tags_replica(http: httpx.AsyncClient) -> None:
    async with fake_backends(2) as fakes, serve_gateway(gateway_config([f.url for f in fakes])) as (url, _):
        r = await http.post(url + "/v1/completions", json=_completion(), headers={"x-request-id": "rid-1"})
        assert r.status_code == 200, f"a healthy replica must answer 200, got {r.status_code}: {r.text}"
        assert r.json()["choices"][0]["text"].startswith("tok0"), "the replica's body must pass through unchanged"
        assert r.headers["x-request-id"] == "rid-1", "x-request-id must be echoed to the client"
        assert r.headers["x-sluice-replica"] in {f.url for f in fakes}, "x-sluice-replica must name the replica"
        served = [f for f in fakes if f.num_requests]
        assert len(served) == 1 and served[0].headers[0]["x-request-id"] == "rid-1", (
            "exactly one replica must get the request, with the client's x-request-id"
        )


async def test_streams_sse_chunks_through(http: httpx.AsyncClient) -> None:
    async with fake_backends(1, output_tokens=5) as fakes, serve_gateway(gateway_config([fakes[0].url])) as (url, _):
        async with http.stream("POST", url + "/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        }) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream"), "SSE content type must pass through"
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", f"the stream must end with [DONE], got {events[-1:]}"
        deltas = [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1]]
        assert deltas == [f"tok{i} " for i in range(5)], f"every chunk must arrive, in order: {deltas}"


async def test_traceparent_forwarded_and_priority_capped(http: httpx.AsyncClient, tmp_path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  sk-batch: {tier: p2}\n")
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with fake_backends(1) as fakes, serve_gateway(
        gateway_config([fakes[0].url], keys_file=str(keys))
    ) as (url, _):
        r = await http.post(
            url + "/v1/completions",
            json=_completion(),
            headers={"authorization": "Bearer sk-batch", "traceparent": tp, "x-priority": "p0"},
        )
        assert r.status_code == 200, r.text
        sent = fakes[0].headers[0]
        assert sent["traceparent"].split("-")[1] == tp.split("-")[1], "the trace id must reach the replica"
        assert sent["x-priority"] == "p2", "a p2-tier key asking for p0 must be capped to p2"
        assert "authorization" not in {k.lower() for k in sent}, "client keys must never be forwarded"


async def test_bad_input_gets_openai_errors(http: httpx.AsyncClient, tmp_path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  sk-a: {tier: p0}\nadmin_keys: [sk-admin]\n")
    async with fake_backends(1) as fakes, serve_gateway(
        gateway_config([fakes[0].url], keys_file=str(keys))
    ) as (url, _):
        auth = {"authorization": "Bearer sk-a"}
        cases = [
            (await http.post(url + "/v1/completions", json=_completion()), 401),
            (await http.post(url + "/v1/completions", json=_completion(), headers={"authorization": "Bearer nope"}), 401),
            (await http.post(url + "/v1/completions", content=b"{not json", headers=auth), 400),
            (await http.post(url + "/v1/completions", json={"prompt": "x"}, headers=auth), 400),
            (await http.post(url + "/v1/completions", json=_completion(model="nope"), headers=auth), 404),
            (await http.post(url + "/v1/completions", json=_completion(stream="yes"), headers=auth), 400),
            (await http.post(url + "/v1/completions", json=_completion(), headers={**auth, "x-priority": "urgent"}), 400),
            (await http.get(url + "/admin/replicas", headers=auth), 403),
            (await http.get(url + "/no/such/route"), 404),
        ]
        for r, want in cases:
            assert r.status_code == want, f"expected {want}, got {r.status_code}: {r.text}"
            err = r.json()["error"]
            assert err["message"] and err["type"], f"errors must be OpenAI-shaped: {r.text}"
        assert fakes[0].num_requests == 0, "rejected requests must never reach a replica"
        r = await http.get(url + "/admin/replicas", headers={"authorization": "Bearer sk-admin"})
        assert r.status_code == 200 and r.json()["replicas"][0]["url"] == fakes[0].url, r.text


async def test_metrics_and_models_endpoints(http: httpx.AsyncClient) -> None:
    async with fake_backends(1) as fakes, serve_gateway(gateway_config([fakes[0].url])) as (url, _):
        await http.post(url + "/v1/completions", json=_completion())
        models = (await http.get(url + "/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["m"], models
        text = (await http.get(url + "/metrics")).text
        for name in (
            "sluice_gateway_requests_total",
            "sluice_gateway_routing_decisions_total",
            "sluice_gateway_added_latency_seconds_bucket",
            "sluice_gateway_breaker_state",
            "sluice_gateway_scrape_age_seconds",
        ):
            assert name in text, f"/metrics must export {name}"
        assert f'sluice_gateway_requests_total{{model="m",replica="{fakes[0].url}",status="200"}} 1.0' in text


async def test_client_disconnect_stops_the_replica_stream(http: httpx.AsyncClient) -> None:
    import asyncio

    async with fake_backends(1, output_tokens=50, tokens_per_s=20) as fakes, serve_gateway(
        gateway_config([fakes[0].url])
    ) as (url, app):
        async with http.stream("POST", url + "/v1/completions", json=_completion(stream=True)) as r:
            async for _ in r.aiter_raw():
                break  # read one chunk, then hang up
        replica = next(iter(app.state.gateway.pool.replicas()))
        for _ in range(40):
            if fakes[0].num_in_flight == 0 and replica.num_inflight == 0:
                break
            await asyncio.sleep(0.05)
        assert fakes[0].num_in_flight == 0, "a client hang-up must close the upstream stream (the replica aborts)"
        assert replica.num_inflight == 0 and replica.inflight_tokens == 0, "the gateway must release its load count"
        assert sum(fakes[0].completed.values()) == 0, "the replica must not finish a stream nobody reads"


async def test_gateway_adds_its_own_span_under_the_clients_trace(http: httpx.AsyncClient) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    async with fake_backends(1) as fakes, serve_gateway(
        gateway_config([fakes[0].url]), tracer_provider=provider
    ) as (url, _):
        r = await http.post(url + "/v1/completions", json=_completion(), headers={"traceparent": f"00-{trace_id}-{parent}-01"})
        assert r.status_code == 200
    spans = [s for s in exporter.get_finished_spans() if s.name == "gateway.route"]
    assert len(spans) == 1, "each routed request must produce one gateway span"
    span = spans[0]
    assert format(span.context.trace_id, "032x") == trace_id, "the gateway span must join the client's trace"
    assert span.parent is not None and format(span.parent.span_id, "016x") == parent
    sent = fakes[0].headers[0]["traceparent"].split("-")
    assert sent[1] == trace_id and sent[2] == format(span.context.span_id, "016x"), (
        "the replica's parent span must be the gateway's span"
    )


async def test_oversized_body_is_refused_with_413(http: httpx.AsyncClient) -> None:
    async with fake_backends(1) as fakes, serve_gateway(
        gateway_config([fakes[0].url], max_request_bytes=1000)
    ) as (url, _):
        r = await http.post(url + "/v1/completions", json=_completion(prompt="x" * 2000), headers={"x-request-id": "big"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        assert r.headers["x-request-id"] == "big", "x-request-id must be echoed on errors too"
        assert fakes[0].num_requests == 0, "an oversized request must not reach a replica"


async def test_rate_limited_key_gets_429_with_retry_after(http: httpx.AsyncClient, tmp_path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  sk-slow: {tier: p1, rpm: 1}\n")
    async with fake_backends(1) as fakes, serve_gateway(
        gateway_config([fakes[0].url], keys_file=str(keys))
    ) as (url, _):
        auth = {"authorization": "Bearer sk-slow"}
        assert (await http.post(url + "/v1/completions", json=_completion(), headers=auth)).status_code == 200
        r = await http.post(url + "/v1/completions", json=_completion(), headers=auth)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
        assert int(r.headers["retry-after"]) >= 1, "a rate-limited client must be told when to retry"
        assert fakes[0].num_requests == 1, "a rate-limited request must not reach a replica"
