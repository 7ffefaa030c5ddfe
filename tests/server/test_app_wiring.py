"""build_app's parts, each built alone (sluice.server.wiring), and the app they make (sluice.server.app).

No engine core process starts here: an ``EngineClient`` spawns its engine only in the lifespan, and the
start-up tests hand ``start_serving`` a client that answers at once."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from sluice.auth import RateLimiter
from sluice.engine.config import ModelInfo
from sluice.engine.protocol import EngineStats
from sluice.errors import AuthenticationError, ModelLoadError
from sluice.obs.placement import Placement
from sluice.obs.tracing import Tracing
from sluice.server.admission import AdmissionController
from sluice.server.app import build_app
from sluice.server.config import ServerSettings, load_settings
from sluice.server.engine_client import EngineClient
from sluice.server.engine_setup import EngineProcessSetup
from sluice.server.lanes import LanedAdmission, LanedClient
from sluice.server.state import ServerState
from sluice.server.telemetry import ServerMetrics
from sluice.server.testing import FakeEngineCore, fake_codec_factory
from sluice.server.wiring import Lanes, _engine_process, build_access, build_lanes, start_serving

FAKE = functools.partial(FakeEngineCore, step_delay=0.002)


def _lanes(settings: ServerSettings, on_stats: Any = lambda: None) -> tuple[Lanes, ServerMetrics]:
    metrics = ServerMetrics(settings.model_name)
    lanes = build_lanes(settings, metrics, Tracing(TracerProvider()), engine_factory=FAKE, placement=None,
                        clock=lambda: 0.0, on_dead=lambda: None, on_stats=on_stats)  # fmt: skip
    return lanes, metrics


def _close(client: Any) -> None:
    asyncio.run(client.close())


def test_one_lane_admits_up_to_the_servers_whole_queue_bounds() -> None:
    s = load_settings(model="fake", max_queued_requests=5, max_queued_tokens=1001)
    lanes, metrics = _lanes(s)
    try:
        assert lanes.num_lanes == 1
        assert isinstance(lanes.client, EngineClient), "one engine core: its own client, no lane layer"
        assert isinstance(lanes.admission, LanedAdmission), "one admission object for one lane or N"
        assert [(a.max_requests, a.max_tokens) for a in lanes.admission.lanes] == [(5, 1001)]
        assert metrics.signal.source == lanes.admission.signal, "the /metrics signal gauge must read the admission"
        assert metrics.engine.source is None, "one engine core: the gauges read its latest stats as they come"
    finally:
        _close(lanes.client)


def test_two_lanes_share_the_bounds_and_one_map_of_requests_to_lanes() -> None:
    s = load_settings(model="fake", data_parallel_size=2, max_queued_requests=5, max_queued_tokens=1001)
    lanes, metrics = _lanes(s)
    try:
        assert lanes.num_lanes == 2
        assert isinstance(lanes.client, LanedClient) and isinstance(lanes.admission, LanedAdmission)
        assert [(a.max_requests, a.max_tokens) for a in lanes.admission.lanes] == [(3, 501)] * 2, \
            "the server's bounds are shared out over the lanes, rounded up"
        lanes.admission._assigned["uid"] = 1
        assert lanes.client._lanes == {"uid": 1}, "the client must send a request where admission put it"
        assert metrics.engine.source is not None, "with lanes the gauges read the merged stats at scrape time"
    finally:
        _close(lanes.client)


def test_a_lanes_stats_reach_the_metrics_its_own_admission_and_then_on_stats() -> None:
    calls: list[str] = []
    s = load_settings(model="fake", data_parallel_size=2)
    lanes, metrics = _lanes(s, on_stats=lambda: calls.append("on_stats"))
    assert isinstance(lanes.client, LanedClient) and isinstance(lanes.admission, LanedAdmission)
    try:
        for i, adm in enumerate(lanes.admission.lanes):
            adm.observe_stats = functools.partial(lambda i, st: calls.append(f"admission {i}"), i)  # type: ignore[method-assign]
        stats = EngineStats(num_running=3)
        lanes.client.clients[1]._on_stats(stats)  # what the client does with each stats message of its engine
        assert calls == ["admission 1", "on_stats"]
        assert metrics.engine.latest is stats
    finally:
        _close(lanes.client)


def test_the_engine_process_pins_itself_only_when_placed_or_profiled() -> None:
    s = load_settings(model="fake")
    assert _engine_process(s, FAKE, None, None) is FAKE
    placed = _engine_process(s, FAKE, Placement((1,), 0, None, "test"), (1,))
    assert isinstance(placed, EngineProcessSetup)
    assert (placed.factory, placed.cpus, placed.numa_node) == (FAKE, (1,), 0)


def test_access_checks_the_keys_it_was_given() -> None:
    keys, admin = build_access(load_settings(model="fake", api_key="sk-right"))
    assert keys.authenticate("Bearer sk-right") is not None
    with pytest.raises(AuthenticationError):
        keys.authenticate("Bearer sk-wrong")
    assert admin.keys is keys, "the admin routes must check the same key store"


class _ReadyClient:
    """An engine client that is ready at once (or fails to start)."""

    def __init__(self, info: ModelInfo | None = None, error: Exception | None = None):
        self.info, self.error, self.is_dead = info, error, False

    async def wait_ready(self) -> ModelInfo:
        if self.error is not None:
            raise self.error
        assert self.info is not None
        return self.info


def _state(settings: ServerSettings, client: Any, codec_factory: Any = fake_codec_factory) -> tuple[ServerState, list[Any]]:
    events: list[Any] = []
    keys, admin = build_access(settings)
    state = ServerState(
        settings=settings, client=client, metrics=ServerMetrics(""), tracing=Tracing(TracerProvider()),
        keys=keys, rate_limiter=RateLimiter(), admission=LanedAdmission([AdmissionController(4, 4096)], {}),
        codec_factory=codec_factory, admin=admin,
        on_ready=lambda info: events.append(("ready", info.name)), on_engine_dead=lambda: events.append("dead"),
    )  # fmt: skip
    return state, events


def test_start_serving_builds_the_serving_object_once_the_engine_is_ready() -> None:
    info = FakeEngineCore(load_settings(model="fake").engine).model_info
    state, events = _state(load_settings(model="fake", served_model_name="house-model"), _ReadyClient(info))
    asyncio.run(start_serving(state))
    assert state.serving is not None and state.is_ready and state.model_info is info
    assert state.serving.served_model_name == "house-model"
    assert {"house-model", "fake"} <= state.serving.model_names, "the served name and the model's both answer"
    assert events == [("ready", "fake")]
    assert 'sluice_model_info{model="house-model"} 1.0' in state.metrics.render().decode(), \
        "the info gauge names the served model once it is known"


def test_a_failed_start_is_kept_for_health_and_reported_once() -> None:
    state, events = _state(load_settings(model="fake"), _ReadyClient(error=ModelLoadError("no such weights")))
    asyncio.run(start_serving(state))
    assert state.serving is None and state.startup_error is not None and "no such weights" in state.startup_error
    assert events == ["dead"]

    def bad_tokenizer(model: str) -> Any:
        raise ValueError("tokenizer.json is truncated")

    info = FakeEngineCore(load_settings(model="fake").engine).model_info
    state, events = _state(load_settings(model="fake"), _ReadyClient(info), codec_factory=bad_tokenizer)
    asyncio.run(start_serving(state))
    assert state.serving is None and state.startup_error == "ValueError: tokenizer.json is truncated"
    assert events == ["dead"]


def test_build_app_serves_every_route() -> None:
    app = build_app(load_settings(model="fake"), engine_factory=FAKE, codec_factory=fake_codec_factory)
    try:
        routes = {(m, r.path) for r in app.routes for m in getattr(r, "methods", None) or ()}
        assert routes >= {
            ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
            ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
            ("POST", "/admin/profile"), ("GET", "/admin/kv"), ("POST", "/admin/kv/checkpoint"),
            ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
        }  # fmt: skip
        state = app.state.sluice
        assert isinstance(state, ServerState) and state.num_lanes == 1 and state.serving is None
    finally:
        _close(app.state.sluice.client)
