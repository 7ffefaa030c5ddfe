"""Overload: does P0 keep its TTFT SLA at 3x and 5x capacity, with no congestion collapse? (issue 11)

    python benchmarks/overload.py                                   # full run, see durations below
    python benchmarks/overload.py --step-s 5 --calibrate-s 5 --targets sluice   # smoke, ~2 min

Four servers, one after the other, each measured against its own capacity:

    sluice    ``sluice serve --model smollm2`` with default settings (no --slo: the auto targets)
    sluice-dp the same with ``--data-parallel-size 2``: two engine cores behind one API process,
              lending each other their idle cores (NOTE(data-parallel), NOTE(lane-lend) in
              sluice/server/lanes.py)
    sluice-auto the same with ``--data-parallel-size auto`` (not in the default list; NOTE(dp-auto))
    gateway   ``sluice gateway`` (least_load, graded degradation) in front of two ``sluice serve``
              replicas of one engine thread each
    vllm      vLLM-CPU (``--scheduling-policy priority``, requests carry ``priority``) on the
              same weights (``benchmarks/export_hf.py``), from the venv ``--vllm-python``

For each: the lone-request TTFT (median of 16 sequential requests, NOTE(lone-median)), then the
capacity (completed requests/s of a closed loop at ``--concurrency``, every
request p2: the full-batch rate, NOTE(full-batch)), then open-loop Poisson arrivals at 0.5x, 1x, 2x, 3x, 5x that
capacity for ``--step-s`` each: 20% p0 / 30% p1 / 50% p2, prompts of ~10
words, ``--max-tokens`` (16) output tokens with ignore_eos, streaming.  A
``/health`` probe runs every 0.2 s during each step.

SLA (the same rule for every server, from its own lone TTFT L): p0 <= 4 L,
p1 <= max(2 s, 10 L), p2 <= max(5 s, 25 L): sluice's own auto targets, here
measured at the client.  Attainment = share of *sent* requests served within
their class's target (a 429 is a miss); goodput = such requests per second.

Durations: with the defaults (60 s steps, 20 s calibration) one server takes
about 6.5 minutes of load plus start-up (sluice ~15 s, vLLM ~2-3 min): about
32 minutes for all four on 2 cores.  Run it on a quiet machine: every number
moves with what else the cores are doing.

Prints a table per server, writes section ``overload`` of docs/benchmarks.md
and docs/overload.png, and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import (  # noqa: E402
    machine_line,
    markdown_table,
    print_json_last,
    steal_seconds,
    steal_share,
    write_section,
)

from sluice.bench.sse import SSEDecoder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CLASSES = ("p0", "p1", "p2")
MIX = (0.2, 0.3, 0.5)
MULTIPLIERS = (0.5, 1.0, 2.0, 3.0, 5.0)
# the sluice serve targets and their extra flags (before --sluice-args)
SLUICE_TARGETS: dict[str, list[str]] = {"sluice": [], "sluice-dp": ["--data-parallel-size", "2"],
                                        "sluice-auto": ["--data-parallel-size", "auto"]}  # fmt: skip
TOPICS = ["rivers", "bread", "trains", "owls", "maps", "tea", "bridges", "clocks", "kites", "salt", "moss", "glass"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Record:
    priority: str
    start: float  # seconds after the step's start
    status: int = 0
    ttft: float | None = None  # first content token, seconds after sending
    answered: float | None = None  # status line, seconds after sending
    retry_after: str | None = None
    error: str = ""
    code: str = ""  # the error body's code (429: slo_unattainable, shed, queue_full, degraded_shed)

    @property
    def is_served(self) -> bool:
        return self.status == 200 and not self.error and self.ttft is not None


@dataclass
class Server:
    name: str
    url: str
    model: str
    priority_field: bool  # send `priority` as an int in the body (vLLM) instead of x-priority
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


# ---------------------------------------------------------------- processes


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"{p.args[:4]} exited with {p.returncode} during start-up")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} not healthy after {timeout:.0f} s")
        time.sleep(0.5)


def _spawn(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, **(env or {})})  # fmt: skip


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def _sluice_serve(port: int, extra: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return _spawn([PY, "-m", "sluice.cli", "serve", "--model", "smollm2", "--served-model-name", "smollm2",
                   "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory", "256MiB",
                   "--log-level", "warning", *extra], env)  # fmt: skip


@contextlib.contextmanager
def start_server(name: str, args: argparse.Namespace) -> Iterator[Server]:
    procs: list[subprocess.Popen[bytes]] = []
    path: Path | None = None  # the gateway's config file
    try:
        if name in SLUICE_TARGETS:
            port = _free_port()
            dp = SLUICE_TARGETS[name]
            procs.append(_sluice_serve(port, [*dp, *args.sluice_args.split()]))
            server = Server(name, f"http://127.0.0.1:{port}", "smollm2", False, procs)
            _wait_healthy(server.url, procs, 300)
        elif name == "gateway":
            ports = [_free_port(), _free_port()]
            for p in ports:  # NOTE(two-replicas): one engine thread each, so the pair shares the 2 cores
                procs.append(_sluice_serve(p, ["--num-threads", "1", *args.sluice_args.split()]))
            for p in ports:
                _wait_healthy(f"http://127.0.0.1:{p}", procs, 300)
            gport = _free_port()
            cfg = {"port": gport, "policy": "least_load", "scrape_interval": 0.5,
                   "timeouts": {"connect_s": 2.0, "first_byte_s": 120.0, "idle_s": 60.0},
                   "models": {"smollm2": {"versions": [{"name": "v1", "replicas": [f"http://127.0.0.1:{p}" for p in ports]}]}}}  # fmt: skip
            path = Path(tempfile.mkstemp(prefix="overload-gateway-", suffix=".yaml")[1])
            path.write_text(json.dumps(cfg))  # JSON is YAML
            procs.append(_spawn([PY, "-m", "sluice.cli", "gateway", "--config", str(path), "--log-level", "warning"]))
            server = Server(name, f"http://127.0.0.1:{gport}", "smollm2", False, procs)
            _wait_healthy(server.url, procs, 60)
        elif name == "vllm":
            hf = ROOT / ".peers" / "smollm2-hf"  # the copy serving.py uses (benchmarks/export_hf.py)
            if not (hf / "config.json").exists():
                subprocess.run([PY, str(ROOT / "benchmarks" / "export_hf.py"), str(hf)], check=True)
            port = _free_port()
            env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                   "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}  # fmt: skip
            procs.append(_spawn([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
                                 "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "2048",
                                 "--max-num-seqs", str(args.concurrency), "--scheduling-policy", "priority",
                                 "--host", "127.0.0.1", "--port", str(port)], env))  # fmt: skip
            server = Server(name, f"http://127.0.0.1:{port}", "smollm2", True, procs)
            _wait_healthy(server.url, procs, 600)
        else:
            raise SystemExit(f"unknown target {name!r}")
        yield server
    finally:
        _stop(procs)
        if path is not None:
            path.unlink(missing_ok=True)


# ---------------------------------------------------------------- the client


def _body(server: Server, i: int, priority: int, max_tokens: int) -> dict[str, Any]:
    prompt = f"Write a short note about {TOPICS[i % len(TOPICS)]} number {i}:"
    body: dict[str, Any] = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                            "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    if server.priority_field:
        body["priority"] = priority  # vLLM: lower is served first
    return body


async def send(session: aiohttp.ClientSession, server: Server, i: int, priority: int, max_tokens: int,
               t0: float, timeout: float) -> Record:  # fmt: skip
    rec = Record(CLASSES[priority], time.perf_counter() - t0)
    start = time.perf_counter()
    headers = {} if server.priority_field else {"x-priority": CLASSES[priority]}
    try:
        async with asyncio.timeout(timeout):
            async with session.post(server.url + "/v1/completions", json=_body(server, i, priority, max_tokens),
                                    headers=headers) as resp:  # fmt: skip
                rec.status, rec.answered = resp.status, time.perf_counter() - start
                rec.retry_after = resp.headers.get("retry-after")
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}"
                    with contextlib.suppress(ValueError, AttributeError):
                        rec.code = str(json.loads(await resp.read())["error"].get("code") or "")
                    return rec
                dec = SSEDecoder()
                async for raw in resp.content.iter_any():
                    for data in dec.feed(raw):
                        if data == b"[DONE]":
                            return rec
                        chunk = json.loads(data)
                        if "error" in chunk:
                            rec.error = "error event in stream"
                            with contextlib.suppress(AttributeError):
                                rec.code = str(chunk["error"].get("code") or "")
                            return rec
                        if rec.ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                            rec.ttft = time.perf_counter() - start
                rec.error = "stream ended without [DONE]"
    except TimeoutError:
        rec.error = "timeout"
    except aiohttp.ClientError as e:
        rec.error = f"connection error: {type(e).__name__}"
    return rec


def _classes(rng: random.Random, n: int) -> list[int]:
    return rng.choices(range(3), MIX, k=n)


LONE_REQUESTS = 16  # NOTE(lone-median): sequential lone requests whose median TTFT sets the targets


async def lone_ttft(server: Server, max_tokens: int) -> float:
    """Median TTFT of ``LONE_REQUESTS`` sequential P0 requests, after one warm-up request.

    NOTE(lone-median): a lone TTFT on a small host is bimodal (about a third of the requests
    take half as long again), so a median of a few requests moved from one server start to
    the next, and every SLA target with it; a median of 16 moves less.
    """
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        recs = [await send(s, server, 10_000 + i, 0, max_tokens, t0, 60) for i in range(LONE_REQUESTS + 1)]
    ttfts = sorted(r.ttft for r in recs[1:] if r.ttft is not None)
    if not ttfts:
        raise SystemExit(f"{server.name}: no lone request succeeded: {[r.error for r in recs]}")
    return ttfts[len(ttfts) // 2]


async def capacity(server: Server, concurrency: int, seconds: float, max_tokens: int, seed: int) -> float:
    """Completed requests/s of a closed loop at ``concurrency`` users, every request p2 (a 429 backs off 50 ms).

    NOTE(full-batch): p2 only, so that no tight target bounds the server's batch: the
    capacity is the engine's full-batch rate.  With the class mix, sluice's P0 targets
    bound its steps (NOTE(row-cap) in sluice.engine.core), its closed-loop rate drops,
    and every load multiple would be a multiple of that smaller rate.

    NOTE(capacity-first): so it runs before ``lone_ttft``: the lone P0 requests' target keeps
    bounding sluice's batches for a while after them (NOTE(target-memory)), and a capacity
    measured then is that of smaller batches: lone-first, the 3x step served more than the
    measured capacity.
    """
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter()
        t_warm = t0 + seconds / 4  # NOTE(warm-up): completions of the first quarter (the ramp) do not count
        t_end = t0 + seconds

        async def user(k: int) -> None:
            nonlocal done
            i = 0
            # a slow server: the window grows (up to 4x) until 2 x concurrency requests completed
            while (now := time.perf_counter()) < t_end or (done < 2 * concurrency and now < t0 + 4 * seconds):
                r = await send(s, server, 100_000 * k + i, 2, max_tokens, t0, 120)
                if t_warm <= time.perf_counter():
                    done += r.is_served
                if r.status == 429:
                    await asyncio.sleep(0.05)
                i += 1

        await asyncio.gather(*(user(k) for k in range(concurrency)))
        return max(1, done) / (time.perf_counter() - t_warm)


async def load_step(server: Server, rate: float, seconds: float, max_tokens: int, seed: int,
                    timeout: float) -> tuple[list[Record], list[float]]:  # fmt: skip
    """Open-loop Poisson arrivals at ``rate`` for ``seconds``; the records and /health latencies."""
    rng = random.Random(seed)
    health: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter()

        async def probe() -> None:
            while time.perf_counter() - t0 < seconds:
                t = time.perf_counter()
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with asyncio.timeout(5), s.get(server.url + "/health") as r:
                        await r.read()
                health.append(time.perf_counter() - t)
                await asyncio.sleep(0.2)

        prober = asyncio.create_task(probe())
        tasks = []
        t, i = 0.0, 0
        try:
            while True:
                t += rng.expovariate(rate)
                if t >= seconds:
                    break
                delay = t0 + t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(s, server, i, _classes(rng, 1)[0], max_tokens, t0, timeout)))
                i += 1
            records = list(await asyncio.gather(*tasks))
            await prober
        finally:
            prober.cancel()
    return records, health


# ---------------------------------------------------------------- summaries


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def targets_for(lone: float) -> dict[str, float]:
    return {"p0": 4 * lone, "p1": max(2.0, 10 * lone), "p2": max(5.0, 25 * lone)}


def summarize(records: list[Record], health: list[float], targets: dict[str, float], seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {"classes": {}}
    good_all = 0
    for c in CLASSES:
        recs = [r for r in records if r.priority == c]
        served = [r for r in recs if r.is_served]
        ttfts = [r.ttft for r in served if r.ttft is not None]
        good = sum(1 for t in ttfts if t <= targets[c])
        good_all += good
        out["classes"][c] = {
            "sent": len(recs),
            "served": len(served),
            "shed": sum(1 for r in recs if r.status == 429),
            "errors": sum(1 for r in recs if not r.is_served and r.status != 429),
            "ttft_p50_s": _pct(ttfts, 0.50),
            "ttft_p95_s": _pct(ttfts, 0.95),
            "ttft_p99_s": _pct(ttfts, 0.99),
            "attainment": good / len(recs) if recs else None,
            "goodput_rps": good / seconds,
        }
    shed = [r for r in records if r.status == 429]
    out["goodput_rps"] = good_all / seconds
    out["num_5xx"] = sum(1 for r in records if r.status >= 500)
    out["num_timeouts"] = sum(1 for r in records if r.error == "timeout")
    answered = [r.answered for r in shed if r.answered is not None]
    out["shed_answer_p50_s"] = _pct(answered, 0.50)
    out["shed_answer_p99_s"] = _pct(answered, 0.99)
    out["shed_within_50ms"] = sum(1 for a in answered if a <= 0.05) / len(answered) if answered else None
    # a started request shed mid-stream (sluice's NOTE(stalled)): an error event after HTTP 200, by code
    in_stream = [r.code or "?" for r in records if r.error == "error event in stream"]
    out["stream_errors_by_code"] = {c: in_stream.count(c) for c in sorted(set(in_stream))}
    codes: dict[str, list[float]] = {}
    for r in shed:
        codes.setdefault(r.code or "?", []).append(r.answered or 0.0)
    # per 429 code: how many, and how fast (p99 s): a shed *queued* request has waited before its 429
    out["shed_by_code"] = {k: {"count": len(v), "answer_p99_s": _pct(v, 0.99)} for k, v in sorted(codes.items())}
    out["shed_with_retry_after"] = sum(1 for r in shed if r.retry_after) / len(shed) if shed else None
    out["health_p99_s"] = _pct(health, 0.99)
    return out


_SERVER_SERIES = ("sluice_time_to_first_token_seconds", "sluice_queue_time_seconds")


async def server_sums(server: Server) -> dict[str, float]:
    """``{series:class: (sum, count)}`` of the server-side TTFT and queue-time histograms (sluice only)."""
    out: dict[str, float] = {}
    if server.name not in SLUICE_TARGETS:
        return out
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with aiohttp.ClientSession() as s, asyncio.timeout(10), s.get(server.url + "/metrics") as r:
            text = await r.text()
        for line in text.splitlines():
            for series in _SERVER_SERIES:
                for part in ("_sum", "_count"):
                    if line.startswith(series + part + "{"):
                        c = line.split('priority="', 1)[1][:2]
                        out[f"{series}{part}:{c}"] = float(line.rsplit(" ", 1)[1])
    return out


def server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean server-side TTFT and queue time per class over one step (from histogram deltas)."""
    out: dict[str, float | None] = {}
    for series in _SERVER_SERIES:
        for c in CLASSES:
            n = after.get(f"{series}_count:{c}", 0.0) - before.get(f"{series}_count:{c}", 0.0)
            total = after.get(f"{series}_sum:{c}", 0.0) - before.get(f"{series}_sum:{c}", 0.0)
            out[f"{series.removeprefix('sluice_')}_mean:{c}"] = total / n if n > 0 else None
    return out


async def run_server(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    # NOTE(capacity-first): the closed loop runs before the lone P0 requests, whose target would
    # bound the loop's batches for the scheduler's TARGET_MEMORY_S otherwise
    cap = await capacity(server, args.concurrency, args.calibrate_s, args.max_tokens, args.seed)
    lone = await lone_ttft(server, args.max_tokens)
    targets = targets_for(lone)
    print(f"{server.name}: lone TTFT {lone * 1000:.0f} ms, capacity {cap:.2f} req/s; targets "
          + ", ".join(f"{c} {t:.2f}s" for c, t in targets.items()), file=sys.stderr)  # fmt: skip
    steps: dict[str, Any] = {}
    for k, mult in enumerate(args.loads):
        t = time.monotonic()
        before, stolen = await server_sums(server), steal_seconds()
        records, health = await load_step(server, mult * cap, args.step_s, args.max_tokens, args.seed + k,
                                          args.timeout)  # fmt: skip
        steps[f"{mult:g}"] = summarize(records, health, targets, args.step_s)
        s = steps[f"{mult:g}"]
        s["steal_share"] = steal_share(stolen, steal_seconds(), time.monotonic() - t)  # NOTE(steal) in _report
        if before:  # NOTE(server-side): sluice's own view, to tell engine waits from HTTP/CPU contention
            s["server_side"] = server_means(before, await server_sums(server))
        print(f"  {mult:g}x: {len(records)} requests in {time.monotonic() - t:.0f} s; attainment "
              + " / ".join(f"{s['classes'][c]['attainment'] or 0:.0%}" for c in CLASSES)
              + f"; goodput {s['goodput_rps']:.2f} req/s; p0 TTFT p50/p99 {_fmt(s['classes']['p0']['ttft_p50_s'])}/"
              + f"{_fmt(s['classes']['p0']['ttft_p99_s'])} s; CPU stolen {_fmt(s['steal_share'], 100, 1)}%"
              + (f" (server-side mean {_fmt(s['server_side']['time_to_first_token_seconds_mean:p0'])} s)"
                 if "server_side" in s else ""), file=sys.stderr)  # fmt: skip
        await asyncio.sleep(args.pause_s)
    return {"lone_ttft_s": lone, "capacity_rps": cap, "targets_s": targets, "steps": steps}


# ---------------------------------------------------------------- report


def _fmt(v: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def table(results: dict[str, Any]) -> str:
    headers = ["server", "load", "sent p0/p1/p2", "served", "shed (429)", "other errors", "p0 TTFT p50/p95/p99 (s)",
               "p2 TTFT p50/p99 (s)", "attainment p0/p1/p2", "goodput (req/s)", "429 p99 (ms)", "/health p99 (ms)",
               "CPU stolen (%)"]  # fmt: skip
    rows = []
    for name, res in results.items():
        for mult, s in res["steps"].items():
            cl = s["classes"]

            def per(key: str, cl: dict[str, Any] = cl) -> str:
                return "/".join(str(cl[c][key]) for c in CLASSES)

            p0, p2 = cl["p0"], cl["p2"]
            rows.append([
                name, f"{mult}x", per("sent"), per("served"), per("shed"), per("errors"),
                f"{_fmt(p0['ttft_p50_s'])}/{_fmt(p0['ttft_p95_s'])}/{_fmt(p0['ttft_p99_s'])}",
                f"{_fmt(p2['ttft_p50_s'])}/{_fmt(p2['ttft_p99_s'])}",
                "/".join("-" if cl[c]["attainment"] is None else f"{cl[c]['attainment']:.0%}" for c in CLASSES),
                _fmt(s["goodput_rps"]), _fmt(s["shed_answer_p99_s"], 1000, 0), _fmt(s["health_p99_s"], 1000, 0),
                _fmt(s.get("steal_share"), 100, 1),
            ])  # fmt: skip
    return markdown_table(headers, rows)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    styles = {"sluice": "o-", "sluice-dp": "D-", "sluice-auto": "v-", "gateway": "s--", "vllm": "^:"}
    for name, res in results.items():
        xs = [float(m) for m in res["steps"]]
        for ax, c in zip(axes[:3], CLASSES, strict=True):
            ys = [s["classes"][c]["attainment"] for s in res["steps"].values()]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], styles.get(name, "x-"), label=name)
        axes[3].plot(xs, [s["goodput_rps"] for s in res["steps"].values()], styles.get(name, "x-"), label=name)
    for ax, c in zip(axes[:3], CLASSES, strict=True):
        ax.set_title(f"{c} SLA attainment (share of sent)", fontsize=10)
        ax.set_ylim(-0.02, 1.02)
    axes[3].set_title("goodput (req/s within SLA, all classes)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("offered load / capacity")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in args.targets.split(","):
        if name == "vllm" and not Path(args.vllm_python).exists():
            print(f"vllm: skipped, no interpreter at {args.vllm_python} (see shared PEERS.md)", file=sys.stderr)
            continue
        t = time.monotonic()
        with start_server(name, args) as server:
            print(f"{name}: ready in {time.monotonic() - t:.0f} s", file=sys.stderr)
            results[name] = await run_server(server, args)
    return results


def add_load_args(ap: argparse.ArgumentParser) -> None:
    """The client and server flags shared with ``overload_repeat.py``."""
    ap.add_argument("--calibrate-s", type=float, default=20.0, help="seconds of the closed capacity loop")
    ap.add_argument("--concurrency", type=int, default=128,
                    help="closed-loop users (= sluice's default max_num_seqs; vLLM is started with it)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=60.0, help="client timeout per request (s)")
    ap.add_argument("--pause-s", type=float, default=3.0, help="pause between steps (s)")
    ap.add_argument("--sluice-args", default="", help="extra `sluice serve` flags (default: none, the defaults)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="sluice,sluice-dp,gateway,vllm",
                    help="comma-separated: sluice, sluice-dp, sluice-auto, gateway, vllm")
    ap.add_argument("--step-s", type=float, default=60.0, help="seconds per load step")
    ap.add_argument("--loads", type=lambda v: tuple(float(x) for x in v.split(",")), default=MULTIPLIERS,
                    help="comma-separated multiples of the capacity, e.g. 1,3 (default 0.5,1,2,3,5)")
    add_load_args(ap)
    ap.add_argument("--vllm-python", default=str(ROOT / ".peers" / "vllm" / "bin" / "python"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true", help="print only: no docs section, no PNG")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the servers
    t_start = time.monotonic()
    load_before = os.getloadavg()[0]
    results = asyncio.run(main_async(args))
    load_after = os.getloadavg()[0]
    text = table(results)
    print(text, flush=True)
    if not args.no_write and results:
        png = ROOT / "docs" / "overload.png"
        plot(results, png)
        lines = []
        for n, r in results.items():
            tgt = "/".join(f"{r['targets_s'][c]:.2f}" for c in CLASSES)
            lines.append(f"- **{n}**: lone TTFT {r['lone_ttft_s'] * 1000:.0f} ms, capacity "
                         f"{r['capacity_rps']:.2f} req/s, targets p0/p1/p2 {tgt} s")  # fmt: skip
        body = (
            "## Overload (`benchmarks/overload.py`)\n\n"
            f"Open-loop Poisson at 0.5x-5x each server's own capacity (closed loop of {args.concurrency}, every "
            f"request p2: the full-batch rate), {args.step_s:g} s per step, 20% p0 / 30% p1 / 50% p2, ~12-token "
            f"prompts ending in a colon (the first token is text), {args.max_tokens} output "
            "tokens (ignore_eos), streaming. SLA per class from the server's lone TTFT L: p0 <= 4 L, "
            "p1 <= max(2 s, 10 L), p2 <= max(5 s, 25 L); attainment is the share of *sent* requests served "
            "within it (a 429 is a miss); CPU stolen: the share of the machine's CPU time the hypervisor gave other "
            "guests during the step (NOTE(steal) in `_report.py`). sluice runs with default settings (no `--slo`); sluice-dp = the same with "
            "`--data-parallel-size 2` (two engine cores behind one API process, lending idle cores); gateway = "
            "`sluice gateway` over two one-thread replicas; vllm = vLLM-CPU `--scheduling-policy priority`.\n\n"
            + "\n".join(lines) + f"\n\n{text}\n\n![overload](overload.png)\n\n{machine_line()}; 1-min load average "
            f"{load_before:.1f} before, {load_after:.1f} after.\n"
        )
        write_section("overload", body)
    print_json_last({"benchmark": "overload", "step_s": args.step_s, "calibrate_s": args.calibrate_s,
                     "wall_s": round(time.monotonic() - t_start, 1), "load_avg": [round(load_before, 2), round(load_after, 2)],
                     "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
