"""``sluice serve`` on the real ``EngineCore`` (tiny random Llama; SmolLM2 once, slow),
driven by the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import aiohttp
import httpx
import openai
import pytest

from sluice.server.app import build_app
from sluice.server.config import load_settings
from tests.server.conftest import ServerThread, scrape, wait_for


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.model_factory import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


@pytest.fixture(scope="module")
def real_server(tiny_model_dir: str) -> Iterator[ServerThread]:
    s = load_settings(model=tiny_model_dir, kv_cache_memory="64MiB", max_model_len=512, max_num_seqs=64)
    srv = ServerThread(build_app(s)).start(timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(real_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_completion_greedy_is_deterministic_with_exact_usage(client: openai.OpenAI, tiny_model_dir: str) -> None:
    from sluice.models.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    prompt = "The quick brown fox"
    a = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0)
    b = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text, "greedy decoding must be deterministic"
    assert a.usage.prompt_tokens == len(tok.encode(prompt))
    assert a.usage.completion_tokens <= 8 and a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    if a.choices[0].finish_reason == "length":
        assert a.usage.completion_tokens == 8


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kw = dict(model="tiny-llama", prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == full, "the stream's deltas must join to the non-streamed text"


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hello!"}], max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6, "ignore_eos: exactly max_tokens"


def test_stop_string_n_and_seed(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny-llama", prompt="a b c", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    if len(base.strip()) >= 4:
        stop = base.strip()[2:4]
        cut = client.completions.create(model="tiny-llama", prompt="a b c", max_tokens=10, temperature=0,
                                        stop=[stop], extra_body={"ignore_eos": True})
        assert stop not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"
        assert base.startswith(cut.choices[0].text)
    kw = dict(model="tiny-llama", prompt="seeded", max_tokens=8, temperature=1.0, n=2)
    r1 = client.completions.create(seed=42, **kw)
    r2 = client.completions.create(seed=42, **kw)
    assert [c.text for c in r1.choices] == [c.text for c in r2.choices], "the same seed reproduces all choices"
    assert len(r1.choices) == 2


def test_logprobs_from_the_engine(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for c in content:
        assert c.logprob <= 0.0 and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.logprob - 1e-4, "greedy picks the best token"


def test_prompt_too_long_is_400_naming_limits(real_server: ServerThread) -> None:
    r = httpx.post(real_server.url + "/v1/completions", json={"prompt": "hi " * 600, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and "512" in r.json()["error"]["message"]


async def test_concurrent_streams_and_disconnects_free_every_block(real_server: ServerThread) -> None:
    url = real_server.url

    async def full(s: aiohttp.ClientSession) -> int:
        body = {"prompt": "tell me", "max_tokens": 8, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        async with s.post(url + "/v1/completions", json=body) as r:
            lines = [line.strip() async for line in r.content if line.startswith(b"data: ")]
            if r.status != 200 or lines[-1] != b"data: [DONE]":
                return -r.status
            # events can be fewer than tokens (a token may complete no character yet): use usage
            return int(json.loads(lines[-2][6:])["usage"]["completion_tokens"])

    async def vanish(s: aiohttp.ClientSession) -> None:
        body = {"prompt": "go on", "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    return

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:
        res = await asyncio.gather(*[full(s) for _ in range(32)], *[vanish(s) for _ in range(16)])
    assert res[:32] == [8] * 32, f"every stream must deliver 8 tokens: {res[:32]}"
    assert wait_for(lambda: scrape(url)["sluice_kv_cache_usage_ratio"] == 0.0
                    and scrape(url)["sluice_num_requests_running"] == 0, 20), "KV blocks must all be freed"


@pytest.mark.slow
def test_make_serve_on_smollm2_starts_fast_and_answers() -> None:
    """The real command on the embedded model: start-up banner, /health, a chat answer."""
    env = {**os.environ, "SLUICE_LOG_LEVEL": "warning"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "serve", "--model", "smollm2", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = None
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"ready in .* at (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "".join(lines)
        banner = "".join(lines)
        assert "KV blocks" in banner and "dtype" in banner and "smollm2" in banner
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        cold = time.monotonic() - t0
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "What is 2+2?"}],
                                      max_tokens=16, temperature=0)
        assert r.choices[0].message.content.strip(), "SmolLM2 must answer something"
        # NOTE(cold-start): the 15 s target is measured by benchmarks/serving.py on a quiet
        # machine; here the bound only catches a start-up that has gone badly wrong.
        assert cold < 60, f"cold start {cold:.1f}s (target 15 s on a quiet machine)"
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, "SIGTERM on an idle server drains and exits 0"
