"""One overload step, repeated: how much a run of `benchmarks/overload.py` moves, and where the CPU goes (issue 11).

    python benchmarks/overload_repeat.py                       # 3x of the capacity measured first, seeds 0,0,1, 30 s each
    python benchmarks/overload_repeat.py --rate 64 --lone-ttft 0.012   # a fixed load and fixed targets (an A/B)
    python benchmarks/overload_repeat.py --timeline            # also a per-second table of each run
    python benchmarks/overload_repeat.py --rate 48 --lone-ttft 0.016 --neighbour 0.45   # an A/B under a neighbour

``overload.py`` runs each load once; its 3x goodput and P0 attainment are
single samples.  This script starts one ``sluice serve`` (default settings)
and runs the same open-loop Poisson step several times (``--seeds``: the same
seed twice is the same arrival sequence, so a spread between those two runs
is the machine's and the server's own), with the class mix, prompts, output
length and SLA targets of ``overload.py``.  Per run: P0 attainment and TTFT p99,
P1 served and within target per second, goodput, and the CPU each process
took (the engine core process, the API process, this load generator; from
/proc, in % of one core: the engine's OpenMP threads spin while they wait,
so its share is an upper bound of its work), and where the engine's time went
by kind of step (normal, express at a step boundary, nested mid-step; from
``/metrics``, NOTE(step-kinds) in sluice.engine.core): the share of the run
each took, the milliseconds each batched token cost in it, and the steps a second.  ``--timeline`` adds, per second
of each run, the engine's waiting requests by class and the admission's
predicted TTFT by class (``/metrics`` sampled every 0.1 s) beside what the
clients saw.  Writes section ``overload_repeat`` of docs/benchmarks.md.

NOTE(host-drift): before each run the lone TTFT is measured again on the idle
server (the median of ``overload.lone_ttft``) and reported beside the run (the first
run's is the start's own measurement, when the start measured it).  The
targets stay those of the start; the probe shows how fast the machine was at
that moment.  On shared VMs one setting's runs moved by tens of points of P0
attainment within twenty minutes, and a run is only comparable to another
measured at a similar lone TTFT.

NOTE(neighbour): the host's slow stretches come and go on their own, so an A/B
of a change meant for them may never see one.  ``--neighbour DUTY`` runs, during
each load step only, a process that keeps one core busy for DUTY of every
100 ms (not pinned: the scheduler puts it where it likes, as a noisy neighbour
is), and reports the CPU it took.  It stops with the step, and by itself after
the step's time plus its timeout in any case.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overload as ov  # noqa: E402
from _report import (  # noqa: E402
    machine_line,
    markdown_table,
    print_json_last,
    steal_seconds,
    steal_share,
    write_section,
)

from sluice.engine.protocol import STEP_KINDS  # noqa: E402

_CLK = os.sysconf("SC_CLK_TCK")


_NEIGHBOUR = """
import sys, time
duty, period, end = float(sys.argv[1]), 0.1, time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    t = time.perf_counter()
    while time.perf_counter() - t < duty * period:
        pass
    time.sleep((1.0 - duty) * period)
"""


@contextlib.contextmanager
def neighbour(duty: float, max_s: float) -> Iterator[subprocess.Popen[bytes] | None]:
    """A process busy for ``duty`` of every 100 ms while the block runs (NOTE(neighbour)); None for duty 0.
    It is stopped when the block ends, and stops by itself after ``max_s`` seconds whatever happens."""
    if duty <= 0.0:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", _NEIGHBOUR, str(duty), str(max_s)])
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _duty(value: str) -> float:
    duty = float(value)
    if not 0.0 <= duty < 1.0:
        raise argparse.ArgumentTypeError(f"a share of one core in [0, 1), got {value}")
    return duty


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK


def _children(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    parent: dict[int, int] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                parent[int(p)] = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def _gauges(text: str, names: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        for n in names:
            if line.startswith(n + "{") or line.startswith(n + " "):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
    return out


_BY_KIND = ("sluice_engine_busy_seconds_total", "sluice_engine_batched_tokens_by_kind_total",
            "sluice_engine_steps_by_kind_total")
_POOL = ("sluice_engine_pool_wait_seconds_total", "sluice_engine_pool_stalls_total",
         "sluice_engine_pool_stall_seconds_total")  # NOTE(pool-waits)


async def _step_totals(url: str) -> dict[str, float]:
    """The engine's cumulative seconds, batched tokens and steps by kind of step, and the work pool's waits
    (NOTE(pool-waits)), from ``/metrics`` (empty when the server does not export them, e.g. an older build in
    an A/B; the pool's are left out where a build has none)."""
    try:
        async with aiohttp.ClientSession() as s, asyncio.timeout(5), s.get(url + "/metrics") as r:
            return _gauges(await r.text(), _BY_KIND + _POOL)
    except (aiohttp.ClientError, TimeoutError):
        return {}


def step_kinds(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, dict[str, float]]:
    """Per kind of step over a run: the share of the wall time the engine spent in it, ms per batched token, and
    steps a second."""
    if not after:
        return {}
    out: dict[str, dict[str, float]] = {}
    for k in STEP_KINDS:
        sec, tok, steps = (after.get(f'{m}{{kind="{k}"}}', 0.0) - before.get(f'{m}{{kind="{k}"}}', 0.0)
                           for m in _BY_KIND)  # fmt: skip
        out[k] = {"busy_share": sec / wall if wall > 0 else 0.0, "ms_per_token": 1e3 * sec / tok if tok else 0.0,
                  "steps_per_s": steps / wall if wall > 0 else 0.0}
    return out


def pool_waits(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """Over a run: the share of it the engine's kernel loops waited for chunks another thread held, the stalls
    (waits of 0.5 ms or more) a second, and their share of the run (NOTE(pool-waits) in
    sluice/kernels/csrc/work_pool.h); empty when the server does not export them."""
    if _POOL[0] not in after or wall <= 0:
        return {}
    wait, stalls, stall_s = (after.get(m, 0.0) - before.get(m, 0.0) for m in _POOL)
    return {"wait_share": wait / wall, "stalls_per_s": stalls / wall, "stall_share": stall_s / wall}


_TIMELINE = ("sluice_num_requests_waiting_by_priority", "sluice_predicted_ttft_seconds",
             "sluice_num_requests_running_by_priority")


async def _sample(url: str, t0: float, into: list[tuple[float, dict[str, float]]]) -> None:
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            into.append((time.perf_counter() - t0, _gauges(text, _TIMELINE)))
            await asyncio.sleep(0.1)


def _timeline(samples: list[tuple[float, dict[str, float]]], records: list[ov.Record],
              targets: dict[str, float]) -> str:  # fmt: skip
    by_sec: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
    for t, g in samples:
        by_sec[int(t)].append(g)
    rows = []
    for sec in sorted(by_sec):
        g = by_sec[sec]

        def mean(metric: str, c: str, g: list[dict[str, float]] = g) -> float:
            return sum(x.get(f'{metric}{{priority="{c}"}}', 0.0) for x in g) / len(g)

        rs = [r for r in records if int(r.start) == sec]
        p0 = [r for r in rs if r.priority == "p0"]
        p1 = [r for r in rs if r.priority == "p1"]
        rows.append([sec, len(p0), sum(1 for r in p0 if not r.is_served or (r.ttft or 0) > targets["p0"]),
                     len(p1), sum(1 for r in p1 if r.is_served),
                     sum(1 for r in p1 if r.is_served and (r.ttft or 0) > targets["p1"]),
                     sum(1 for r in rs if r.priority == "p2" and r.is_served),
                     *(f"{mean(_TIMELINE[0], c):.1f}" for c in ov.CLASSES),
                     *(f"{mean(_TIMELINE[1], c):.2f}" for c in ("p1", "p2")),
                     *(f"{mean(_TIMELINE[2], c):.1f}" for c in ov.CLASSES)])  # fmt: skip
    return markdown_table(["s", "p0 sent", "p0 missed", "p1 sent", "p1 admitted+served", "p1 late", "p2 served",
                           "engine waiting p0", "p1", "p2", "predicted TTFT p1 (s)", "p2 (s)",
                           "engine running p0", "p1", "p2"], rows)  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    ns = argparse.Namespace(sluice_args=args.sluice_args)
    with ov.start_server("sluice", ns) as server:
        cap = args.rate or await ov.capacity(server, args.concurrency, args.calibrate_s, args.max_tokens, 0)
        lone = args.lone_ttft or await ov.lone_ttft(server, args.max_tokens)  # after: NOTE(capacity-first)
        rate = args.mult * cap
        targets = ov.targets_for(lone)
        print(f"lone TTFT {lone * 1000:.0f} ms{' (given)' if args.lone_ttft else ''}, {'given' if args.rate else 'measured'} capacity {cap:.2f} req/s, "
              f"{args.mult:g}x = {rate:.1f} req/s; targets " + ", ".join(f"{c} {t:.3f}s" for c, t in targets.items()),
              file=sys.stderr)  # fmt: skip
        engine = [p for p in _children(server.procs[0].pid) if p != server.procs[0].pid]
        runs = []
        for k, seed in enumerate(args.seeds):
            # NOTE(host-drift); the lone TTFT measured at the start is the first run's probe (it ran just now)
            probe = lone if k == 0 and not args.lone_ttft else await ov.lone_ttft(server, args.max_tokens)
            before = {p: _cpu_seconds(p) for p in [server.procs[0].pid, *engine]}
            steps_before = await _step_totals(server.url)
            me, t0, stolen = time.process_time(), time.perf_counter(), steal_seconds()
            samples: list[tuple[float, dict[str, float]]] = []
            sampler = asyncio.create_task(_sample(server.url, t0, samples)) if args.timeline else None
            with neighbour(args.neighbour, args.step_s + args.timeout + 30.0) as nb:
                records, health = await ov.load_step(server, rate, args.step_s, args.max_tokens, seed, args.timeout)
                nb_cpu = _cpu_seconds(nb.pid) if nb is not None else 0.0
            if sampler is not None:
                sampler.cancel()
            wall = time.perf_counter() - t0
            steps_after = await _step_totals(server.url)
            kinds = step_kinds(steps_before, steps_after, wall)
            api = (_cpu_seconds(server.procs[0].pid) - before[server.procs[0].pid]) / wall
            eng = sum(_cpu_seconds(p) - before[p] for p in engine) / wall
            s = ov.summarize(records, health, targets, args.step_s)
            p0, p1 = s["classes"]["p0"], s["classes"]["p1"]
            p1_served = sum(1 for r in records if r.priority == "p1" and r.is_served) / args.step_s
            p1_sent = sum(1 for r in records if r.priority == "p1")
            run_ = {"run": k + 1, "seed": seed, "lone_ttft_before_s": probe,
                    "p0_attainment": p0["attainment"], "p0_ttft_p99_s": p0["ttft_p99_s"],
                    "p0_refused": p0["shed"] / max(1, p0["sent"]),
                    "p1_served_rps": p1_served, "p1_within_rps": (p1["attainment"] or 0.0) * p1_sent / args.step_s,
                    "goodput_rps": s["goodput_rps"], "cpu_engine": eng, "cpu_api": api,
                    "cpu_client": (time.process_time() - me) / wall, "cpu_neighbour": nb_cpu / wall,
                    "cpu_stolen": steal_share(stolen, steal_seconds(), wall),  # NOTE(steal) in _report
                    "steps": kinds, "pool": pool_waits(steps_before, steps_after, wall)}  # fmt: skip
            runs.append(run_)
            print(f"  run {k + 1} (seed {seed}, lone TTFT before it {probe * 1000:.1f} ms): P0 {p0['attainment']:.1%} "
                  f"({run_['p0_refused']:.1%} refused), P1 served {p1_served:.1f}/s, goodput "
                  f"{s['goodput_rps']:.2f} req/s; CPU engine {eng:.0%} API {api:.0%} client {run_['cpu_client']:.0%} "
                  f"neighbour {run_['cpu_neighbour']:.0%} stolen {_stolen(run_.get('cpu_stolen'))}; engine busy {_kinds_cell(kinds, 'busy_share')}, "
                  f"ms/token {_kinds_cell(kinds, 'ms_per_token')}, steps/s {_kinds_cell(kinds, 'steps_per_s')}, "
                  f"pool waits {_pool_cell(run_['pool'])}",
                  file=sys.stderr)  # fmt: skip
            if args.timeline:
                run_["timeline"] = _timeline(samples, records, targets)
                print(run_["timeline"], file=sys.stderr)
            await asyncio.sleep(args.pause_s)
    return {"lone_ttft_s": lone, "capacity_rps": cap, "rate_rps": rate, "targets_s": targets, "runs": runs}


def _kinds_cell(kinds: dict[str, dict[str, float]] | None, field: str) -> str:
    """normal / express / nested, as shares of the run, ms per token or steps a second."""
    if not kinds:
        return "-"
    if field == "busy_share":
        return " / ".join(f"{kinds[k][field]:.0%}" for k in STEP_KINDS)
    if field == "steps_per_s":
        return " / ".join(f"{kinds[k][field]:.1f}" if field in kinds[k] else "-" for k in STEP_KINDS)
    return " / ".join(f"{kinds[k][field]:.2f}" if kinds[k][field] else "-" for k in STEP_KINDS)


def _pool_cell(pool: dict[str, float] | None) -> str:
    """The pool's waits as a share of the run, its stalls a second, and their share of the run."""
    return f"{pool['wait_share']:.1%} / {pool['stalls_per_s']:.0f} / {pool['stall_share']:.1%}" if pool else "-"


def table(result: dict[str, Any]) -> str:
    rows = [[r["run"], r["seed"], ov._fmt(r["lone_ttft_before_s"], 1000, 1), f"{(r['p0_attainment'] or 0):.1%}",
             f"{r.get('p0_refused', 0.0):.1%}", ov._fmt(r["p0_ttft_p99_s"], 1000, 0),
             f"{r['p1_served_rps']:.1f}", f"{r['p1_within_rps']:.1f}", f"{r['goodput_rps']:.2f}",
             f"{r['cpu_engine']:.0%}", f"{r['cpu_api']:.0%}", f"{r['cpu_client']:.0%}",
             f"{r.get('cpu_neighbour', 0.0):.0%}", _stolen(r.get("cpu_stolen")), _kinds_cell(r.get("steps"), "busy_share"),
             _kinds_cell(r.get("steps"), "ms_per_token"), _kinds_cell(r.get("steps"), "steps_per_s"),
             _pool_cell(r.get("pool"))]
            for r in result["runs"]]  # fmt: skip
    return markdown_table(["run", "seed", "lone TTFT before (ms)", "P0 attainment", "P0 refused", "P0 TTFT p99 (ms)",
                           "P1 served (req/s)",
                           "P1 within target (req/s)", "goodput (req/s)", "CPU engine", "CPU API", "CPU client",
                           "CPU neighbour", "CPU stolen", "engine busy: normal / express / nested",
                           "ms per batched token: normal / express / nested",
                           "steps a second: normal / express / nested",
                           "pool waits: share of the run / stalls a second / stalls' share"], rows)  # fmt: skip


def _stolen(v: float | None) -> str:
    """The share of the machine's CPU time the hypervisor gave other guests (NOTE(steal) in _report)."""
    return "-" if v is None else f"{v:.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=0.0, help="the capacity the load is a multiple of (req/s); "
                    "0: measure it first (closed loop, as overload.py)")  # fmt: skip
    ap.add_argument("--lone-ttft", type=float, default=0.0,
                    help="the lone TTFT the SLA targets derive from (s); 0: measure it first. Fixed, an A/B of two "
                         "builds or settings judges both against the same targets")  # fmt: skip
    ap.add_argument("--mult", type=float, default=3.0, help="the load, a multiple of --rate")
    ap.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0, 0, 1],
                    help="one run per seed, in order (default 0,0,1: one arrival sequence twice, then another)")
    ap.add_argument("--step-s", type=float, default=30.0)
    ov.add_load_args(ap)
    ap.add_argument("--timeline", action="store_true", help="per-second table of each run (printed, and in the doc)")
    ap.add_argument("--neighbour", type=_duty, default=0.0, metavar="DUTY",
                    help="during each run, a process that keeps one core busy this share of the time (NOTE(neighbour))")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the server
    t_start = time.monotonic()
    result = asyncio.run(run(args))
    text = table(result)
    print(text, flush=True)
    if not args.no_write:
        tgt = "/".join(f"{result['targets_s'][c]:.3f}" for c in ov.CLASSES)
        body = (
            "## Overload, one step repeated (`benchmarks/overload_repeat.py`)\n\n"
            f"`python benchmarks/overload_repeat.py{' --timeline' if args.timeline else ''}`: one `sluice serve` "
            f"(default settings), open-loop Poisson at {result['rate_rps']:.1f} req/s ({args.mult:g}x of "
            f"{result['capacity_rps']:.1f} req/s, {'given' if args.rate else 'measured'}) for {args.step_s:g} s, "
            f"{len(result['runs'])} runs with seeds {','.join(map(str, args.seeds))} (one seed = one arrival "
            "sequence), the class mix, prompts and targets of `overload.py` (lone TTFT "
            f"{result['lone_ttft_s'] * 1000:.0f} ms, targets p0/p1/p2 {tgt} s). CPU in % of one core, from /proc, "
            "over the run (the engine's OpenMP threads spin while they wait: an upper bound of its work); "
            "\"CPU stolen\": the share of the machine's CPU time the hypervisor gave other guests (NOTE(steal)). "
            "\"lone TTFT before\": the lone TTFT measured again on the idle server just before the run "
            "(NOTE(host-drift)); the targets stay those above."
            + (f" During each run a neighbour process kept one core busy {args.neighbour:.0%} of the time "
               "(NOTE(neighbour)); \"CPU neighbour\" is what it got." if args.neighbour else "")
            + "\n\n"
            f"{text}\n"
            + "".join(f"\nRun {r['run']}, per second:\n\n{r['timeline']}\n" for r in result["runs"] if "timeline" in r)
            + f"\n{machine_line()}\n"
        )
        write_section("overload_repeat", body)
    print_json_last({"benchmark": "overload_repeat", "wall_s": round(time.monotonic() - t_start, 1),
                     **{k: v for k, v in result.items() if k != "runs"},
                     "runs": [{k: v for k, v in r.items() if k != "timeline"} for r in result["runs"]]})  # fmt: skip


if __name__ == "__main__":
    main()
