"""A live stack for the drift tests: a real ``sluice serve`` (SmolLM2, small KV
cache) and a real ``sluice gateway`` in front of it, started once for this package,
with a few requests of each class sent through so that counters have samples.

The gateway's config is ``deploy/gateway.yaml`` with its replica URLs pointed at
the test server, plus a canary version (share 0, on a port nobody listens on)
and an autoscaled model with no replica, so every gateway metric family exists.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveStack:
    serve_url: str
    gateway_url: str
    serve_metrics: str
    gateway_metrics: str


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args))} exited:\n{log.read_text()[-3000:]}")  # type: ignore[arg-type]
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def gateway_test_config(serve_url: str) -> dict:
    cfg = yaml.safe_load((ROOT / "deploy/gateway.yaml").read_text())
    cfg.update(host="127.0.0.1", port=free_port())
    (v1,) = cfg["models"]["smollm2"]["versions"]
    v1["replicas"] = [serve_url]
    cfg["models"]["smollm2"]["versions"].append(
        {"name": "v2", "share": 0, "replicas": [f"http://127.0.0.1:{free_port()}"]})  # fmt: skip
    cfg["models"]["autoscaled"] = {
        "versions": [{"name": "v1", "served_model": "smollm2", "replicas": []}],
        "autoscale": {"model_path": "smollm2", "min_replicas": 0, "max_replicas": 1, "interval_s": 3600},
    }
    return cfg


@pytest.fixture(scope="package")  # stopped after tests/deploy, not left idling through the rest of the suite
def live_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tmp = tmp_path_factory.mktemp("live_stack")
    port = free_port()
    serve_url = f"http://127.0.0.1:{port}"
    serve = _start([sys.executable, "-m", "sluice.cli", "serve", "--model", "smollm2", "--port", str(port),
                    "--kv-cache-memory", "16MiB", "--max-num-seqs", "4", "--log-level", "warning"],
                   tmp / "serve.log")  # fmt: skip
    gateway = None
    try:
        _wait(serve_url + "/health", serve, tmp / "serve.log")
        cfg = gateway_test_config(serve_url)
        (tmp / "gateway.yaml").write_text(yaml.safe_dump(cfg))
        gateway_url = f"http://127.0.0.1:{cfg['port']}"
        gateway = _start([sys.executable, "-m", "sluice.cli", "gateway", "--config", str(tmp / "gateway.yaml"),
                          "--log-level", "warning"], tmp / "gateway.log")  # fmt: skip
        _wait(gateway_url + "/health", gateway, tmp / "gateway.log")
        with httpx.Client(timeout=60) as http:
            for cls in ("p0", "p1", "p2"):
                body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4}
                r = http.post(gateway_url + "/v1/completions", json=body, headers={"x-priority": cls})
                assert r.status_code == 200, f"a request through the gateway must succeed: {r.text}"
            yield LiveStack(serve_url, gateway_url, http.get(serve_url + "/metrics").text,
                            http.get(gateway_url + "/metrics").text)  # fmt: skip
    finally:
        if gateway is not None:
            _stop(gateway)
        _stop(serve)
