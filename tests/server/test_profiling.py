"""``POST /admin/profile`` on a real server (fake engine core in its own process):
the archive's files, one profile at a time, bounds, admin keys, the ptrace
failure, the bounded directory, and nothing left running between profiles."""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from sluice.obs.profiling import find_py_spy
from tests.server.conftest import ServerThread, start_fake_server

pytestmark = pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    # NOTE(busy-engine): py-spy skips idle (sleeping) threads; a fake step that
    # sleeps would leave the engine core with no samples on a slow machine.
    srv = start_fake_server(step_delay=0.005, engine_kwargs={"busy_step": True}, profile_dir=str(tmp_path_factory.mktemp("profiles")),
                            profile_keep=3, profile_max_seconds=5)  # fmt: skip
    yield srv
    srv.stop()


def _load(url: str, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                http.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 20})

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _profile(url: str, headers: dict[str, str] | None = None, **body: object) -> httpx.Response:
    return httpx.post(url + "/admin/profile", json=body, headers=headers or {}, timeout=120)


def test_profile_under_load_returns_flame_graph_speedscope_trace_and_summary(server: ServerThread) -> None:
    stop = threading.Event()
    load = _load(server.url, stop)
    try:
        r = _profile(server.url, seconds=1)
    finally:
        stop.set()
        load.join(10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/zip"
    assert "attachment" in r.headers["content-disposition"]
    z = zipfile.ZipFile(io.BytesIO(r.content))
    assert set(z.namelist()) == {"flamegraph.svg", "profile.speedscope.json", "engine_trace.json", "summary.json"}
    summary = json.loads(z.read("summary.json"))
    engine_pid = server.state.client.pid
    assert summary["processes"] == {"api": os.getpid(), "engine_core": engine_pid}
    assert summary["samples"][f"engine_core (pid {engine_pid})"] > 0, "the engine core must be sampled"
    assert summary["errors"] == {} and summary["engine_steps_in_window"] > 0
    assert summary["overhead"]["sampler_cpu_seconds"] >= 0 and summary["overhead"]["targets_paused_per_sample"] is False
    svg = z.read("flamegraph.svg").decode()
    assert f"engine_core (pid {engine_pid})" in svg and "run_engine_core" in svg, "the engine loop is in the graph"
    speedscope = json.loads(z.read("profile.speedscope.json"))
    assert [p["name"] for p in speedscope["profiles"]][-1] == f"engine_core (pid {engine_pid})"
    trace = json.loads(z.read("engine_trace.json"))
    steps = [e for e in trace["traceEvents"] if e.get("name") == "sluice.engine_step"]
    assert steps and len(steps) == summary["engine_trace"]["num_steps"], "one trace span per profiled engine step"


def test_archives_are_kept_listed_downloadable_and_capped(server: ServerThread) -> None:
    for _ in range(4):
        assert _profile(server.url, seconds=0.2, py_spy=False, torch_trace=False).status_code == 200
    listing = httpx.get(server.url + "/admin/profile").json()
    names = [a["name"] for a in listing["archives"]]
    assert len(names) == 3, "--profile-keep 3: the oldest archives are removed"
    assert sorted(p.name for p in Path(listing["directory"]).iterdir()) == sorted(names)
    r = httpx.get(f"{server.url}/admin/profile/{names[-1]}")
    assert r.status_code == 200 and zipfile.ZipFile(io.BytesIO(r.content)).namelist() == ["summary.json"]
    assert httpx.get(server.url + "/admin/profile/..%2Fetc%2Fpasswd").status_code == 404
    assert httpx.get(server.url + "/admin/profile/profile-x.zip").status_code == 404


def test_one_profile_at_a_time_409_and_bounds_400(server: ServerThread) -> None:
    first: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: first.update(r=_profile(server.url, seconds=2, py_spy=False)))
    t.start()
    try:
        assert _wait_running(server)
        second = _profile(server.url, seconds=1)
        assert second.status_code == 409 and second.json()["error"]["code"] == "profile_running"
    finally:
        t.join(60)
    assert first["r"].status_code == 200
    assert _profile(server.url, seconds=6).status_code == 400, "--profile-max-seconds 5"
    assert _profile(server.url, seconds=0).status_code == 400
    assert _profile(server.url, seconds=1, rate=0).status_code == 400
    assert _profile(server.url, seconds=1, colour="blue").status_code == 400


def _wait_running(server: ServerThread) -> bool:
    from tests.server.conftest import wait_for

    return wait_for(lambda: server.app.state.profiler.is_running, timeout=10)


def test_nothing_runs_between_profiles(server: ServerThread) -> None:
    assert _profile(server.url, seconds=0.5).status_code == 200
    children = psutil.Process().children(recursive=True)
    assert not [c for c in children if "py-spy" in c.name()], "py-spy must not outlive its profile"
    assert server.app.state.profiler.is_running is False


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_no_ptrace_permission_is_503_with_the_fix_and_leaves_nothing_on(server: ServerThread) -> None:
    sampler = server.app.state.profiler.sampler
    before = sorted(p.name for p in server.app.state.profiler.store.directory.iterdir())
    traces = set(Path(tempfile.gettempdir()).glob("sluice-engine-trace-*"))
    sampler.command_prefix = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    try:
        r = _profile(server.url, seconds=1)
    finally:
        sampler.command_prefix = ()
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "profiler_unavailable" and "ptrace" in err["message"] and "SYS_PTRACE" in err["message"]
    after = sorted(p.name for p in server.app.state.profiler.store.directory.iterdir())
    assert after == before, "a failed profile leaves no half-written run behind"
    assert set(Path(tempfile.gettempdir()).glob("sluice-engine-trace-*")) == traces, "nor the engine's trace file"
    ok = _profile(server.url, seconds=0.5)
    assert ok.status_code == 200, "the engine profiler was switched off: the next profile works"


def test_admin_key_is_required_when_keys_are_configured(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  sk-user: {tier: p1}\nadmin_keys: [sk-admin]\n")
    srv = start_fake_server(keys_file=str(keys), profile_dir=str(tmp_path / "p"))
    try:
        body = {"seconds": 0.2, "py_spy": False, "torch_trace": False}
        assert httpx.post(srv.url + "/admin/profile", json=body).status_code == 401
        user = httpx.post(srv.url + "/admin/profile", json=body, headers={"authorization": "Bearer sk-user"})
        assert user.status_code == 403 and "admin" in user.json()["error"]["message"]
        admin = httpx.post(srv.url + "/admin/profile", json=body, headers={"authorization": "Bearer sk-admin"},
                           timeout=60)  # fmt: skip
        assert admin.status_code == 200
        assert httpx.get(srv.url + "/admin/profile").status_code == 401
    finally:
        srv.stop()


def test_sluice_profile_cli_fetches_and_unpacks(server: ServerThread, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sluice.cli import app

    out = tmp_path / "prof"
    r = CliRunner().invoke(app, ["profile", server.url, "--seconds", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert {p.name for p in out.iterdir()} == {"flamegraph.svg", "profile.speedscope.json", "engine_trace.json",
                                                "summary.json"}  # fmt: skip
    assert str(out / "flamegraph.svg") in r.output and "sampling cost" in r.output
    bad = CliRunner().invoke(app, ["profile", server.url, "--seconds", "60", "--out", str(out)])
    assert bad.exit_code != 0 and "at most 5" in str(bad.exception)
