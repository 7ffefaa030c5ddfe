"""Client overhead of ``sluice bench``: how many streamed requests/s it drives, and its CPU cost.

The fake OpenAI server (``python -m sluice.bench.fake_server``) runs in its own
process with zero TTFT, so every millisecond measured is the client's, the
loopback's or the fake's.  Three phases, each bounded (request and time caps):

    burst   closed loop, 64 in flight, 16 tokens each sent in one write
    paced   closed loop, 64 in flight, 16 tokens each one SSE event, 2000 tok/s per stream
    open    Poisson arrivals at 1000 req/s, paced streams (the issue's target)

The client's CPU time (``time.process_time``) per request gives its ceiling on
one core.  Run:  python benchmarks/bench_client.py   (about 20 s; last line JSON)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402
from sluice.bench.aio import run_event_loop  # noqa: E402
from sluice.bench.arrivals import LoadMode, LoadSpec  # noqa: E402
from sluice.bench.client import OpenAIStreamClient  # noqa: E402
from sluice.bench.runner import run_phase  # noqa: E402
from sluice.bench.summary import summarize  # noqa: E402
from sluice.bench.workload import WorkloadSpec, generate_requests, parse_length  # noqa: E402

PHASES = [
    # name, fake server flags, load, requests
    ("burst", [], LoadSpec(LoadMode.CLOSED, concurrency=64), 6000),
    ("paced", ["--tokens-per-s", "2000"], LoadSpec(LoadMode.CLOSED, concurrency=64), 6000),
    ("open", ["--tokens-per-s", "2000"], LoadSpec(LoadMode.POISSON, rate=1000), 6000),
]
WORKLOAD = WorkloadSpec(input_len=parse_length(32), output_len=parse_length(16))


def start_fake(flags: list[str]) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(
        [sys.executable, "-m", "sluice.bench.fake_server", "--port", "0", *flags],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    if not line.startswith("listening on "):
        p.kill()
        raise RuntimeError(f"fake server did not start: {line!r}")
    return p, line.removeprefix("listening on ")


async def measure(url: str, load: LoadSpec, n: int) -> dict[str, float]:
    async with OpenAIStreamClient(url, model="fake", timeout_s=30) as client:
        # warm-up: open the pool's connections, JIT nothing, fill caches
        await run_phase(client, generate_requests(WORKLOAD, 1), LoadSpec(LoadMode.CLOSED, concurrency=64),
                        max_requests=500, duration_s=10, drain_s=10)  # fmt: skip
        cpu0, t0 = time.process_time(), time.perf_counter()
        res = await run_phase(client, generate_requests(WORKLOAD, 0), load, max_requests=n, duration_s=30, drain_s=30)  # fmt: skip
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    s = summarize(res.records)
    return {
        "requests": len(res.records),
        "errors": s["num_errors"],
        "rps": s["rps"],
        "output_tok_s": s["output_tok_s"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "client_cpu_ms_per_req": 1000 * cpu / len(res.records),
        "client_cpu_share": cpu / wall,
        "ceiling_rps_per_core": len(res.records) / cpu,
    }


def main() -> None:
    load_before = os.getloadavg()[0]
    results: dict[str, dict[str, float]] = {}
    for name, flags, load, n in PHASES:
        proc, url = start_fake(flags)
        try:
            results[name] = run_event_loop(measure(url, load, n))
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    headers = ["phase", "load", "requests", "errors", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "client CPU ms/req", "client CPU share", "ceiling req/s per core"]  # fmt: skip
    rows = [
        [name, load.describe(), int(r["requests"]), int(r["errors"]), round(r["rps"]), round(r["output_tok_s"]), r["ttft_p50_ms"],
         r["ttft_p99_ms"], r["client_cpu_ms_per_req"], r["client_cpu_share"], round(r["ceiling_rps_per_core"])]
        for (name, _, load, _), r in zip(PHASES, results.values(), strict=True)
    ]  # fmt: skip
    table = markdown_table(headers, rows)
    print(table)
    target_ok = results["open"]["rps"] >= 950 and results["open"]["errors"] == 0
    load_after = os.getloadavg()[0]
    body = (
        "## `sluice bench` client overhead (`benchmarks/bench_client.py`)\n\n"
        f"{machine_line()}; {os.cpu_count()} cores shared by the client, the fake server "
        "(`python -m sluice.bench.fake_server`, zero TTFT, own process) and anything else running "
        f"(1-min load average {load_before:.1f} before, {load_after:.1f} after: above ~2 the client and "
        "the fake are starved and the req/s columns drop; CPU ms/req stays meaningful).  "
        "16 output tokens per request, 32-token prompts, chat API, streaming with usage.\n\n"
        f"{table}\n\n"
        f"Target: drive >= 1,000 streamed requests/s against a fast fake server: "
        f"**{'met' if target_ok else 'NOT met'}** (open loop achieved {results['open']['rps']:,.0f} req/s).  "
        "`ceiling req/s per core` is 1 / client CPU time per request: what one core of client could drive "
        "if the server were free."
    )
    write_section("bench_client", body)
    print_json_last({"bench": "bench_client", "target_met": target_ok, "loadavg_before": load_before, "loadavg_after": load_after, **{f"{k}_{m}": v for k, r in results.items() for m, v in r.items()}})  # fmt: skip


if __name__ == "__main__":
    main()
