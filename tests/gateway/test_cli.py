"""`sluice gateway` command: flags, SLUICE_* env vars, readable errors, a real process."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.gateway.conftest import fake_backends


def _sluice(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_bad_flags_and_configs_give_one_readable_line(tmp_path: Path) -> None:
    r = _sluice("gateway", "--config", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and r.stderr.strip().startswith("sluice: error: cannot read gateway config"), r.stderr
    assert "Traceback" not in r.stderr, "CLI errors must not dump a traceback"
    r = _sluice("gateway", "--replica", "http://127.0.0.1:1", env={"SLUICE_POLICY": "fastest"})
    assert r.returncode == 2 and "--policy (from SLUICE_POLICY)" in r.stderr, "SLUICE_POLICY must be read and checked"
    r = _sluice("gateway")
    assert r.returncode == 2 and "no models configured" in r.stderr, r.stderr


async def test_gateway_process_routes_to_replicas() -> None:
    port = _free_port()
    async with fake_backends(2) as fakes:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sluice.cli", "gateway", "--port", str(port), "--model", "tiny",
            "--replica", fakes[0].url, "--replica", fakes[1].url, "--log-level", "warning",
            env={**os.environ, "SLUICE_POLICY": "round_robin", "SLUICE_SCRAPE_INTERVAL": "0.2"},
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with httpx.AsyncClient(timeout=5) as http:
                for _ in range(200):
                    try:
                        if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        await asyncio.sleep(0.05)
                seen = set()
                for _ in range(4):
                    r = await http.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                    )
                    assert r.status_code == 200, r.text
                    seen.add(r.headers["x-sluice-replica"])
                assert seen == {fakes[0].url, fakes[1].url}, "round_robin (from SLUICE_POLICY) must use both replicas"
                metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
                assert 'policy="round_robin"' in metrics
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)


async def test_example_config_runs() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "gateway" / "gateway.yaml"
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sluice.cli", "gateway", "--config", str(example), "--port", str(port),
        "--log-level", "warning", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            for _ in range(200):
                try:
                    r = await http.get(f"http://127.0.0.1:{port}/v1/models", headers={"authorization": "Bearer sk-example"})
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.05)
            assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["smollm2"], r.text
            r = await http.get(f"http://127.0.0.1:{port}/admin/models", headers={"authorization": "Bearer sk-admin-example"})
            assert r.status_code == 200 and r.json()["models"]["smollm2"]["versions"] == {"v1": 90, "v2": 10}, r.text
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
