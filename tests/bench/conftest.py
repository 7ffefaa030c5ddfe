"""Fixtures for sluice.bench tests: a fake OpenAI server per test, and a CLI runner."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from typer.testing import CliRunner

from sluice.bench.cli import bench_app
from sluice.bench.fake_server import FakeConfig, FakeServerThread


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServerThread]]:
    """``start(**FakeConfig fields) -> FakeServerThread`` (``.url``, ``.server`` counters)."""
    started: list[FakeServerThread] = []

    def start(**kw: object) -> FakeServerThread:
        t = FakeServerThread(FakeConfig(**kw))  # type: ignore[arg-type]
        t.__enter__()
        started.append(t)
        return t

    yield start
    for t in started:
        t.__exit__(None, None, None)


class BenchResult:
    def __init__(self, exit_code: int, stdout: str, stderr: str) -> None:
        self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr

    @property
    def doc(self) -> dict:
        """The final stdout line, which must be one JSON document."""
        last = self.stdout.strip().splitlines()[-1]
        return json.loads(last)


@pytest.fixture
def bench() -> Callable[..., BenchResult]:
    """Run ``sluice bench ARGS...`` in-process; returns exit code, stdout, stderr."""

    def run(*args: str) -> BenchResult:
        r = CliRunner().invoke(bench_app, list(args), catch_exceptions=False)
        return BenchResult(r.exit_code, r.stdout, r.stderr)

    return run
