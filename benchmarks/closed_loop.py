"""Closed loop on default flags: does ``sluice serve`` with no flags serve what ``--slo off`` serves? (issue 57)

    python benchmarks/closed_loop.py                                  # c=32 and c=128, 4 requests per stream
    python benchmarks/closed_loop.py --requests 2 --peer vllm,llama   # shorter; with the peers (PEERS.md)

The servers one after the other: ``sluice serve`` with no flags but its address (the defaults a new user
gets: ``--slo`` auto, NOTE(lone-class) in sluice/server/admission.py), the same with ``--slo off``, then
the peers asked for (vLLM-CPU, llama-server: ``benchmarks/serving_procs.py`` finds and starts them).
Each gets a warm-up request, then at each level a closed loop of c streams: ``--requests`` x c requests
of 128 prompt tokens and 64 output tokens (``ignore_eos``), streamed, no priority header (all P1), the
client of ``benchmarks/serving.py``.

Target (issue 57): with default flags, an error rate under 0.3% (a 429 is an error) and at least 0.95x
the output tok/s of ``--slo off`` at each level.  Prints a table, writes section ``closed_loop`` of
docs/benchmarks.md (``--no-write``: not), and one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks._report import (  # noqa: E402
    machine_line,
    markdown_table,
    print_json_last,
    steal_seconds,
    steal_share,
    write_section,
)
from benchmarks.serving import (  # noqa: E402
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    Result,
    build_parser,
    level_stats,
    make_prompts,
    one_request,
    requests_at,
)
from benchmarks.serving_procs import (  # noqa: E402
    Server,
    served_model_id,
    sluice_details,
    start_llama,
    start_vllm,
    wait_line,
)

SLUICE_SYSTEMS = {"default": ("sluice (default flags)", []), "off": ("sluice --slo off", ["--slo", "off"])}
MAX_ERROR_RATE = 0.003
MIN_TOK_S_RATIO = 0.95


def start_sluice_flags(args: argparse.Namespace, label: str, flags: list[str]) -> Server:
    """``sluice serve`` with the defaults a new user gets: only its address, the model when not the default,
    and ``flags``."""
    cmd = [sys.executable, "-m", "sluice.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
    if args.model != "smollm2":
        cmd += ["--model", args.model]
    t0 = time.monotonic()
    proc = subprocess.Popen([*cmd, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    m, seen = wait_line(proc, r"ready in .* at (http://\S+)", 900)
    url = m.group(1)
    return Server(label, proc, url, served_model_id(url), time.monotonic() - t0, sluice_details(seen, flags))


async def run_level(server: Server, concurrency: int, num_requests: int, seed: int) -> dict[str, Any]:
    """``benchmarks/serving.py``'s level (fresh connections, its client and statistics), counting the 429s."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=0, force_close=True)  # NOTE(fresh-connections) in serving.py
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1800)) as session:

        async def go(p: list[int]) -> Result:
            async with sem:
                return await one_request(session, server.url, server.model, p)

        t0 = time.perf_counter()
        results = await asyncio.gather(*[go(p) for p in make_prompts(num_requests, seed)])
        wall = time.perf_counter() - t0
    row = level_stats(results, concurrency, wall, float("nan"))
    row["num_429"] = sum(r.error.startswith("HTTP 429") for r in results)
    return row


async def run_levels(server: Server, args: argparse.Namespace) -> list[dict[str, Any]]:
    await run_level(server, 1, 1, seed=999)  # warm-up: first-request costs stay out of the table
    rows = []
    for i, c in enumerate(args.levels):
        n = requests_at(c, args.requests)
        stolen, t = steal_seconds(), time.monotonic()
        row = await run_level(server, c, n, seed=i)
        row["steal_share"] = steal_share(stolen, steal_seconds(), time.monotonic() - t)  # NOTE(steal) in _report
        row["error_rate"] = row["errors"] / max(1, row["requests"])
        rows.append(row)
        print(f"  {server.name} c={c}: {row['requests']} requests, {row['errors']} errors {row['error_sample'] or ''}, "
              f"{row['output_tok_per_s']:.1f} tok/s, TTFT p95 {row['ttft_p95_s']:.2f} s", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def render(results: dict[str, Any]) -> tuple[str, bool]:
    systems = results["systems"]
    off = {r["concurrency"]: r for r in systems.get("off", {}).get("levels", [])}
    headers = ["server", "c", "requests", "errors (429s)", "error rate", "output tok/s", "x --slo off",
               "TTFT p50 s", "TTFT p95 s", "CPU stolen", "load avg"]  # fmt: skip
    rows, met = [], True
    for sid, s in systems.items():
        for r in s["levels"]:
            base = off.get(r["concurrency"])
            ratio = r["output_tok_per_s"] / base["output_tok_per_s"] if base and base["output_tok_per_s"] else float("nan")
            if sid == "default":
                met = met and r["error_rate"] < MAX_ERROR_RATE and ratio >= MIN_TOK_S_RATIO
            stolen = "-" if r.get("steal_share") is None else f"{100 * r['steal_share']:.1f}%"
            rows.append([s["name"], r["concurrency"], r["requests"], f"{r['errors']} ({r['num_429']})",
                         f"{100 * r['error_rate']:.1f}%", r["output_tok_per_s"], ratio, r["ttft_p50_s"], r["ttft_p95_s"],
                         stolen, r["load_avg_1m"]])  # fmt: skip
    table = markdown_table(headers, rows)
    skipped = "".join(f"\n\n{name}: not run ({why})." for name, why in results["skipped"].items())
    body = (
        "## Closed loop on default flags (`benchmarks/closed_loop.py`)\n\n"
        f"{results['machine']}; `{results['command']}`.  Closed loops of c streams, {PROMPT_TOKENS}-token prompts, "
        f"{OUTPUT_TOKENS} output tokens (ignore_eos), streaming, no priority header; `--requests` "
        f"{results['requests_per_stream']} per stream.  Servers one after the other, each with a warm-up request.  "
        "`load avg`: the host's 1-min load average after the level (2 cores: above 2, other work shared them; "
        "`CPU stolen`: the hypervisor's share).\n\n"
        f"{table}{skipped}\n\n"
        f"Target (issue 57): default flags with an error rate under {100 * MAX_ERROR_RATE:.1f}% and at least "
        f"{MIN_TOK_S_RATIO}x `--slo off`'s tok/s at every level: **{'met' if met else 'NOT met'}**."
    )
    return body, met


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    ap.description = __doc__.split("\n\n")[0]
    ap.set_defaults(levels=[32, 128], requests=4)
    args = ap.parse_args(argv)
    command = "python benchmarks/closed_loop.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict[str, Any] = {"benchmark": "closed_loop", "machine": machine_line(), "command": command.strip(),
                               "requests_per_stream": args.requests, "systems": {}, "skipped": {}}  # fmt: skip
    starts: dict[str, Callable[[], Server]] = {
        sid: functools.partial(start_sluice_flags, args, label, flags) for sid, (label, flags) in SLUICE_SYSTEMS.items()}
    starts.update({"vllm": functools.partial(start_vllm, args), "llama": functools.partial(start_llama, args)})
    names = {"vllm": "vLLM-CPU", "llama": "llama-server"}
    for sid in [*SLUICE_SYSTEMS, *args.peer]:
        print(f"starting {sid} ...", file=sys.stderr, flush=True)
        try:
            server = starts[sid]()
        except SystemExit as e:  # a peer not installed here: say so in the section
            results["skipped"][names.get(sid, sid)] = str(e).removeprefix(f"--peer {sid}: ")
            print(f"  {sid}: {e}", file=sys.stderr, flush=True)
            continue
        try:
            rows = asyncio.run(run_levels(server, args))
        finally:
            server.stop()
        results["systems"][sid] = {"name": server.name, "details": server.details, "startup_s": server.startup_s,
                                   "levels": rows}  # fmt: skip
    for sid in ("vllm", "llama"):
        if sid not in args.peer:
            results["skipped"][names[sid]] = f"not asked for: `--peer {sid}` runs it where it is installed (PEERS.md)"
    body, met = render(results)
    results["target_met"] = met
    print(body)
    if not args.no_write:
        write_section("closed_loop", body)
    print_json_last(results)


if __name__ == "__main__":
    main()
