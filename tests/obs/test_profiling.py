"""Flame graph and speedscope output from collapsed stacks, the bounded profile
store, and py-spy sampling of a real process (and its ptrace failure)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from sluice.errors import ProfilerUnavailableError
from sluice.obs.flamegraph import merge, parse_collapsed, to_speedscope, to_svg
from sluice.obs.profiling import ProfileStore, PySpySampler, Target, find_py_spy

RAW = """<module> (sluice/cli.py:52);main (sluice/cli.py:47);step (sluice/engine/core.py:98) 30
<module> (sluice/cli.py:52);main (sluice/cli.py:47);poll (zmq/sugar/poll.py:106) 10
<module> (sluice/cli.py:52);main (sluice/cli.py:47);step (sluice/engine/core.py:98) 5
garbage line without count
"""


def test_collapsed_stacks_are_summed_per_stack_and_bad_lines_skipped() -> None:
    stacks = parse_collapsed(RAW)
    assert len(stacks) == 2
    assert stacks[("<module> (sluice/cli.py:52)", "main (sluice/cli.py:47)", "step (sluice/engine/core.py:98)")] == 35


def test_svg_has_one_root_per_process_with_widths_by_samples() -> None:
    root = merge({"api (pid 1)": {("a", "b"): 10}, "engine_core (pid 2)": parse_collapsed(RAW)})
    assert root.samples == 55 and set(root.children) == {"api (pid 1)", "engine_core (pid 2)"}
    svg = to_svg(root, title="t <&>")
    doc = ET.fromstring(svg)  # well-formed XML: browsers open it
    titles = [t.text for t in doc.iter("{http://www.w3.org/2000/svg}title")]
    assert "engine_core (pid 2) (45 samples, 81.82%)" in titles
    assert any(t.startswith("step (sluice/engine/core.py:98) (35 samples") for t in titles)


def test_speedscope_document_has_a_profile_per_process_and_weights_in_seconds() -> None:
    doc = json.loads(to_speedscope({"api": {("a", "b"): 10}, "engine": parse_collapsed(RAW)}, rate=100))
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    assert [p["name"] for p in doc["profiles"]] == ["api", "engine"]
    engine = doc["profiles"][1]
    assert engine["type"] == "sampled" and engine["unit"] == "seconds"
    assert engine["endValue"] == pytest.approx(0.45), "45 samples at 100 Hz are 0.45 s"
    frames = doc["shared"]["frames"]
    step = frames[engine["samples"][-1][-1]]
    assert step == {"name": "step", "file": "sluice/engine/core.py", "line": 98}


def test_store_keeps_at_most_n_archives_and_max_bytes_oldest_removed_first(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path, keep=2, max_bytes=10**9)
    made = []
    for i in range(4):
        run = store.new_run()
        (run / "a.txt").write_text("x" * 100 * (i + 1))
        made.append(store.finish(run))
        os.utime(made[-1], (time.time() + i, time.time() + i))
    assert store.archives() == made[2:], "the two newest stay"
    small = ProfileStore(tmp_path, keep=10, max_bytes=1)
    run = small.new_run()
    (run / "b.txt").write_text("y")
    latest = small.finish(run)
    assert small.archives() == [latest], "over the size cap only the archive just made survives"
    assert not any(p.is_dir() for p in tmp_path.iterdir()), "run directories are removed once zipped"


def _busy_python() -> subprocess.Popen[bytes]:
    code = "import time\ndef spin():\n    t = time.time()\n    while time.time() - t < 30: pass\nspin()\n"
    return subprocess.Popen([sys.executable, "-c", code])


needs_py_spy = pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")


@needs_py_spy
async def test_py_spy_samples_a_running_process_without_stopping_it(tmp_path: Path) -> None:
    proc = _busy_python()
    try:
        time.sleep(0.3)
        result = await PySpySampler().sample([Target("busy", proc.pid)], 1.0, tmp_path, rate=50)
    finally:
        proc.kill()
        proc.wait()
    key = f"busy (pid {proc.pid})"
    assert result.errors == {}
    assert result.num_samples[key] >= 20, "50 Hz for 1 s of a busy process"
    assert any(any(f.startswith("spin ") for f in stack) for stack in result.stacks[key])
    assert result.sampler_cpu_seconds >= 0.0 and result.wall_seconds >= 0.5, "py-spy ran for about its duration"


@needs_py_spy
async def test_a_process_that_is_gone_is_reported_not_raised(tmp_path: Path) -> None:
    result = await PySpySampler().sample([Target("gone", 2**22 + 12345)], 1.0, tmp_path)
    assert "gone" in result.errors and result.stacks == {}


@needs_py_spy
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
async def test_no_ptrace_permission_is_a_clear_error_with_the_fix(tmp_path: Path) -> None:
    proc = _busy_python()
    nobody = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    try:
        with pytest.raises(ProfilerUnavailableError, match=r"ptrace is not permitted.*SYS_PTRACE"):
            await PySpySampler(command_prefix=nobody).sample([Target("api", proc.pid)], 1.0, tmp_path)
    finally:
        proc.kill()
        proc.wait()


def test_missing_py_spy_is_a_clear_error(tmp_path: Path) -> None:
    s = PySpySampler()
    s.py_spy = None
    with pytest.raises(ProfilerUnavailableError, match="pip install py-spy"):
        s.argv(Target("api", 1), 1.0, 100, False, tmp_path / "x")


def test_pyroscope_tags_engine_steps_and_their_phases(monkeypatch) -> None:
    """With --pyroscope-server the engine's step, schedule and execute run under phase tags."""
    import contextlib
    import sys
    import types

    from sluice.server import engine_setup

    tags: list[str] = []

    @contextlib.contextmanager
    def tag_wrapper(t: dict[str, str]):
        tags.append(t["phase"])
        yield

    monkeypatch.setitem(sys.modules, "pyroscope", types.SimpleNamespace(tag_wrapper=tag_wrapper))
    monkeypatch.setattr(engine_setup, "start_pyroscope", lambda server, process, app_name="sluice": True)

    class Part:
        def schedule(self) -> str:
            return "s"

        def execute(self) -> str:
            return "e"

    class Engine:
        def __init__(self) -> None:
            self.scheduler, self.runner = Part(), Part()

        def step(self) -> list[str]:
            return [self.scheduler.schedule(), self.runner.execute()]

    setup = engine_setup.EngineProcessSetup(lambda config: Engine(), pyroscope_server="http://127.0.0.1:1")
    engine = setup(None)  # type: ignore[arg-type]
    assert engine.step() == ["s", "e"]
    assert tags == ["step", "schedule", "execute"], "the step and its phases carry their pyroscope tags"
    plain = engine_setup.EngineProcessSetup(lambda config: Engine())(None)  # type: ignore[arg-type]
    tags.clear()
    plain.step()
    assert tags == [], "without the flag nothing is wrapped"
