"""Sparse P0 beside a full batch: what protecting P0 costs the other classes when P0 is rare (issue 11).

    python benchmarks/sparse_p0.py                      # ~5 minutes on 2 cores
    python benchmarks/sparse_p0.py --phase-s 10 --rounds 1 --no-write   # smoke

One ``sluice serve`` (default settings).  ``overload.py``'s capacity loop
(``--users`` closed-loop P2 clients, 16-token streamed completions, a 429
backs off 50 ms) runs in phases of ``--phase-s`` seconds: P2 alone, then
beside Poisson P0 arrivals at each rate of ``--p0-rates``, the phases
alternating over ``--rounds``.  Per phase: P2 served per second (the first
quarter, the ramp, not counted), and the P0 requests within
their target (4x the lone TTFT, as in ``overload.py``), their TTFT p50 and max.

The engine bounds its steps while a tight TTFT target is about (NOTE(step-cap),
NOTE(row-cap) in ``sluice.engine.core``), and remembers a target for
``TARGET_MEMORY_S`` after its request came (NOTE(target-memory) in
``sluice.engine.sched_signals``): with P0 rare, a P0 arriving into an unbounded
step starts mid-step (NOTE(mid-step-express)), and the P2 batch keeps its size.
A pause of ``TARGET_MEMORY_S`` + 2 s before every phase lets the last phase's
targets pass.  Writes section ``sparse_p0`` of docs/benchmarks.md and prints one
JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overload as ov  # noqa: E402
from _report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402

from sluice.engine.sched_signals import TARGET_MEMORY_S  # noqa: E402

MAX_TOKENS = 16


async def phase(server: ov.Server, users: int, seconds: float, p0_rate: float, target: float,
                seed: int) -> dict[str, Any]:  # fmt: skip
    """One phase: ``overload.capacity``'s closed loop of ``users`` P2 clients, and Poisson P0 arrivals
    at ``p0_rate`` (0: none) beside it."""
    p0: list[ov.Record] = []

    async def p0_arrivals() -> None:
        rng = random.Random(seed)
        end = time.perf_counter() + seconds
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            t0 = time.perf_counter()
            sent = []
            while p0_rate > 0:
                await asyncio.sleep(rng.expovariate(p0_rate))
                if time.perf_counter() >= end:
                    break
                sent.append(asyncio.create_task(ov.send(s, server, 900_000 + len(sent), 0, MAX_TOKENS, t0, 60)))
            p0.extend([await t for t in sent])

    p2_rps, _ = await asyncio.gather(ov.capacity(server, users, seconds, MAX_TOKENS, seed), p0_arrivals())
    ttfts = sorted(r.ttft for r in p0 if r.is_served and r.ttft is not None)
    return {
        "p0_rate": p0_rate, "p2_rps": p2_rps, "p0_sent": len(p0),
        "p0_within": sum(1 for t in ttfts if t <= target), "p0_refused": sum(1 for r in p0 if r.status == 429),
        "p0_ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None, "p0_ttft_max_s": ttfts[-1] if ttfts else None,
    }  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with ov.start_server("sluice", argparse.Namespace(sluice_args=args.sluice_args, concurrency=args.users)) as server:
        await phase(server, args.users, 5.0, 0.0, 1.0, 0)  # warm-up: kernels, the step-time fit
        lone = await ov.lone_ttft(server, MAX_TOKENS)
        target = ov.targets_for(lone)["p0"]
        print(f"lone TTFT {lone * 1000:.0f} ms, P0 target {target * 1000:.0f} ms", file=sys.stderr)
        phases = []
        for rnd in range(args.rounds):
            for rate in (0.0, *args.p0_rates):
                await asyncio.sleep(TARGET_MEMORY_S + 2.0)
                res = await phase(server, args.users, args.phase_s, rate, target, 10 * rnd + int(10 * rate))
                res["round"] = rnd + 1
                phases.append(res)
                print(f"  round {rnd + 1}, P0 {rate:g}/s: P2 {res['p2_rps']:.1f} req/s, P0 {res['p0_within']}/"
                      f"{res['p0_sent']} within target", file=sys.stderr)  # fmt: skip
    return {"lone_ttft_s": lone, "p0_target_s": target, "phases": phases}


def table(result: dict[str, Any]) -> str:
    rows: list[list[object]] = []
    for p in result["phases"]:
        rate = p["p0_rate"]
        p50, top = p["p0_ttft_p50_s"], p["p0_ttft_max_s"]
        rows.append([
            p["round"], "none" if rate == 0 else f"{rate:g}/s", f"{p['p2_rps']:.1f}",
            "-" if rate == 0 else f"{p['p0_within']}/{p['p0_sent']}", "-" if rate == 0 else p["p0_refused"],
            "-" if p50 is None else f"{p50 * 1000:.0f} / {top * 1000:.0f}",
        ])  # fmt: skip
    return markdown_table(["round", "P0 arrivals", "P2 served (req/s)", "P0 within target", "P0 refused",
                           "P0 TTFT p50 / max (ms)"], rows)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=64, help="closed-loop P2 clients")
    ap.add_argument("--phase-s", type=float, default=25.0, help="seconds per phase")
    ap.add_argument("--p0-rates", type=lambda v: tuple(float(x) for x in v.split(",")), default=(0.5, 2.0),
                    help="P0 arrivals per second, one phase each (a phase without P0 always runs first)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sluice-args", default="", help="extra `sluice serve` flags")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    t_start = time.monotonic()
    result = asyncio.run(run(args))
    text = table(result)
    print(text, flush=True)
    if not args.no_write:
        write_section("sparse_p0", (
            "## Sparse P0 beside a full batch (`benchmarks/sparse_p0.py`)\n\n"
            f"`python benchmarks/sparse_p0.py` ({machine_line()}): one `sluice serve` (default settings), a closed "
            f"loop of {args.users} P2 clients (16-token streamed completions) in {args.phase_s:g}-s phases, alone or "
            f"beside Poisson P0 arrivals, {args.rounds} rounds. P0's target is 4x the lone TTFT "
            f"({result['lone_ttft_s'] * 1000:.0f} ms): {result['p0_target_s'] * 1000:.0f} ms. The engine remembers "
            f"a target for {TARGET_MEMORY_S:g} s after its request came (NOTE(target-memory)).\n\n{text}\n"
        ))  # fmt: skip
    print_json_last({"benchmark": "sparse_p0", "users": args.users, "phase_s": args.phase_s,
                     "target_memory_s": TARGET_MEMORY_S, "wall_s": round(time.monotonic() - t_start, 1), **result})  # fmt: skip


if __name__ == "__main__":
    main()
