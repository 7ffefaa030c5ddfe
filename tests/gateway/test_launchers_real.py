"""Autoscaling with real ``sluice serve`` replicas (tiny random model) on the local launcher.

Under a load ramp the autoscaler goes 1 -> 2 replicas, back to 1 when the
load drops (draining: every request in flight finishes), and the launcher
restarts a replica that is killed.  Cooldowns are shortened by config.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from sluice.gateway.autoscale import Autoscaler
from sluice.gateway.config import AutoscaleConfig, DegradationConfig, LauncherConfig
from sluice.gateway.launchers import ReplicaSpec
from sluice.gateway.launchers.local import LocalLauncher
from tests.gateway.conftest import gateway_config, serve_gateway

pytestmark = pytest.mark.slow

SERVE_ARGS = ["--kv-cache-memory", "64MiB", "--log-level", "warning"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.model_factory import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("as_tiny") / "tiny", arch="llama")


async def _wait(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


async def test_local_launcher_scales_1_2_1_under_a_load_ramp_drains_and_restarts(model_dir: Path, tmp_path: Path) -> None:
    lcfg = LauncherConfig(cpus_per_replica=1, ready_timeout_s=120, restart_backoff_s=0.5, stop_timeout_s=20)
    launcher = LocalLauncher(lcfg, log_dir=str(tmp_path))
    spec = ReplicaSpec("tiny", "v1", str(model_dir), extra_args=tuple(SERVE_ARGS))
    first = await launcher.launch(spec)
    auto = AutoscaleConfig(
        model_path=str(model_dir), serve_args=SERVE_ARGS, min_replicas=1, max_replicas=2,
        up_cooldown_s=1.0, down_cooldown_s=2.0, interval_s=0.3, launcher=lcfg,
    )  # fmt: skip
    # one request estimates ~70 tokens: 6 at once is ~1.05 of a replica, 1 at a time ~0.18
    load_cfg = DegradationConfig(tokens_per_replica=400, ttft_target_s=30.0)
    cfg = gateway_config(
        [first.url], model="tiny", policy="least_load",
        timeouts={"connect_s": 2.0, "first_byte_s": 60.0, "idle_s": 60.0},
    )  # fmt: skip
    results: Counter[int] = Counter()
    served_by: Counter[str] = Counter()
    try:
        async with serve_gateway(cfg) as (url, app), httpx.AsyncClient(timeout=120) as http:
            gw = app.state.gateway
            scaler = Autoscaler(gw.pool, {"tiny": auto}, {"tiny": launcher}, load_config=load_cfg)
            scaler.adopt("tiny", first)
            loop_task = asyncio.create_task(scaler.run())
            body = {"model": "tiny", "prompt": "count to ten:", "max_tokens": 64, "ignore_eos": True, "stream": True}
            concurrency = [6]
            stop = asyncio.Event()

            async def client(k: int) -> None:
                while not stop.is_set():
                    if k >= concurrency[0]:
                        await asyncio.sleep(0.05)
                        continue
                    async with http.stream("POST", url + "/v1/completions", json=body) as r:
                        lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
                    ok = r.status_code == 200 and lines and lines[-1] == "data: [DONE]"
                    results[200 if ok else r.status_code or -1] += 1
                    served_by[r.headers.get("x-sluice-replica", "?")] += 1

            clients = [asyncio.create_task(client(k)) for k in range(6)]
            try:
                await _wait(lambda: scaler.num_replicas("tiny") == 2, 120, "a scale-up to 2 replicas under load")
                second = next(lr for lr in launcher.replicas() if lr.url != first.url)
                await _wait(lambda: served_by[second.url] >= 3, 60, "traffic on the new replica")
                concurrency[0] = 1  # the ramp goes down: a trickle stays in flight during the drain
                await _wait(lambda: scaler.num_replicas("tiny") == 1, 60, "a scale-down to 1 replica")
                await scaler.wait_drained()
                assert len(launcher.replicas()) == 1, "the drained replica's process must be stopped"
                await asyncio.sleep(0.5)
            finally:
                stop.set()
                await asyncio.gather(*clients)
            assert set(results) == {200}, f"no request may fail through scale-up and drain: {results}"
            decisions = scaler.describe()["tiny"]["decisions"]  # type: ignore[index]
            assert [(d["from"], d["to"]) for d in decisions] == [(1, 2), (2, 1)], decisions

            # kill the remaining replica: the launcher restarts it on the same url
            survivor = launcher.replicas()[0]
            pid = launcher.pid(survivor)
            assert pid is not None
            os.killpg(pid, signal.SIGKILL)
            await _wait(lambda: survivor.num_restarts == 1, 30, "the killed replica's restart")

            async def served() -> bool:
                with contextlib.suppress(httpx.TransportError):
                    r = await http.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4})
                    return r.status_code == 200
                return False

            deadline = time.monotonic() + 120
            while not await served():
                assert time.monotonic() < deadline, "the restarted replica must serve again through the gateway"
                await asyncio.sleep(0.5)
            loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop_task
    finally:
        await launcher.close()
    assert launcher.replicas() == []
