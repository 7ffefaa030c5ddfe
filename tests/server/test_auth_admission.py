"""API keys, tiers, rate limits, body size and admission control over HTTP."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.conftest import scrape, until


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    from tests.server.conftest import start_fake_server

    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(
        "keys:\n"
        "  sk-batch: {tier: p2}\n"
        "  sk-slow: {tier: p1, rpm: 2}\n"
    )
    srv = start_fake_server(api_key=["sk-admin-secret"], keys_file=str(keys), max_request_bytes=2048)
    yield srv
    srv.stop()


def post(srv, body, key=None, **headers):
    if key:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(srv.url + "/v1/completions", json=body, headers=headers, timeout=10)


def test_missing_or_wrong_key_is_401(keyed_server) -> None:
    assert post(keyed_server, {"prompt": "x", "max_tokens": 1}).status_code == 401
    r = post(keyed_server, {"prompt": "x", "max_tokens": 1}, key="sk-wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(keyed_server.url + "/v1/models", timeout=5).status_code == 401
    assert post(keyed_server, {"prompt": "x", "max_tokens": 1}, key="sk-admin-secret").status_code == 200


def test_priority_is_capped_by_the_key_tier(keyed_server) -> None:
    before = scrape(keyed_server.url)
    r = post(keyed_server, {"prompt": "x", "max_tokens": 1}, key="sk-batch", **{"x-priority": "p0"})
    assert r.status_code == 200
    after = scrape(keyed_server.url)
    key = 'sluice_requests_total{priority="p2",status="200"}'
    assert after.get(key, 0) - before.get(key, 0) == 1, "a p2-tier key asking for p0 must run as p2"
    r = post(keyed_server, {"prompt": "x", "max_tokens": 1}, key="sk-admin-secret", **{"x-priority": "p0"})
    assert r.status_code == 200
    assert scrape(keyed_server.url).get('sluice_requests_total{priority="p0",status="200"}', 0) >= 1


def test_rate_limit_is_429_with_retry_after(keyed_server) -> None:
    codes = [post(keyed_server, {"prompt": "x", "max_tokens": 1}, key="sk-slow").status_code for _ in range(3)]
    assert codes[:2] == [200, 200]
    r = post(keyed_server, {"prompt": "x", "max_tokens": 1}, key="sk-slow")
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, "over the limit: 429 + Retry-After"
    assert r.json()["error"]["type"] == "rate_limit_error"


def test_body_over_limit_is_413(keyed_server) -> None:
    r = post(keyed_server, {"prompt": "x" * 5000}, key="sk-admin-secret")
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_keys_never_appear_in_logs(keyed_server, caplog) -> None:
    import logging

    with caplog.at_level(logging.DEBUG, logger="sluice"):
        post(keyed_server, {"prompt": "x", "max_tokens": 1}, key="sk-admin-secret")
        post(keyed_server, {"prompt": "x", "max_tokens": 1}, key="sk-wrong-secret")
    text = "\n".join(f"{r.getMessage()} {getattr(r, 'fields', '')}" for r in caplog.records)
    assert "request" in text
    assert "sk-admin-secret" not in text and "sk-wrong-secret" not in text, "API keys must never be logged"


async def test_full_queue_rejects_at_once_and_sheds_lowest_class_first(server_factory) -> None:
    # one running slot, slow steps: everything else waits in the queue
    srv = server_factory(step_delay=0.05, max_num_seqs=1, max_queued_requests=2)
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        async def go(priority: str, tokens: int = 40):
            return await c.post("/v1/completions", json={"prompt": "x", "max_tokens": tokens},
                                headers={"x-priority": priority})

        running = asyncio.create_task(go("p1"))
        assert await until(lambda: srv.state.client.num_open_requests == 1 and srv.state.admission.num_queued == 0)
        low = [asyncio.create_task(go("p2"))]
        assert await until(lambda: srv.state.admission.num_queued == 1)
        low.append(asyncio.create_task(go("p2")))  # the newest p2
        assert await until(lambda: srv.state.admission.num_queued == 2), "two p2 requests wait"
        r = await go("p2", 1)
        assert r.status_code == 429, "a full queue rejects a same-class request at once"
        assert r.json()["error"]["type"] == "overloaded_error" and "retry-after" in r.headers
        high = asyncio.create_task(go("p0", 1))
        results = await asyncio.gather(running, *low, high)
    codes = [r.status_code for r in results]
    assert codes[0] == 200 and codes[-1] == 200, f"running and p0 requests must succeed: {codes}"
    assert sorted(codes[1:3]) == [200, 429], f"exactly one p2 is shed to admit the p0: {codes}"
    assert results[2].status_code == 429, "the newest of the lowest class is shed first"


def test_openai_client_sees_auth_and_limit_errors(keyed_server) -> None:
    import openai

    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="fake", prompt="x", max_tokens=1)
    big = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="sk-admin-secret", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        big.completions.create(model="fake", prompt="x" * 4000, max_tokens=1)
    assert e.value.status_code == 413
