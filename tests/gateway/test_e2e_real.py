"""End to end with real ``sluice serve`` replicas (tiny random model): kill one under load.

Requests not yet streaming must succeed on the other replica; the killed one
is taken out of rotation, and traffic returns to it after it restarts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import gateway_config, serve_gateway

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Replica:
    """A ``sluice serve`` process group (API + engine core) on a fixed port."""

    def __init__(self, model_dir: Path, port: int):
        self.model_dir = model_dir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Replica:
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "sluice.cli", "serve", "--model", str(self.model_dir),
                "--host", "127.0.0.1", "--port", str(self.port), "--kv-cache-memory", "64MiB",
                "--log-level", "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: kill() takes the engine core too
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, "sluice serve exited during start-up"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} not healthy after {timeout:.0f}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.model_factory import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("gw_tiny") / "tiny", arch="llama")


@pytest.fixture
def replicas(model_dir: Path) -> Iterator[list[Replica]]:
    reps = [Replica(model_dir, _free_port()).start() for _ in range(2)]
    try:
        for r in reps:
            r.wait_ready()
        yield reps
    finally:
        for r in reps:
            r.kill()


async def _request(http: httpx.AsyncClient, url: str, i: int) -> dict:
    body = {"model": "tiny", "prompt": f"request {i}: tell me a story", "max_tokens": 24, "stream": i % 2 == 0}
    out: dict = {"i": i, "stream": body["stream"]}
    if not body["stream"]:
        r = await http.post(url + "/v1/completions", json=body)
        out.update(status=r.status_code, replica=r.headers.get("x-sluice-replica"), complete=r.status_code == 200)
        return out
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    out.update(status=r.status_code, replica=r.headers.get("x-sluice-replica"))
    out["complete"] = bool(events) and events[-1] == "data: [DONE]"
    out["broken_mid_stream"] = bool(events) and "error" in json.loads(events[-1][6:]) if events and events[-1] != "data: [DONE]" else False
    return out


async def test_kill_a_replica_under_load_then_restart_it(replicas: list[Replica]) -> None:
    victim, survivor = replicas
    cfg = gateway_config(
        [r.url for r in replicas],
        model="tiny",
        policy="round_robin",
        # replicas know the model by its directory name
        models={"tiny": {"versions": [{"name": "v1", "served_model": "tiny", "replicas": [r.url for r in replicas]}]}},
        timeouts={"connect_s": 1.0, "first_byte_s": 30.0, "idle_s": 30.0},
        retry={"max_attempts": 3, "min_retries_per_s": 5.0},
    )
    async with serve_gateway(cfg) as (url, app), httpx.AsyncClient(timeout=60) as http:
        pool = app.state.gateway.pool
        warm = await asyncio.gather(*(_request(http, url, i) for i in range(4)))
        assert all(r["complete"] for r in warm), f"both replicas must serve before the kill: {warm}"
        assert {r["replica"] for r in warm} == {victim.url, survivor.url}, "round robin must use both replicas"

        sem = asyncio.Semaphore(6)
        done = [0]

        async def limited(i: int) -> dict:
            async with sem:
                try:
                    return await _request(http, url, i)
                finally:
                    done[0] += 1

        # NOTE(kill-mid-load): kill once the load is flowing (a few answers in) and
        # most of it is still to come, however fast the replicas answer: a fixed
        # sleep let a fast engine finish every request before the kill
        load = [asyncio.create_task(limited(i)) for i in range(4, 100)]
        deadline = time.monotonic() + 20
        while done[0] < 6 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert done[0] < 60, f"the load must still be running at the kill ({done[0]} of 96 done)"
        victim.kill()
        t_kill = time.monotonic()
        results = await asyncio.gather(*load)

        failed = [r for r in results if not r["complete"]]
        for r in failed:
            assert r["stream"] and r["broken_mid_stream"] and r["replica"] == victim.url, (
                f"only streams already running on the killed replica may fail, and they must end with an "
                f"error event: {r}"
            )
        assert Counter(r["status"] for r in results) == {200: len(results)}, "every request must get a 200 start"
        victim_replica = next(r for r in pool.replicas() if r.url == victim.url)
        metrics = (await http.get(url + "/metrics")).text
        retried = [ln for ln in metrics.splitlines() if ln.startswith("sluice_gateway_retries_total")]
        assert retried and float(retried[0].rsplit(" ", 1)[1]) >= 1, (
            "the kill must have hit requests not yet streaming, which the gateway retried elsewhere"
        )
        assert not victim_replica.is_routable(), "the killed replica must be taken out of rotation"
        after = await asyncio.gather(*(_request(http, url, i) for i in range(100, 106)))
        assert all(r["complete"] and r["replica"] == survivor.url for r in after), (
            f"after the kill every request must succeed on the survivor: {after}"
        )

        victim.start()
        victim.wait_ready()
        deadline = time.monotonic() + 20
        while not victim_replica.is_routable() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert victim_replica.is_routable(), (
            f"a restarted replica must be probed back in (down for {time.monotonic() - t_kill:.1f}s)"
        )
        back = await asyncio.gather(*(_request(http, url, i) for i in range(46, 52)))
        assert all(r["complete"] for r in back), back
        assert victim.url in {r["replica"] for r in back}, "traffic must return to the restarted replica"
