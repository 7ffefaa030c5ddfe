"""What ``POST /admin/profile`` costs a serving replica, and what it costs when idle.

    python benchmarks/profiling_overhead.py                    # 10 s phases, 2 rounds
    python benchmarks/profiling_overhead.py --phase-seconds 5 --rounds 1 --no-write

One real ``sluice serve`` (SmolLM2, CPU) under a closed-loop load (``--concurrency``
clients streaming 64-token completions with ``ignore_eos``, distinct prompts).  Phases of
equal length, interleaved so that drift in the machine's load spreads evenly:

    idle        no profile (before any profile, and between profiles: must match)
    full        py-spy non-blocking on both processes + torch.profiler trace
    py-spy      py-spy non-blocking only
    torch       torch.profiler trace only
    native      py-spy --native (pauses each process per sample) + trace

For each: streamed tokens/s and the mean gap between tokens in the window, relative
to the idle phases, and py-spy's own CPU (from the profile's summary.json).
Prints a table, writes the ``profiling_overhead`` section of
docs/benchmarks.md, and one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402

MODES: dict[str, dict[str, Any] | None] = {
    "idle": None,
    "full": {"py_spy": True, "torch_trace": True},
    "py-spy": {"py_spy": True, "torch_trace": False},
    "torch": {"py_spy": False, "torch_trace": True},
    "native": {"py_spy": True, "torch_trace": True, "native": True},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def load_phase(url: str, seconds: float, concurrency: int, max_tokens: int) -> tuple[float, float, int]:
    """(streamed tokens/s, mean gap between tokens s, tokens) inside the window.

    Streams are counted token by token, so a window shorter than a request
    still measures (the machine may be slow and shared)."""
    t_end = time.monotonic() + seconds
    gaps: list[float] = []
    tokens = 0
    counter = iter(range(10**9))

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while time.monotonic() < t_end:
            body = {"model": "smollm2", "prompt": f"Request {next(counter)}: write about rivers and the sea.",
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
            last = None
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    now = time.monotonic()
                    if now > t_end:
                        break
                    if not line.startswith("data: {"):
                        continue
                    tokens += 1
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return tokens / (time.monotonic() - t0), statistics.fmean(gaps) if gaps else float("nan"), tokens


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


async def phase(url: str, procs: dict[str, psutil.Process], mode: str, seconds: float, concurrency: int,
                max_tokens: int) -> dict[str, Any]:  # fmt: skip
    body = MODES[mode]
    prof_task = None
    if body is not None:
        async def take() -> dict[str, Any]:
            async with httpx.AsyncClient(timeout=seconds + 120) as http:
                r = await http.post(url + "/admin/profile", json={"seconds": seconds, **body})
            if r.status_code != 200:
                raise RuntimeError(f"profile failed: {r.status_code} {r.text}")
            return json.loads(zipfile.ZipFile(io.BytesIO(r.content)).read("summary.json"))

        prof_task = asyncio.create_task(take())
        await asyncio.sleep(0.3)  # the profiler is on before the measured window opens
    cpu0 = {k: _cpu(p) for k, p in procs.items()}
    tps, latency, n = await load_phase(url, seconds - 0.6 if body else seconds, concurrency, max_tokens)
    cpu = {k: _cpu(p) - cpu0[k] for k, p in procs.items()}
    summary = await prof_task if prof_task else {}
    over = summary.get("overhead", {})
    window = summary.get("window_seconds") or 1.0
    sampler = over.get("sampler_cpu_seconds", 0.0) * (seconds - 0.6) / window if body else 0.0
    per_token = {k: 1000 * v / max(n, 1) for k, v in cpu.items()}
    per_token["py-spy"] = 1000 * sampler / max(n, 1)
    return {"mode": mode, "tokens_per_s": tps, "latency_s": latency, "tokens": n,
            "cpu_ms_per_token": per_token, "sampler_cpu_percent": over.get("sampler_cpu_percent")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase-seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="engine --num-threads")
    ap.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    args = ap.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "serve", "--model", "smollm2", "--port", str(port),
                             "--kv-cache-memory", "64MiB", "--num-threads", str(args.threads), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            # NOTE(passive-omp): idle OpenMP threads sleep instead of spinning, so CPU
                            # time measures work done, not time spent waiting for a shared core
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})  # fmt: skip
    results: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("sluice serve did not start")
            time.sleep(0.5)
        api = psutil.Process(proc.pid)
        engine = next(c for c in api.children() if "spawn_main" in " ".join(c.cmdline()))
        procs = {"api": api, "engine": engine}
        asyncio.run(load_phase(url, 3.0, args.concurrency, args.max_tokens))  # warm-up
        order = ["idle", "full", "idle", "py-spy", "torch", "idle", "native"]
        for _ in range(args.rounds):
            for mode in order:
                r = asyncio.run(phase(url, procs, mode, args.phase_seconds, args.concurrency, args.max_tokens))
                results.append(r)
                c = r["cpu_ms_per_token"]
                print(f"  {mode:7s} {r['tokens_per_s']:7.1f} tok/s  {r['latency_s'] * 1000:7.0f} ms/token  "
                      f"CPU ms/token engine {c['engine']:6.1f} api {c['api']:5.1f} py-spy {c['py-spy']:5.1f}  "
                      f"({r['tokens']} tokens)", flush=True)  # fmt: skip
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)

    def mean(rs: list[dict[str, Any]], f: Any) -> float:
        return statistics.fmean(f(r) for r in rs)

    def total(r: dict[str, Any]) -> float:
        return float(sum(r["cpu_ms_per_token"].values()))

    idle = [r for r in results if r["mode"] == "idle"]
    idle_tps, idle_cpu = mean(idle, lambda r: r["tokens_per_s"]), mean(idle, total)
    idle_engine = mean(idle, lambda r: r["cpu_ms_per_token"]["engine"])
    rows, summary = [], {}
    for mode in MODES:
        rs = [r for r in results if r["mode"] == mode]
        tps, cpu = mean(rs, lambda r: r["tokens_per_s"]), mean(rs, total)
        eng = mean(rs, lambda r: r["cpu_ms_per_token"]["engine"])
        spy = mean(rs, lambda r: r["cpu_ms_per_token"]["py-spy"])
        rows.append([mode, round(tps, 1), f"{100 * (tps / idle_tps - 1):+.0f} %", round(eng, 1),
                     f"{100 * (eng / idle_engine - 1):+.1f} %", round(spy, 2), round(cpu, 1),
                     f"{100 * (cpu / idle_cpu - 1):+.1f} %", len(rs)])  # fmt: skip
        summary[mode] = {"tokens_per_s": tps, "engine_cpu_ms_per_token": eng, "py_spy_cpu_ms_per_token": spy,
                         "total_cpu_ms_per_token": cpu, "cpu_change_pct": 100 * (cpu / idle_cpu - 1)}  # fmt: skip
    spread_tps = 100 * (max(r["tokens_per_s"] for r in idle) - min(r["tokens_per_s"] for r in idle)) / idle_tps
    spread_cpu = 100 * (max(total(r) for r in idle) - min(total(r) for r in idle)) / idle_cpu
    table = markdown_table(["mode", "streamed tok/s", "vs idle", "engine CPU ms/token", "vs idle",
                            "py-spy CPU ms/token", "all CPU ms/token", "vs idle", "phases"], rows)  # fmt: skip
    body = (
        f"`python benchmarks/profiling_overhead.py` ({machine_line()}): one SmolLM2 replica, "
        f"{args.threads} engine thread(s) (OMP_WAIT_POLICY=PASSIVE), {args.concurrency} closed-loop clients "
        f"streaming {args.max_tokens}-token completions, "
        f"{args.phase_seconds:g} s phases, {args.rounds} rounds, interleaved. CPU per token counts the engine "
        f"core, the API process and py-spy (user + system time). The idle phases (before and between profiles) "
        f"differ among themselves by {spread_tps:.0f} % in tokens/s and {spread_cpu:.1f} % in CPU per token: "
        f"on a shared machine wall-clock throughput is noise-bound, CPU per token much less so.\n\n{table}\n"
    )
    print("\n" + body)
    if not args.no_write:
        write_section("profiling_overhead", body)
    print_json_last({"benchmark": "profiling_overhead", "idle_spread_tps_pct": spread_tps,
                     "idle_spread_cpu_pct": spread_cpu, "modes": summary})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
