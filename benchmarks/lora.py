"""LoRA serving benchmark: ``sluice serve`` with eight adapters, against the base model alone.

    python benchmarks/lora.py                                  # SmolLM2 Q4_1, rank 16 on q/k/v/o, c = 8, 32
    python benchmarks/lora.py --targets all --rank 16          # adapters on all seven projections
    python benchmarks/lora.py --model /tmp/tiny --levels 2 --requests 2 --no-write   # smoke

Random adapters (PEFT files written to a temp dir, std ``--std``) for the
model's shapes; the server gets ``--lora-modules cold=... a0=... a7=...``
with ``--max-loras 8 --max-cpu-loras 8`` (so ``cold``, listed first, is
evicted at start-up).  Per concurrency level, three runs with the same
prompts (128 tokens, 64 output tokens, ``ignore_eos``, greedy, streamed):

    0 adapters   every request to the base model
    1 adapter    every request to a0
    8 adapters   request i to a(i % 8)

output tok/s (and its ratio to the base model's), TTFT p50/p95.  Then the
first request after a load: ``POST /v1/load_lora_adapter`` of a new adapter
(its load time) and the TTFT of the next request to it, next to a warm
adapter's TTFT; and a request to ``cold``, whose TTFT includes its own load.

Targets (issue 13): with 8 adapters at concurrency 32, >= 80% of the base
model's throughput; with one adapter, >= 90%.  Prints a table, writes the
``lora`` section of docs/benchmarks.md (unless ``--no-write``), and prints one
JSON line last.  Only 127.0.0.1 is contacted; the server started here is
stopped here.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402
from benchmarks.serving import (  # noqa: E402
    Result,
    Server,
    _pct,
    make_prompts,
    one_request,
    start_sluice,
)

TARGETS = {"qv": ("q_proj", "v_proj"), "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}  # fmt: skip
NUM_ADAPTERS = 8


def make_adapters(model: str, root: Path, rank: int, targets: str, std: float) -> dict[str, Path]:
    from lora_factory import make_lora_dir

    from sluice.models.config import ModelConfig
    from sluice.models.loader import load_model_config, resolve_model

    cfg = ModelConfig.from_hf(load_model_config(resolve_model(model)))
    names = ["cold", *[f"a{i}" for i in range(NUM_ADAPTERS)], "fresh"]
    return {n: make_lora_dir(root / n, cfg, targets=TARGETS[targets], rank=rank, seed=i, std=std) for i, n in enumerate(names)}


def start_server(args: argparse.Namespace, adapters: dict[str, Path]) -> Server:
    modules = [f"{n}={p}" for n, p in adapters.items() if n != "fresh"]
    return start_sluice(args, more_flags=[
        "--max-loras", str(NUM_ADAPTERS), "--max-cpu-loras", str(NUM_ADAPTERS),
        "--max-lora-rank", str(max(args.rank, 16)), "--lora-modules", *modules,
        "--enable-runtime-lora", "--lora-dir", str(adapters["fresh"].parent)])  # fmt: skip


async def run(server: Server, concurrency: int, prompts: list[list[int]], models: list[str]) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=900)) as session:  # fmt: skip

        async def go(p: list[int], m: str) -> Result:
            async with sem:
                return await one_request(session, server.url, m, p)

        t0 = time.perf_counter()
        results = await asyncio.gather(*[go(p, m) for p, m in zip(prompts, models)])
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    ttfts = sorted(r.ttft for r in ok) or [float("nan")]
    return {"output_tok_per_s": sum(r.tokens for r in results) / wall, "ttft_p50_s": _pct(ttfts, 50),
            "ttft_p95_s": _pct(ttfts, 95), "errors": len(results) - len(ok),
            "error_sample": [r.error for r in results if not r.ok][:2], "wall_s": wall}  # fmt: skip


async def first_after_load(server: Server, adapters: dict[str, Path]) -> dict[str, Any]:
    prompt = make_prompts(1, seed=4242)[0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        warm = await one_request(session, server.url, "a0", prompt)
        t0 = time.perf_counter()
        async with session.post(server.url + "/v1/load_lora_adapter",
                                json={"lora_name": "fresh", "lora_path": str(adapters["fresh"])}) as r:  # fmt: skip
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"load_lora_adapter: HTTP {r.status}: {text}")
            engine_load_s = float(r.headers.get("x-sluice-lora-load-seconds", "nan"))
        endpoint_s = time.perf_counter() - t0
        after_load = await one_request(session, server.url, "fresh", prompt)
        cold = await one_request(session, server.url, "cold", prompt)  # evicted at start-up: this request loads it
    return {"warm_adapter_ttft_s": warm.ttft, "load_endpoint_s": endpoint_s, "load_engine_s": engine_load_s,
            "ttft_after_endpoint_load_s": after_load.ttft, "ttft_cold_adapter_s": cold.ttft,
            "errors": sum(not r.ok for r in (warm, after_load, cold))}  # fmt: skip


async def bench(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    names = [f"a{i}" for i in range(NUM_ADAPTERS)]
    await run(server, NUM_ADAPTERS, make_prompts(NUM_ADAPTERS, seed=999), names)  # warm-up, every adapter once
    rows = []
    for li, c in enumerate(args.levels):
        n = args.requests * c
        prompts = make_prompts(n, seed=li)
        for label, models in (("0", [server.model] * n), ("1", ["a0"] * n), ("8", [names[i % NUM_ADAPTERS] for i in range(n)])):
            row = {"concurrency": c, "adapters": label, "requests": n, **await run(server, c, prompts, models)}
            rows.append(row)
            print(f"  c={c} adapters={label}: {row['output_tok_per_s']:.1f} tok/s, TTFT p95 {row['ttft_p95_s']:.3f} s, "
                  f"errors {row['errors']}", file=sys.stderr, flush=True)  # fmt: skip
    for row in rows:
        base = next(r for r in rows if r["concurrency"] == row["concurrency"] and r["adapters"] == "0")
        row["vs_base"] = row["output_tok_per_s"] / base["output_tok_per_s"]
    return {"levels": rows, "first_after_load": await first_after_load(server, args.adapters)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--levels", default="8,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--requests", type=int, default=4, help="requests per run = this x concurrency")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", choices=sorted(TARGETS), default="attn")
    ap.add_argument("--std", type=float, default=0.02, help="std of the random A and B entries")
    ap.add_argument("--kv-cache-memory", default=None)
    ap.add_argument("--num-threads", type=int, default=None, help="engine torch threads (sluice serve --num-threads)")
    ap.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="sluice-lora-bench-") as tmp:
        args.adapters = make_adapters(args.model, Path(tmp), args.rank, args.targets, args.std)
        server = start_server(args, args.adapters)
        server.watch_rss()
        try:
            out = asyncio.run(bench(server, args))
        finally:
            server.stop()

    rows = out["levels"]
    by = {(r["concurrency"], r["adapters"]): r for r in rows}
    top = max(args.levels)
    checks = {f"8_adapters_c{top}_vs_base": by[(top, "8")]["vs_base"], f"1_adapter_c{top}_vs_base": by[(top, "1")]["vs_base"]}
    result = {"benchmark": "lora", "model": args.model, "rank": args.rank, "targets": TARGETS[args.targets],
              "engine_threads": args.num_threads or "default", "levels": rows, "first_after_load": out["first_after_load"],
              "checks": checks, "meets_targets": checks[f"8_adapters_c{top}_vs_base"] >= 0.8 and checks[f"1_adapter_c{top}_vs_base"] >= 0.9,
              "peak_rss_mib": server.peak_rss / 2**20, "server": server.details, "machine": machine_line()}  # fmt: skip
    table = markdown_table(
        ["concurrency", "adapters", "output tok/s", "vs base", "TTFT p50 s", "TTFT p95 s", "errors"],
        [[r["concurrency"], r["adapters"], r["output_tok_per_s"], f"{r['vs_base']:.0%}", r["ttft_p50_s"],
          r["ttft_p95_s"], r["errors"]] for r in rows],
    )  # fmt: skip
    f = out["first_after_load"]
    loads = markdown_table(
        ["warm adapter TTFT s", "load endpoint s (engine load)", "TTFT right after the load s", "TTFT of a request that loads its adapter s"],
        [[f["warm_adapter_ttft_s"], f"{f['load_endpoint_s']:.3f} ({f['load_engine_s']:.3f})", f["ttft_after_endpoint_load_s"],
          f["ttft_cold_adapter_s"]]],
    )  # fmt: skip
    print(table)
    print()
    print(loads)
    if not args.no_write:
        write_section("lora", f"## LoRA adapters (`benchmarks/lora.py`)\n\n{args.model}, rank {args.rank} on "
                      f"{', '.join(TARGETS[args.targets])}, prompts of 128 tokens, 64 output tokens; {server.details}; "
                      f"{machine_line()}.\n\n"
                      f"{table}\n\n{loads}\n")  # fmt: skip
    print_json_last(result)


if __name__ == "__main__":
    main()
