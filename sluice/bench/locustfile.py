"""A locustfile for teams who prefer locust: the same workloads, TTFT / TPOT / E2E as locust stats.

    locust -f sluice/bench/locustfile.py --host http://127.0.0.1:8000 --headless \\
        -u 50 -r 10 -t 2m --bench-output-len normal:128,32 --bench-priority-mix p0=0.2,p1=0.8

The model is the server's (the first of ``GET /v1/models``) unless ``--bench-model`` names one.

Every request is a streamed chat (or completions) call built by
``sluice.bench.workload`` (same flags and seeds as ``sluice bench run``).
Besides locust's own row for the POST (time to response headers), each request
fires three custom events, shown as rows of type ``TTFT``, ``TPOT`` and ``E2E``
(milliseconds), so locust's percentiles, charts and CSVs carry the LLM figures.
A failed request (non-200, broken SSE, no ``[DONE]``) is reported as a failure
of the POST with its reason.

This module imports locust (and gevent's monkey patching): ``sluice bench``
never imports it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
from locust import HttpUser, events, task
from locust.env import Environment
from locust.exception import StopUser

from sluice.bench.client import build_body, decode_chunk, error_text
from sluice.bench.sse import SSEDecoder
from sluice.bench.workload import (  # fmt: skip
    Api,
    RequestSpec,
    WorkloadSpec,
    generate_requests,
    parse_length,
    parse_priority_mix,
)


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    g = parser.add_argument_group("sluice bench workload")
    g.add_argument("--bench-model", default=None, help="model name sent in every request (default: the first of "
                   "GET /v1/models, as sluice bench)")  # fmt: skip
    g.add_argument("--bench-api", default="chat", choices=["chat", "completions"])
    g.add_argument("--bench-input-len", default="128", help="as sluice bench --input-len")
    g.add_argument("--bench-output-len", default="64", help="as sluice bench --output-len")
    g.add_argument("--bench-priority-mix", default="p1=1", help="as sluice bench --priority-mix")
    g.add_argument("--bench-prefix-groups", type=int, default=0)
    g.add_argument("--bench-prefix-len", type=int, default=0)
    g.add_argument("--bench-seed", type=int, default=0)


def workload_from_options(opts: Any) -> WorkloadSpec:
    return WorkloadSpec(
        api=Api(opts.bench_api),
        input_len=parse_length(opts.bench_input_len),
        output_len=parse_length(opts.bench_output_len),
        priority_mix=parse_priority_mix(opts.bench_priority_mix),
        prefix_groups=opts.bench_prefix_groups,
        prefix_len=opts.bench_prefix_len,
    )


def _fire(env: Environment, kind: str, name: str, ms: float) -> None:
    env.events.request.fire(request_type=kind, name=name, response_time=ms, response_length=0, exception=None, context={})  # fmt: skip


class LLMUser(HttpUser):
    """One locust user: a closed loop of streamed requests from its own seeded stream."""

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.workload = workload_from_options(opts)
        if opts.bench_model is None:  # once per run: the first user to start asks, the others reuse it
            opts.bench_model = self._served_model()
        self.model = opts.bench_model
        # NOTE(seeds): user k (in spawn order) replays seed + k, so a locust run is
        # as reproducible as locust's own spawn order.
        runner = self.environment.runner
        index = runner.user_count if runner is not None else 0
        self.requests: Iterator[RequestSpec] = generate_requests(self.workload, opts.bench_seed + index)

    def _served_model(self) -> str:
        """The first model of ``GET /v1/models``, as ``sluice bench`` (``session.resolve_model``) picks it."""
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as resp:
            try:
                return str(resp.json()["data"][0]["id"])
            except (ValueError, KeyError, IndexError, TypeError):
                resp.failure(f"cannot list models: HTTP {resp.status_code}")
                raise StopUser() from None

    @task
    def stream(self) -> None:
        spec = next(self.requests)
        api = self.workload.api
        body = build_body(spec, api, self.model, self.workload.ignore_eos, {})
        headers = {"x-priority": spec.priority.label}
        start = time.perf_counter()
        ttft = None
        num_tokens, usage_tokens, error = 0, None, None
        with self.client.post(api.path, json=body, headers=headers, stream=True, catch_response=True, name=api.path) as resp:  # fmt: skip
            if resp.status_code != 200:
                resp.failure(error_text(resp.status_code, resp.content[:4096] if resp.content else b""))
                return
            dec, done = SSEDecoder(), False
            for raw in resp.iter_content(chunk_size=None):
                now = time.perf_counter()
                for data in dec.feed(raw):
                    if data == b"[DONE]":
                        done = True
                        break
                    try:
                        chunk = decode_chunk(data)
                    except msgspec.DecodeError as e:
                        error = f"malformed SSE chunk: {e}"
                        break
                    if chunk.error is not None:
                        error = f"error event in stream: {chunk.error_message()}"
                        break
                    if chunk.usage is not None and chunk.usage.completion_tokens is not None:
                        usage_tokens = chunk.usage.completion_tokens
                    for c in chunk.choices:
                        if c.output_text():
                            ttft = now - start if ttft is None else ttft
                            num_tokens += 1
                if done or error:
                    break
            end = time.perf_counter()
            if error is None and not done:
                error = "stream ended without [DONE]"
            if error:
                resp.failure(error)
                return
            resp.success()
        n = usage_tokens if usage_tokens is not None else num_tokens
        if ttft is not None:
            _fire(self.environment, "TTFT", api.path, ttft * 1000)
            if n > 1:
                _fire(self.environment, "TPOT", api.path, (end - start - ttft) / (n - 1) * 1000)
        _fire(self.environment, "E2E", api.path, (end - start) * 1000)
