"""Gateway benchmark: latency the gateway adds, streamed req/s, and prefix affinity vs round robin.

    python benchmarks/gateway.py                 # fake replicas only (~20 s)
    python benchmarks/gateway.py --real          # + two real SmolLM2 `sluice serve` replicas

Part 1 runs two fast fake replicas (``sluice.bench.fake_server``) and one
``sluice gateway`` process, each its own process on 127.0.0.1:

  * added latency: the same sequential streamed request straight to a replica
    and through the gateway, back to back (time to the last byte); added =
    via - direct per pair, p50 and p99 (target: p50 <= 1 ms);
  * throughput: concurrent streamed requests through the gateway for a fixed
    time, counted complete ([DONE] seen), also divided by the gateway
    process's CPU time: the rate it sustains on a core of its own (target:
    >= 1,500 req/s).

Part 2 (``--real``) starts two ``sluice serve`` SmolLM2 replicas and compares
p95 time to first token of ``prefix_affinity`` and ``round_robin`` on a
shared-prefix workload: a few ~350-token system prompts, short user turns,
random order, 4 concurrent clients, each replica's KV cache sized to hold
about half of the prefixes (so round robin, which spreads every prefix to both
replicas, keeps evicting them; prefix affinity homes each prefix on one).

Prints a table, writes the ``gateway`` section of docs/benchmarks.md, and
prints one JSON line last.  Every process it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402

PY = sys.executable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout: float, proc: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s")


@contextlib.contextmanager
def _processes() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _start_fake(procs: list[subprocess.Popen], chunks: int) -> str:
    port = _free_port()
    p = subprocess.Popen(
        [PY, "-m", "sluice.bench.fake_server", "--port", str(port), "--output-tokens", str(chunks)],
        stdout=subprocess.DEVNULL,
    )
    procs.append(p)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/health", 30, p)
    return url


def _start_gateway(procs: list[subprocess.Popen], replicas: list[str], policy: str, model: str) -> str:
    port = _free_port()
    args = [PY, "-m", "sluice.cli", "gateway", "--port", str(port), "--policy", policy, "--model", model]
    for r in replicas:
        args += ["--replica", r]
    p = subprocess.Popen(args + ["--log-level", "warning"], stdout=subprocess.DEVNULL)
    procs.append(p)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/health", 30, p)
    return url


async def _stream_once(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, float]:
    """(time to first byte, time to last byte) of one streamed completion."""
    t0 = time.perf_counter()
    ttfb = 0.0
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        tail = b""
        async for chunk in resp.content.iter_any():
            if not ttfb:
                ttfb = time.perf_counter() - t0
            tail = (tail + chunk)[-32:]
        if b"[DONE]" not in tail:
            raise RuntimeError("stream ended without [DONE]")
    return ttfb, time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _added_latency(direct: str, gateway: str, n: int) -> dict[str, float]:
    body = {"model": "fake", "prompt": "hello", "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as s:
        for _ in range(50):  # warm connections on both paths
            await _stream_once(s, direct, body)
            await _stream_once(s, gateway, body)
        d, g = [], []
        for _ in range(n):  # interleaved so both see the same machine noise
            d.append((await _stream_once(s, direct, body))[1])
            g.append((await _stream_once(s, gateway, body))[1])
    # NOTE(paired): added latency is taken per pair (via_i - direct_i, run back
    # to back), so slow moments of a shared machine hit both sides of a pair.
    added = [gi - di for gi, di in zip(g, d, strict=True)]
    return {
        "direct_p50_ms": 1e3 * _pct(d, 0.5),
        "gateway_p50_ms": 1e3 * _pct(g, 0.5),
        "added_p50_ms": 1e3 * _pct(added, 0.5),
        "added_p99_ms": 1e3 * _pct(added, 0.99),
    }


async def _throughput(gateway: str, concurrency: int, seconds: float, pid: int) -> dict[str, float]:
    body = {"model": "fake", "prompt": "hello", "max_tokens": 4, "stream": True}
    done = errors = 0
    stop = time.monotonic() + seconds

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        while time.monotonic() < stop:
            try:
                await _stream_once(s, gateway, body)
                done += 1
            except (aiohttp.ClientError, RuntimeError):
                errors += 1

    proc = psutil.Process(pid)
    cpu0 = sum(proc.cpu_times()[:2])
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    cpu_s = sum(proc.cpu_times()[:2]) - cpu0
    # NOTE(per-core): on a shared 2-core machine the gateway gets only part of a
    # core (the load generator and the fake replicas need the rest), so the rate
    # per gateway CPU-second is the rate one gateway process sustains on a core
    # of its own; the raw rate is reported too.
    return {
        "streamed_rps": done / seconds,
        "streamed_per_cpu_s": done / max(cpu_s, 1e-9),
        "gateway_cpu_share": cpu_s / seconds,
        "errors": float(errors),
    }


def _shared_prefix_prompts(n: int, num_prefixes: int, rng: random.Random) -> list[str]:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "serving", "tokens", "fast", "and", "well"]
    prefixes = [
        f"System {i}: " + " ".join(rng.choice(words) for _ in range(300)) for i in range(num_prefixes)
    ]
    return [rng.choice(prefixes) + f"\nUser: question {j}?" for j in range(n)]


async def _ttft_run(gateway: str, prompts: list[str], concurrency: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def one(s: aiohttp.ClientSession, prompt: str) -> None:
        async with sem:
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "stream": True, "temperature": 0}
            ttfts.append((await _stream_once(s, gateway, body))[0])

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(one(s, p) for p in prompts))
    return {"p50_ttft_s": _pct(ttfts, 0.5), "p95_ttft_s": _pct(ttfts, 0.95), "wall_s": time.perf_counter() - t0}


def _real_replicas(procs: list[subprocess.Popen], kv_cache_memory: str) -> list[str]:
    urls = []
    for _ in range(2):
        port = _free_port()
        p = subprocess.Popen(
            [PY, "-m", "sluice.cli", "serve", "--model", "smollm2", "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
             "--kv-cache-memory", kv_cache_memory, "--log-level", "warning"],
            stdout=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        procs.append(p)
        urls.append(f"http://127.0.0.1:{port}")
    for url, p in zip(urls, procs[-2:], strict=True):
        _wait_http(url + "/health", 300, p)
    return urls


def main() -> None:
    ap = argparse.ArgumentParser(description="sluice gateway benchmark")
    ap.add_argument("--requests", type=int, default=500, help="sequential requests for added latency")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=8.0, help="throughput run length")
    ap.add_argument("--real", action="store_true", help="also run two real SmolLM2 replicas")
    ap.add_argument("--real-requests", type=int, default=150)
    ap.add_argument("--prefixes", type=int, default=6, help="distinct shared system prompts")
    ap.add_argument(
        "--kv-cache-memory", default="96MiB", help="per replica: room for about half the prefixes"
    )
    args = ap.parse_args()

    result: dict[str, object] = {"benchmark": "gateway"}
    rows: list[list[object]] = []
    with _processes() as procs:
        fakes = [_start_fake(procs, chunks=4) for _ in range(2)]
        gw = _start_gateway(procs, fakes, "least_load", "fake")
        lat = asyncio.run(_added_latency(fakes[0], gw, args.requests))
        thr = asyncio.run(_throughput(gw, args.concurrency, args.seconds, procs[-1].pid))
    result.update({k: round(v, 4) for k, v in {**lat, **thr}.items()})
    rows += [
        ["added latency p50 (ms), streamed", lat["added_p50_ms"], "<= 1", "yes" if lat["added_p50_ms"] <= 1 else "no"],
        ["added latency p99 (ms), streamed", lat["added_p99_ms"], "-", "-"],
        ["direct / via gateway p50 (ms)", f"{lat['direct_p50_ms']:.2f} / {lat['gateway_p50_ms']:.2f}", "-", "-"],
        [
            "streamed req/s one gateway process sustains (per CPU-second of the gateway)",
            thr["streamed_per_cpu_s"],
            ">= 1,500",
            "yes" if thr["streamed_per_cpu_s"] >= 1500 else "no",
        ],
        [
            f"streamed req/s measured, {args.concurrency} clients, gateway got {thr['gateway_cpu_share']:.0%} of a core",
            thr["streamed_rps"],
            "-",
            "-",
        ],
        ["errors during the throughput run", int(thr["errors"]), "0", "yes" if thr["errors"] == 0 else "no"],
    ]

    if args.real:
        prompts = _shared_prefix_prompts(args.real_requests, args.prefixes, random.Random(0))
        by_policy = {}
        for policy in ("round_robin", "prefix_affinity"):
            with _processes() as procs:  # fresh replicas: both policies start with cold caches
                replicas = _real_replicas(procs, args.kv_cache_memory)
                gw = _start_gateway(procs, replicas, policy, "smollm2")
                by_policy[policy] = asyncio.run(_ttft_run(gw, prompts, concurrency=4))
        for policy, r in by_policy.items():
            rows.append([f"SmolLM2 x2, shared prefixes: {policy} p50 / p95 TTFT (s)", f"{r['p50_ttft_s']:.3f} / {r['p95_ttft_s']:.3f}", "-", "-"])
            result[f"{policy}_p95_ttft_s"] = round(r["p95_ttft_s"], 4)
            result[f"{policy}_p50_ttft_s"] = round(r["p50_ttft_s"], 4)
        win = by_policy["prefix_affinity"]["p95_ttft_s"] < by_policy["round_robin"]["p95_ttft_s"]
        rows.append(["prefix_affinity beats round_robin on p95 TTFT", "yes" if win else "no", "yes", "yes" if win else "no"])
    else:
        rows.append(["SmolLM2 x2: prefix_affinity vs round_robin p95 TTFT", "not run (use --real)", "affinity wins", "-"])

    table = markdown_table(["measure", "value", "target", "met"], rows)
    print(table)
    write_section(
        "gateway",
        "## Gateway (`benchmarks/gateway.py`)\n\n"
        f"{machine_line()}. Fake replicas: `sluice.bench.fake_server`, 4 SSE chunks per answer; "
        "the load generator, two fake replicas and the gateway share the machine's cores. "
        f"Real replicas: SmolLM2-135M Q4_1, {args.real_requests} requests over {args.prefixes} shared prefixes, "
        f"--kv-cache-memory {args.kv_cache_memory} each.\n\n" + table,
    )
    print_json_last(result)


if __name__ == "__main__":
    main()
