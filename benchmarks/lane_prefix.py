"""Multi-turn conversations on two lanes: does a turn find its history in the prefix cache? (NOTE(lane-prefix))

    python benchmarks/lane_prefix.py                    # three servers, ~3 min on 2 cores
    python benchmarks/lane_prefix.py --users 4 --turns 4 --no-write

``sluice serve --data-parallel-size 2`` (or ``auto`` on 2-3 cores, NOTE(dp-auto) in
sluice/server/lanes.py) runs two engine cores, each with its own prefix cache.  A conversation's next
turn repeats its whole history; sent to the other lane, the history is
prefilled again.  NOTE(lane-prefix): the API process remembers which prompt
blocks it sent to each lane and predicts each lane's wait without the blocks it
holds.  This script runs ``--users`` conversations side by side (each user sends
its next turn when the last one finished), ``--turns`` turns each, on the same
shared system prompt, against three servers one after the other: two lanes with
the prefix memory (``--data-parallel-size 2``), two lanes without it
(``SLUICE_LANE_PREFIX=0``), and one engine core (the default).  Prompts are token ids (a
turn: the history, then ``--user-tokens`` new ones; the history grows by the
turn and ``--max-tokens`` more), so every server sees the same prompts.

Per server: the share of the prompt tokens of turns 2 and later found in the
prefix cache (``/metrics``' ``sluice_prefix_cache_hits`` over ``_queries``,
first turns included in both), those turns' TTFT p50 and p95, and the turns
served a second.  Writes section ``lane_prefix`` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overload as ov  # noqa: E402
from _report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402

from sluice.bench.sse import SSEDecoder  # noqa: E402

SERVERS = [  # (name, extra flags, environment)
    ("two lanes, prefix memory", ["--data-parallel-size", "2"], {}),
    ("two lanes, SLUICE_LANE_PREFIX=0", ["--data-parallel-size", "2"], {"SLUICE_LANE_PREFIX": "0"}),
    ("one engine core (the default)", [], {}),
]


async def _prefix_counts(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    values = {}
    for line in text.splitlines():
        for name in ("sluice_prefix_cache_hits_total", "sluice_prefix_cache_queries_total"):
            if line.startswith(name + " ") or line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("sluice_prefix_cache_hits_total", 0.0), values.get("sluice_prefix_cache_queries_total", 0.0)


async def _turn(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> float:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0}  # fmt: skip
    start = time.perf_counter()
    ttft = None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise SystemExit(f"{url}: HTTP {resp.status}: {(await resp.read())[:200]!r}")
        dec = SSEDecoder()
        async for raw in resp.content.iter_any():
            for data in dec.feed(raw):
                if data == b"[DONE]":
                    assert ttft is not None, "a stream with no token"
                    return ttft
                chunk = json.loads(data)
                if "error" in chunk:
                    raise SystemExit(f"{url}: error event {chunk['error']}")
                if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - start
    raise SystemExit(f"{url}: stream ended without [DONE]")


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    system = [rng.randrange(100, 40_000) for _ in range(args.system_tokens)]
    later: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        hits0, queries0 = await _prefix_counts(session, url)
        t0 = time.perf_counter()

        async def user(u: int) -> None:
            urng = random.Random(args.seed * 1000 + u)
            history = list(system)
            for turn in range(args.turns):
                prompt = history + [urng.randrange(100, 40_000) for _ in range(args.user_tokens)]
                ttft = await _turn(session, url, prompt, args.max_tokens)
                if turn > 0:
                    later.append(ttft)
                # the reply as the next turn's history holds it (ids of our own: the cache holds the prompt's blocks)
                history = prompt + [urng.randrange(100, 40_000) for _ in range(args.max_tokens)]

        await asyncio.gather(*(user(u) for u in range(args.users)))
        wall = time.perf_counter() - t0
        hits1, queries1 = await _prefix_counts(session, url)
    later.sort()
    return {
        "hit_share": (hits1 - hits0) / max(1.0, queries1 - queries0),
        "ttft_p50_s": statistics.median(later),
        "ttft_p95_s": later[min(len(later) - 1, int(0.95 * len(later)))],
        "turns_per_s": args.users * args.turns / wall,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    results: dict[str, Any] = {}
    for name, flags, env in SERVERS:
        port = ov._free_port()
        proc = ov._sluice_serve(port, flags, env)
        try:
            url = f"http://127.0.0.1:{port}"
            ov._wait_healthy(url, [proc], 300)
            results[name] = asyncio.run(run(url, args))
        finally:
            ov._stop([proc])
        r = results[name]
        print(f"{name}: prefix hits {r['hit_share']:.0%} of prompt tokens, later turns' TTFT p50 "
              f"{r['ttft_p50_s'] * 1000:.0f} ms, p95 {r['ttft_p95_s'] * 1000:.0f} ms, {r['turns_per_s']:.2f} turns/s",
              file=sys.stderr)  # fmt: skip
    rows = [[name, f"{r['hit_share']:.0%}", f"{r['ttft_p50_s'] * 1000:.0f}", f"{r['ttft_p95_s'] * 1000:.0f}",
             f"{r['turns_per_s']:.2f}"] for name, r in results.items()]  # fmt: skip
    text = markdown_table(["server", "prompt tokens from the prefix cache", "turns 2+: TTFT p50 (ms)",
                           "turns 2+: TTFT p95 (ms)", "turns a second"], rows)  # fmt: skip
    print(text)
    if not args.no_write:
        write_section("lane_prefix", (
            "## Multi-turn conversations on two lanes (`benchmarks/lane_prefix.py`)\n\n"
            f"{args.users} conversations side by side, {args.turns} turns each (a user sends its next turn when the "
            f"last one finished), SmolLM2: a shared {args.system_tokens}-token system prompt, {args.user_tokens} new "
            f"tokens a turn, {args.max_tokens} output tokens (ignore_eos), the history repeated in every turn "
            "(token ids). NOTE(lane-prefix): the API process sends a turn to the lane it predicts soonest, "
            "counting the prompt blocks it sent each lane before as cached there.\n\n"
            f"{text}\n\n{machine_line()}.\n"))
    print_json_last({"benchmark": "lane_prefix", "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
