"""``POST /admin/profile``: a flame graph of a running ``sluice serve``, safe in production.

    POST /admin/profile  {"seconds": 10, "native": false, "rate": 100, "py_spy": true, "torch_trace": true}
        -> 200 application/zip, kept as <--profile-dir>/profile-<stamp>-<pid>-<n>.zip:
             flamegraph.svg            API process and engine core, one root frame each
             profile.speedscope.json   one profile per process (https://www.speedscope.app)
             engine_trace.json         torch.profiler Chrome trace of the engine steps in the
                                       window (the first MAX_TRACE_STEPS of them)
             summary.json              window, samples, errors, and what the sampling cost
        -> 409 while another profile runs; 400 for seconds outside (0, --profile-max-seconds];
           503 when py-spy is missing or may not attach (the message says how to allow it)
    GET  /admin/profile              the running flag and the archives kept
    GET  /admin/profile/<name>.zip   one of them

Admin endpoints, closed unless an operator opens them (NOTE(admin-access) in ``sluice.auth``).

Overhead: nothing runs between profiles (no sampler process, the engine tests
one flag per step).  During one, py-spy reads both processes' memory from its
own process without stopping them (``native`` pauses them per sample), and the
engine records torch ops for up to MAX_TRACE_STEPS steps; ``summary.json``
states py-spy's CPU time, and docs/operations.md the measured cost to serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import FileResponse, Response

from sluice.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
    SluiceError,
)
from sluice.http_errors import error_response, from_validation_error
from sluice.obs.flamegraph import merge, to_speedscope, to_svg
from sluice.obs.profiling import (
    ProfileStore,
    PySpySampler,
    SamplingResult,
    Target,
    allow_ptrace_by_descendants,
)
from sluice.server.admin import authenticate_admin

if TYPE_CHECKING:
    from sluice.server.state import ServerState

__all__ = ["ProfileRequest", "Profiler", "add_profile_routes", "default_profile_dir"]

_ARCHIVE = re.compile(r"^profile-[0-9]{8}-[0-9]{6}-[0-9]+-[0-9]+\.zip$")


class ProfileRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(10.0, gt=0)  # the window; at most --profile-max-seconds
    native: bool = False  # C/C++ frames too (py-spy pauses each process per sample)
    rate: int = Field(100, ge=1, le=1000)  # samples per second and process
    py_spy: bool = True  # sample the API process and the engine core
    torch_trace: bool = True  # torch.profiler trace of the engine steps


def default_profile_dir() -> Path:
    import tempfile

    return Path(tempfile.gettempdir()) / "sluice-profiles"


Control = Callable[[str], Awaitable[dict[str, Any]]]


class Profiler:
    """One profile at a time: engine profiler on, py-spy on both processes, engine profiler off, files."""

    def __init__(
        self,
        store: ProfileStore,
        control: Control,
        engine_pid: Callable[[], int | None],
        engine_steps: Callable[[], int],
        *,
        max_seconds: float = 60.0,
        sampler: PySpySampler | None = None,
    ):
        self.store = store
        self.control = control
        self.engine_pid = engine_pid
        self.engine_steps = engine_steps
        self.max_seconds = max_seconds
        self.sampler = sampler or PySpySampler()
        self.is_running = False

    async def run(self, req: ProfileRequest) -> Path:
        if self.max_seconds <= 0:
            raise NotFoundError("profiling is off on this server (--profile-max-seconds 0)", code="profiling_off")
        if req.seconds > self.max_seconds:
            raise InvalidRequestError(f"seconds must be at most {self.max_seconds:g} (--profile-max-seconds), "
                                      f"got {req.seconds:g}", param="seconds")  # fmt: skip
        if self.is_running:
            raise ConflictError("a profile is already running; try again when it ends", code="profile_running")
        self.is_running = True
        run = self.store.new_run()
        try:
            await self._profile(req, run)
            return await asyncio.to_thread(self.store.finish, run)
        except BaseException:
            shutil.rmtree(run, ignore_errors=True)
            raise
        finally:
            self.is_running = False

    async def _profile(self, req: ProfileRequest, run: Path) -> None:
        engine_pid = self.engine_pid()
        targets = [Target("api", os.getpid())] + ([Target("engine_core", engine_pid)] if engine_pid else [])
        steps0, t0, started = self.engine_steps(), time.monotonic(), time.time()
        engine_start: dict[str, Any] = {}
        trace: dict[str, Any] = {}
        sampling: SamplingResult | None = None
        if req.py_spy:
            allow_ptrace_by_descendants()  # py-spy is our child: let it read this process
        # NOTE(stop-always): once the engine profiler is on, it is switched off
        # whatever happens to the sampling, so a failed profile costs nothing after.
        engine_start = await self.control("profile_start" if req.torch_trace else "profile_attach")
        try:
            if req.py_spy:
                sampling = await self.sampler.sample(targets, req.seconds, run, rate=req.rate, native=req.native)
            else:
                await asyncio.sleep(req.seconds)
        except BaseException:
            if req.torch_trace:  # the engine's trace file of a failed profile goes with its run
                stopped = await self.control("profile_stop")
                if stopped.get("path"):
                    Path(stopped["path"]).unlink(missing_ok=True)
            raise
        if req.torch_trace:
            trace = await self.control("profile_stop")
        window = time.monotonic() - t0
        await asyncio.to_thread(self._write, run, req, sampling, trace)
        summary = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "request": req.model_dump(),
            "window_seconds": round(window, 3),
            "processes": {t.label: t.pid for t in targets},
            "samples": sampling.num_samples if sampling else {},
            "errors": sampling.errors if sampling else {},
            "engine_steps_in_window": self.engine_steps() - steps0,
            "engine_trace": {k: v for k, v in trace.items() if k != "path"},
            "engine_profiler_start_seconds": engine_start.get("start_seconds"),
            "overhead": _overhead(req, sampling),
            "files": sorted(p.name for p in run.iterdir()) + ["summary.json"],
        }
        (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    @staticmethod
    def _write(run: Path, req: ProfileRequest, sampling: SamplingResult | None, trace: dict[str, Any]) -> None:
        if sampling is not None and sampling.stacks:
            title = f"sluice serve: {req.seconds:g} s at {req.rate} Hz" + (" (native)" if req.native else "")
            (run / "flamegraph.svg").write_text(to_svg(merge(sampling.stacks), title=title))
            (run / "profile.speedscope.json").write_text(to_speedscope(sampling.stacks, req.rate, name=title))
        path = trace.get("path")
        if path and Path(path).exists():
            shutil.move(path, run / "engine_trace.json")


def _overhead(req: ProfileRequest, s: SamplingResult | None) -> dict[str, Any]:
    if s is None:
        return {"sampler": "off"}
    return {
        "sampler_cpu_seconds": round(s.sampler_cpu_seconds, 3),
        "sampler_cpu_percent": round(100.0 * s.sampler_cpu_seconds / max(s.wall_seconds, 1e-9), 2),
        "targets_paused_per_sample": req.native,
        "note": "py-spy runs in its own process; non-blocking mode never stops the targets, native mode "
                "pauses each of them for every sample",
    }  # fmt: skip


def add_profile_routes(app: FastAPI, state: ServerState) -> Profiler:
    settings = state.settings
    profiler = Profiler(
        ProfileStore(Path(settings.profile_dir) if settings.profile_dir else default_profile_dir(),
                     keep=settings.profile_keep, max_bytes=settings.profile_max_mib * 2**20),  # fmt: skip
        control=state.client.control,
        engine_pid=lambda: state.client.pid,
        engine_steps=lambda: state.client.stats.num_steps,
        max_seconds=settings.profile_max_seconds,
    )
    app.state.profiler = profiler

    @app.post("/admin/profile")
    async def take_profile(request: Request) -> Response:
        try:
            authenticate_admin(state, request)
            if not state.is_ready:
                raise ServiceUnavailableError("the engine core is not ready", retry_after=1.0)
            body = await request.body()
            try:
                req = ProfileRequest.model_validate_json(body or b"{}")
            except ValidationError as e:
                raise from_validation_error(e) from None
            archive = await profiler.run(req)
        except SluiceError as e:
            return error_response(e)
        return FileResponse(archive, media_type="application/zip", filename=archive.name)

    @app.get("/admin/profile")
    async def list_profiles(request: Request) -> Response:
        try:
            authenticate_admin(state, request)
        except SluiceError as e:
            return error_response(e)
        kept = [{"name": p.name, "bytes": p.stat().st_size,
                 "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(p.stat().st_mtime))}
                for p in profiler.store.archives()]  # fmt: skip
        doc = {"is_running": profiler.is_running, "directory": str(profiler.store.directory), "archives": kept}
        return Response(json.dumps(doc), media_type="application/json")

    @app.get("/admin/profile/{name}")
    async def get_profile(request: Request, name: str) -> Response:
        try:
            authenticate_admin(state, request)
            path = profiler.store.directory / name
            if not _ARCHIVE.match(name) or not path.is_file():
                raise NotFoundError(f"no profile {name!r} (GET /admin/profile lists them)", code="profile_not_found")
        except SluiceError as e:
            return error_response(e)
        return FileResponse(path, media_type="application/zip", filename=name)

    return profiler
