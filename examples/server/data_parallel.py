"""One engine core, or two behind the same API process: `sluice serve --data-parallel-size 2`.

    python examples/server/data_parallel.py            # sluice serve --model smollm2, twice (~1 min)
    python examples/server/data_parallel.py --fake     # the fake engine of the tests (no model, ~10 s)

It starts the server with ``--data-parallel-size 1`` and then ``2``, runs the
same closed loop against each (``--users`` concurrent clients, 16 output tokens
each, ``--seconds`` long), and prints the requests served a second, the median
time to first token, and the engine steps run (``/metrics``' step counter, summed
over the engine cores).  On a CPU
with few cores two one-thread engine cores serve more than one two-thread engine
core under load (docs/server.md, "Several engine cores"); a lone request is
slower on one thread.  The fake engine has no threads and batches every user in
one step, so with ``--fake`` the two engines run twice the steps for the same
requests: it shows the routing, not the speed.
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


def start(fake: bool, port: int, lanes: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SLUICE_DATA_PARALLEL_SIZE": str(lanes)}
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


async def closed_loop(url: str, users: int, seconds: float) -> tuple[int, list[float]]:
    """Requests served and their TTFTs (s), ``users`` clients each sending one request after another."""
    ttfts: list[float] = []
    served = 0
    end = time.monotonic() + seconds

    async def user(c: httpx.AsyncClient, i: int) -> None:
        nonlocal served
        while time.monotonic() < end:
            body = {"prompt": f"Write a short note about owls, number {i}:", "max_tokens": 16, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            t = time.perf_counter()
            first = None
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - t
            if r.status_code == 200 and first is not None:
                served += 1
                ttfts.append(first)

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=users)) as c:
        await asyncio.gather(*(user(c, i) for i in range(users)))
    return served, ttfts


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
    for lanes in (1, 2):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start(a.fake, port, lanes)
        try:
            wait_healthy(url, proc)
            served, ttfts = asyncio.run(closed_loop(url, a.users, a.seconds))
            print(f"--data-parallel-size {lanes}: {served / a.seconds:6.1f} requests/s, TTFT p50 "
                  f"{1000 * statistics.median(ttfts):5.0f} ms, engine steps {steps(url):.0f} "
                  f"({a.users} users, {a.seconds:g} s)", flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
