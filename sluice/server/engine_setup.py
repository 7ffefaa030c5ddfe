"""What the engine core process does around its engine: placement, continuous
profiling, and the torch profiler that ``POST /admin/profile`` switches on.

``EngineProcessSetup`` wraps the engine factory that ``EngineClient`` hands to
the spawned process, so it runs there first thing, before torch is imported
and starts its threads: every thread the engine makes inherits the CPU mask
and the memory policy (``sluice.obs.placement``).  With ``--pyroscope-server``
it starts the Pyroscope agent in the engine process too, tagged
``process=engine_core`` and, per engine step, ``phase=step`` (``schedule`` /
``execute`` inside it for the real ``EngineCore``).

``StepProfiler`` is ``torch.profiler`` on demand: off (one attribute test per
step) until a ``profile_start`` control message, then it records at most
``max_steps`` engine steps (a bounded trace) until ``profile_stop`` writes the
Chrome trace.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sluice.engine.config import EngineConfig
from sluice.engine.protocol import EngineCoreProtocol, EngineOutput

__all__ = ["EngineProcessSetup", "StepProfiler", "profile_control", "start_pyroscope", "MAX_TRACE_STEPS"]

log = logging.getLogger("sluice.engine_core")

# NOTE(trace-bound): a SmolLM2 step is ~700 torch ops; 256 steps keep a Chrome
# trace near 50 MB and its export under a few seconds.
MAX_TRACE_STEPS = 256


def start_pyroscope(server: str, process: str, app_name: str = "sluice") -> bool:
    """Start the Pyroscope agent in this process; False (logged) when it cannot start.

    The agent samples in-process and uploads in the background: an unreachable
    server costs a failed upload every 10 s, never a request.
    """
    try:
        import pyroscope
    except ImportError:
        log.error("--pyroscope-server: pyroscope-io is not installed (pip install 'sluice-llm[pyroscope]')")
        return False
    try:
        pyroscope.configure(application_name=app_name, server_address=server, tags={"process": process},
                            oncpu=True, gil_only=False)  # fmt: skip
    except Exception as e:  # noqa: BLE001 -- profiling must never take serving down
        log.error("pyroscope agent did not start: %s", e)
        return False
    return True


def _tagged(fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
    import pyroscope

    def call(*args: Any, **kwargs: Any) -> Any:
        with pyroscope.tag_wrapper({"phase": phase}):
            return fn(*args, **kwargs)

    return call


@dataclass(frozen=True)
class EngineProcessSetup:
    """A picklable engine factory: set the process up, then build the engine."""

    factory: Callable[[EngineConfig], EngineCoreProtocol]
    cpus: tuple[int, ...] = ()  # engine core cores (empty: leave the inherited mask)
    numa_node: int | None = None  # preferred memory node
    pyroscope_server: str | None = None

    def __call__(self, config: EngineConfig) -> EngineCoreProtocol:
        if self.cpus:
            from sluice.obs.placement import apply_placement

            apply_placement(self.cpus, self.numa_node)
        engine = self.factory(config)
        if self.pyroscope_server and start_pyroscope(self.pyroscope_server, "engine_core"):
            # NOTE(pyroscope-phases): instance attributes, so only this process's
            # engine is wrapped and nothing changes when the flag is off.
            for owner, name, phase in ((engine, "step", "step"),
                                       (getattr(engine, "scheduler", None), "schedule", "schedule"),
                                       (getattr(engine, "runner", None), "execute", "execute")):  # fmt: skip
                if owner is not None and callable(getattr(owner, name, None)):
                    setattr(owner, name, _tagged(getattr(owner, name), phase))
        return engine


def profile_control(profiler: StepProfiler, command: str) -> dict[str, Any]:
    """The engine side of ``POST /admin/profile`` (control messages ``profile_*``).

    profile_attach   let py-spy (a child of the API process) read this process
    profile_start    that, and torch.profiler on
    profile_stop     torch.profiler off, Chrome trace written; its path
    """
    from sluice.errors import InvalidRequestError
    from sluice.obs.profiling import allow_ptrace_by_descendants

    if command in ("profile_attach", "profile_start"):
        allowed = allow_ptrace_by_descendants(os.getppid())
        result = profiler.start() if command == "profile_start" else {}
        return {**result, "ptracer_set": allowed}
    if command == "profile_stop":
        return profiler.stop()
    raise InvalidRequestError(f"unknown engine command {command!r}")


class StepProfiler:
    """``torch.profiler`` over engine steps, switched by control messages."""

    def __init__(self, max_steps: int = MAX_TRACE_STEPS):
        self.max_steps = max_steps
        self.is_active = False  # the loop tests this once per step
        self._prof: Any = None
        self._num_steps = 0
        self._step_seconds = 0.0
        self._started = 0.0

    def start(self) -> dict[str, Any]:
        if self._prof is not None:
            self.stop()  # a previous profile the API process gave up on
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        t0 = time.monotonic()
        self._prof = profile(activities=activities, record_shapes=False, with_stack=False)
        self._prof.start()
        self._num_steps, self._step_seconds, self._started = 0, 0.0, time.monotonic()
        self.is_active = True
        return {"start_seconds": time.monotonic() - t0, "activities": [a.name for a in activities]}

    def step(self, engine: EngineCoreProtocol) -> list[EngineOutput]:
        from torch.profiler import record_function

        t0 = time.monotonic()
        with record_function("sluice.engine_step"):
            outputs = engine.step()
        self._step_seconds += time.monotonic() - t0
        self._num_steps += 1
        if self._num_steps >= self.max_steps:
            self._prof.stop()  # the trace is full: stop recording, export on profile_stop
            self.is_active = False
        return outputs

    def stop(self) -> dict[str, Any]:
        """Stop and write the Chrome trace; its path and what it holds."""
        prof, self._prof = self._prof, None
        if prof is None:
            return {"path": None, "num_steps": 0}
        if self.is_active:
            prof.stop()
        self.is_active = False
        t0 = time.monotonic()
        fd, path = tempfile.mkstemp(prefix="sluice-engine-trace-", suffix=".json")
        os.close(fd)
        prof.export_chrome_trace(path)
        return {
            "path": path,
            "num_steps": self._num_steps,
            "is_truncated": self._num_steps >= self.max_steps,
            "step_seconds": self._step_seconds,
            "window_seconds": time.monotonic() - self._started,
            "export_seconds": time.monotonic() - t0,
        }
