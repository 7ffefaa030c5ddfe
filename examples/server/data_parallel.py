"""One engine core, or two behind the same API process: `sluice serve --data-parallel-size 2`.

    python examples/server/data_parallel.py            # sluice serve --model smollm2, three ways (~2 min)
    python examples/server/data_parallel.py --fake     # the fake engine of the tests (no model, ~30 s)

``--data-parallel-size auto`` picks ``2`` on a CPU of 2-3 cores with quantized weights such
as SmolLM2's, else ``1`` (NOTE(dp-auto) in sluice/server/lanes.py); the default is ``1``.
It starts the server with ``--data-parallel-size 1``, then ``2``, then ``2`` with
``SLUICE_LANE_LEND=0``, and runs against each one user alone (a request after
another: the time to first token and the time per output token of a lone
stream) and then a closed loop of ``--users`` concurrent clients (16 output
tokens each, ``--seconds`` long): the requests served a second, the median time
to first token, and the engine steps run (``/metrics``' step counter, summed
over the engine cores).  On a CPU with few cores two engine cores serve more
than one engine core on every core under load (docs/server.md, "Several engine
cores"); alone, a lane borrows the idle lane's cores (NOTE(lane-lend)), which
``SLUICE_LANE_LEND=0`` turns off: a lone stream then runs on one thread.  The
fake engine has no threads and batches every user in one step, so with
``--fake`` the two engines run twice the steps for the same requests: it shows
the routing, not the speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(fake: bool, port: int, lanes: int, extra_env: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SLUICE_DATA_PARALLEL_SIZE": str(lanes), **extra_env}
    if fake:  # the fake engine: 20 ms a step
        cmd = [sys.executable, "-m", "sluice.server.testing", "--port", str(port), "--step-delay", "0.02"]
    else:
        cmd = [sys.executable, "-m", "sluice.cli", "serve", "--model", "smollm2", "--port", str(port),
               "--kv-cache-memory", "256MiB", "--log-level", "warning"]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become healthy")


async def closed_loop(url: str, users: int, seconds: float, max_tokens: int = 16) -> tuple[int, list[float], list[float]]:
    """Requests served, their TTFTs and their times per output token (s), ``users`` clients each sending
    one request after another."""
    ttfts: list[float] = []
    tpots: list[float] = []
    served = 0
    end = time.monotonic() + seconds

    async def user(c: httpx.AsyncClient, i: int) -> None:
        nonlocal served
        while time.monotonic() < end:
            body = {"prompt": f"Write a short note about owls, number {i}:", "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True}  # fmt: skip
            t = time.perf_counter()
            first = last = None
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        last = time.perf_counter()
                        first = first or last
            if r.status_code == 200 and first is not None and last is not None:
                served += 1
                ttfts.append(first - t)
                tpots.append((last - first) / max(1, max_tokens - 1))

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=users)) as c:
        await asyncio.gather(*(user(c, i) for i in range(users)))
    return served, ttfts, tpots


def steps(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("sluice_engine_steps_total"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fake", action="store_true", help="the tests' fake engine instead of SmolLM2")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10.0)
    a = ap.parse_args()
    runs = [("--data-parallel-size 1", 1, {}), ("--data-parallel-size 2", 2, {}),
            ("--data-parallel-size 2, SLUICE_LANE_LEND=0", 2, {"SLUICE_LANE_LEND": "0"})]  # fmt: skip
    for name, lanes, env in runs:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start(a.fake, port, lanes, env)
        try:
            wait_healthy(url, proc)
            _, ttfts, tpots = asyncio.run(closed_loop(url, 1, a.seconds / 2, max_tokens=32))
            print(f"{name}: alone: TTFT p50 {1000 * statistics.median(ttfts):5.1f} ms, "
                  f"{1000 * statistics.median(tpots):5.1f} ms per output token", flush=True)
            served, ttfts, _ = asyncio.run(closed_loop(url, a.users, a.seconds))
            print(f"{name}: {a.users} users: {served / a.seconds:6.1f} requests/s, TTFT p50 "
                  f"{1000 * statistics.median(ttfts):5.0f} ms, engine steps {steps(url):.0f} ({a.seconds:g} s)",
                  flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
