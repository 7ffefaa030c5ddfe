"""Online serving benchmark: ``sluice serve`` on SmolLM2 under a streaming load.

    python benchmarks/serving.py                       # sluice, concurrency 1, 8, 32, 128
    python benchmarks/serving.py --levels 1,8 --requests 2
    python benchmarks/serving.py --peer vllm --vllm-python .peer/vllm/bin/python --vllm-model-dir .peer/smollm2-hf

Workload (the issue's): prompts of 128 tokens (distinct, so no prefix-cache
hits), 64 output tokens with ``ignore_eos``, temperature 0, streamed.  Per
concurrency level: req/s, output tok/s, TTFT p50/p95, mean TPOT, e2e p95,
errors; plus the server's peak RSS (API + engine processes) and the API
process's CPU time per streamed token (target <= 50 us).

Prints a table, writes the ``serving`` section of docs/benchmarks.md, and
prints one JSON line last.  Only 127.0.0.1 is ever contacted; every process
started here is stopped here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    error: str = ""


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[str]
    url: str
    model: str
    startup_s: float
    peak_rss: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def tree(self) -> list[psutil.Process]:
        try:
            p = psutil.Process(self.proc.pid)
            return [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def watch_rss(self) -> None:
        def loop() -> None:
            while not self._stop.wait(0.2):
                total = 0
                for p in self.tree():
                    with contextlib.suppress(psutil.Error):
                        total += p.memory_info().rss
                self.peak_rss = max(self.peak_rss, total)

        threading.Thread(target=loop, daemon=True).start()

    def api_cpu_seconds(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                for p in self.tree()[::-1]:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
                self.proc.wait(10)


def _wait_url(proc: subprocess.Popen[str], pattern: str, timeout: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: [lines.put(ln) for ln in stdout], daemon=True).start()
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m.group(1)
    proc.kill()
    raise RuntimeError("server did not start:\n" + "".join(seen[-20:]))


def start_sluice_bf16(args: argparse.Namespace) -> Server:
    """The same server with --dtype bfloat16 (faster on AVX512-BF16 CPUs, not batch-invariant)."""
    return start_sluice(args, dtype="bfloat16")


def start_sluice(args: argparse.Namespace, dtype: str | None = None) -> Server:
    cmd = [sys.executable, "-m", "sluice.cli", "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "0",
           "--max-num-seqs", str(max(args.levels)), "--log-level", "warning",
           "--max-queued-requests", "4096"]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", args.kv_cache_memory]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    if dtype:
        cmd += ["--dtype", dtype]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = _wait_url(proc, r"ready in .* at (http://\S+)", 300)
    return Server("sluice" + (f" ({dtype})" if dtype else ""), proc, url, "smollm2", time.monotonic() - t0)


def start_fake(args: argparse.Namespace) -> Server:
    """The API process alone: the fake engine core (no model) isolates the streaming path's cost."""
    cmd = [sys.executable, "-m", "sluice.server.testing", "--port", "0", "--step-delay", str(args.fake_step_delay),
           "--max-model-len", "1024"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = _wait_url(proc, r"ready in .* at (http://\S+)", 120)
    return Server("fake", proc, url, "fake", time.monotonic() - t0)


def start_vllm(args: argparse.Namespace) -> Server:
    """vLLM's CPU build from a separate venv (not run in CI; see the module docstring)."""
    if not args.vllm_python or not args.vllm_model_dir:
        raise SystemExit("--peer vllm needs --vllm-python and --vllm-model-dir")
    port = args.vllm_port
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.vllm_model_dir,
           "--served-model-name", "smollm2", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "2048", "--max-num-seqs", "32"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("vLLM exited during start-up")
        with contextlib.suppress(Exception):
            import httpx

            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return Server("vllm-cpu", proc, url, "smollm2", time.monotonic() - t0)
        time.sleep(1)
    proc.kill()
    raise RuntimeError("vLLM did not become healthy")


def make_prompts(n: int, seed: int = 0, id_range: tuple[int, int] = (1000, 30000)) -> list[list[int]]:
    rng = random.Random(seed)
    # ids 1000..30000 are ordinary word pieces in SmolLM2's 49k vocabulary
    return [[rng.randrange(*id_range) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = 0.0
    tokens = 0
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return Result(False, error=f"HTTP {r.status}: {(await r.text())[:200]}")
            async for raw in r.content:
                if not raw.startswith(b"data: {"):
                    continue
                if not ttft and b'"text":"' in raw and b'"text":""' not in raw:
                    ttft = time.perf_counter() - t0
                if b'"usage":{' in raw:
                    tokens = json.loads(raw[6:])["usage"]["completion_tokens"]
                elif b'"error"' in raw:
                    return Result(False, error=raw.decode()[:200])
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return Result(False, error=f"{type(e).__name__}: {e}")
    e2e = time.perf_counter() - t0
    return Result(tokens == OUTPUT_TOKENS, ttft or e2e, e2e, tokens,
                  "" if tokens == OUTPUT_TOKENS else f"{tokens} tokens")


async def run_level(server: Server, concurrency: int, num_requests: int, seed: int) -> dict[str, Any]:
    prompts = make_prompts(num_requests, seed, (97, 123) if server.name == "fake" else (1000, 30000))
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    cpu0 = server.api_cpu_seconds()

    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def go(p: list[int]) -> Result:
            async with sem:
                return await one_request(session, server.url, server.model, p)

        t0 = time.perf_counter()
        results = await asyncio.gather(*[go(p) for p in prompts])
        wall = time.perf_counter() - t0
    cpu = server.api_cpu_seconds() - cpu0
    ok = [r for r in results if r.ok]
    toks = sum(r.tokens for r in results)
    ttfts = sorted(r.ttft for r in ok) or [float("nan")]
    e2es = sorted(r.e2e for r in ok) or [float("nan")]
    tpots = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return {
        "concurrency": concurrency,
        "requests": num_requests,
        "req_per_s": len(ok) / wall,
        "output_tok_per_s": toks / wall,
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p95_s": _pct(ttfts, 95),
        "tpot_mean_s": statistics.fmean(tpots) if tpots else float("nan"),
        "e2e_p95_s": _pct(e2es, 95),
        "errors": len(errors),
        "error_sample": errors[:2],
        "api_cpu_us_per_token": 1e6 * cpu / toks if toks else float("nan"),
        "wall_s": wall,
        "load_avg_1m": os.getloadavg()[0],  # other work on the machine skews everything
    }


def profile_engine_step(model: str, batch: int = 32, steps: int = 5, num_threads: int | None = None) -> dict[str, Any]:
    """Where one decode step's milliseconds go (in-process EngineCore, torch profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sluice.engine.config import EngineConfig
    from sluice.engine.core import EngineCore
    from sluice.engine.protocol import EngineRequest, SamplingParams

    core = EngineCore(EngineConfig(model=model, max_num_seqs=max(batch, 1), num_threads=num_threads))
    sp = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, seed=123)):
        core.add_request(EngineRequest(request_id=f"p{i}", prompt_token_ids=p, sampling=sp, arrival_time=time.monotonic()))
    t0 = time.perf_counter()
    prefill_steps = 0
    while core.make_stats().num_running < batch or core.make_stats().num_waiting:
        core.step()
        prefill_steps += 1
    core.step()  # first decode-only step outside the profile
    prefill_s = time.perf_counter() - t0
    times = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    total_us = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1.0
    top = [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1000 / steps,
            "share": e.self_cpu_time_total / total_us} for e in ops]
    return {"batch": batch, "decode_step_ms": 1000 * statistics.median(times), "prefill_s": prefill_s,
            "prefill_steps": prefill_steps, "threads": torch.get_num_threads(), "top_ops": top}


def _pct(xs: list[float], p: float) -> float:
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def bench(server: Server, args: argparse.Namespace) -> list[dict[str, Any]]:
    await run_level(server, 1, 1, seed=999)  # warm-up (first-request costs stay out of the table)
    rows = []
    for i, c in enumerate(args.levels):
        n = args.requests * c if c > 1 else max(args.requests * 2, 4)
        row = await run_level(server, c, n, seed=i)
        rows.append(row)
        print(f"  {server.name} c={c}: {row['output_tok_per_s']:.1f} tok/s, TTFT p95 {row['ttft_p95_s']:.3f} s, "
              f"errors {row['errors']}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--engine", choices=["real", "fake"], default="real",
                    help="fake: the fake engine core (API-process cost only, no model)")
    ap.add_argument("--fake-step-delay", type=float, default=0.02)
    ap.add_argument("--levels", default="1,8,32,128", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--requests", type=int, default=2, help="requests per level = this x concurrency (c=1: x2, min 4)")
    ap.add_argument("--kv-cache-memory", default=None)
    ap.add_argument("--num-threads", type=int, default=None, help="engine torch threads (sluice serve --num-threads)")
    ap.add_argument("--also-bf16", action="store_true", help="also run sluice with --dtype bfloat16")
    ap.add_argument("--peer", choices=["vllm"], default=None)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--vllm-model-dir", default=None)
    ap.add_argument("--vllm-port", type=int, default=8123)
    ap.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    ap.add_argument("--profile-step", type=int, default=0, metavar="BATCH",
                    help="also profile one decode step of an in-process engine at this batch size")
    args = ap.parse_args(argv)

    results: dict[str, Any] = {"benchmark": "serving", "model": args.model, "prompt_tokens": PROMPT_TOKENS,
                               "engine_threads": args.num_threads or "default",
                               "output_tokens": OUTPUT_TOKENS, "systems": {}}
    systems = (["fake" if args.engine == "fake" else "sluice"] + (["sluice-bf16"] if args.also_bf16 else [])
               + (["vllm"] if args.peer else []))
    starters = {"sluice": start_sluice, "sluice-bf16": start_sluice_bf16, "fake": start_fake, "vllm": start_vllm}
    for name in systems:
        server = starters[name](args)
        server.watch_rss()
        try:
            rows = asyncio.run(bench(server, args))
        finally:
            server.stop()
        results["systems"][server.name] = {"startup_s": server.startup_s, "peak_rss_mib": server.peak_rss / 2**20,
                                           "levels": rows}

    headers = ["system", "conc", "req/s", "out tok/s", "TTFT p50 s", "TTFT p95 s", "TPOT ms", "e2e p95 s",
               "errors", "API CPU us/tok", "load avg"]
    table = []
    for name, sysres in results["systems"].items():
        for r in sysres["levels"]:
            table.append([name, r["concurrency"], r["req_per_s"], r["output_tok_per_s"], r["ttft_p50_s"],
                          r["ttft_p95_s"], 1000 * r["tpot_mean_s"], r["e2e_p95_s"], r["errors"],
                          r["api_cpu_us_per_token"], r["load_avg_1m"]])
    md = markdown_table(headers, table)
    if args.profile_step:
        prof = profile_engine_step(args.model, args.profile_step, num_threads=args.num_threads)
        results["step_profile"] = prof
        md += (f"\n\nOne decode step at batch {prof['batch']} (in-process engine, {prof['threads']} torch threads): "
               f"{prof['decode_step_ms']:.1f} ms; prefill of {prof['batch']} x {PROMPT_TOKENS} tokens took "
               f"{prof['prefill_s']:.2f} s over {prof['prefill_steps']} steps. Top ops by self CPU time:\n\n")
        md += markdown_table(["op", "ms / step", "share"],
                             [[o["op"], o["ms_per_step"], f"{100 * o['share']:.0f}%"] for o in prof["top_ops"]])
    print(md)
    first = systems[0]
    s = results["systems"][first]
    extra = (f"\n{first}: start-up to first healthy {s['startup_s']:.1f} s, server peak RSS (API + engine) "
             f"{s['peak_rss_mib']:.0f} MiB.")
    print(extra)
    if not args.no_write and args.engine == "real":
        write_section(
            "serving",
            "## Online serving (`benchmarks/serving.py`)\n\n"
            f"{machine_line()}. SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to float32), prompts of "
            f"{PROMPT_TOKENS} tokens, {OUTPUT_TOKENS} output tokens with `ignore_eos`, temperature 0, streamed; "
            f"the client runs on the same 2 cores; engine torch threads: {args.num_threads or 'default (2)'}. `load avg` is the machine's 1-minute load average at the "
            f"end of each level: above ~2, other work shares the cores and every figure is pessimistic.\n\n"
            f"{md}\n{extra}\n",
        )
    print_json_last(results)


if __name__ == "__main__":
    main()
