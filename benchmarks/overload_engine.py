"""The engine alone under overload: P0's time to first token with and without express steps (issue 11).

    python benchmarks/overload_engine.py                 # ~3 minutes on 2 cores
    python benchmarks/overload_engine.py --step-s 5      # smoke
    python benchmarks/overload_engine.py --capacity-mix 0,0,1 --capacity-runs 3 --calibrate-s 12 \
        --loads 0.5,0.6,0.7,0.8,1 --mix 1,0,0 --modes mid-step --seeds 1,2 --concurrency 128 \
        --p0-target 0.068 --section overload_engine_p0
        # P0 alone at 0.5x-1x of the full-batch capacity (every request P2 in the closed loop, as
        # overload.py measures it): how much P0 the engine holds; 1x is the 5x step's P0 share
    python benchmarks/overload_engine.py --rate 18 --loads 1 --mix 1,0,0 --modes mid-step --seeds 1,2,3 --no-write
        # a fixed load (no closed loop), one mode, three arrival sequences: an A/B between two builds

``benchmarks/overload.py`` measures through HTTP with the load generator on
the same 2 cores, where the API process and the client add tens of
milliseconds.  This one drives ``EngineCore`` in-process (no HTTP, no
admission control: nothing is shed, the lower classes queue) to show what the
engine's scheduling alone does for P0:

1. capacity: completed requests/s of a closed loop of ``--concurrency``
   requests (the class mix), express steps on;
2. open-loop Poisson arrivals at 1x and 3x that capacity for ``--step-s``
   each, class mix 20% P0 / 30% P1 / 50% P2, 12-token prompts, 16 output
   tokens; every request carries its class's TTFT target (P0
   ``--p0-target``, P1 2 s, P2 5 s), as the API process sends them;
3. each load three times, one run after the other: express steps that may
   start mid-step (the default in ``sluice serve``: arrivals are taken between
   layers, NOTE(mid-step-express)), express steps only at step boundaries
   (what an in-process ``EngineCore`` does), and no express steps.

TTFT here is from the request's arrival time to the end of the step that
produced its first token.  Writes section ``overload_engine`` of
docs/benchmarks.md and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import (  # noqa: E402
    machine_line,
    markdown_table,
    print_json_last,
    steal_seconds,
    steal_share,
    write_section,
)

from sluice.engine.core import EngineCore  # noqa: E402
from sluice.engine.protocol import EngineRequest, SamplingParams  # noqa: E402

MIX = (0.2, 0.3, 0.5)
PROMPT_TOKENS = 12


MODES = ("mid-step", "boundary", "off")  # express steps: also mid-step, at step boundaries only, none


def _engine(express: bool, concurrency: int, model: str = "smollm2") -> EngineCore:
    engine = EngineCore(model=model, max_num_seqs=concurrency, express_steps=express)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rng = random.Random(1)
    for i in range(2 * concurrency):  # warm-up: kernels, the step-time fit
        engine.add_request(EngineRequest(request_id=f"w{i}", sampling=sp, priority=2,
                                         prompt_token_ids=[rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]))  # fmt: skip
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def _request(rng: random.Random, rid: str, priority: int, targets: tuple[float, ...], arrival: float) -> EngineRequest:
    return EngineRequest(request_id=rid, priority=priority, arrival_time=arrival, ttft_target=targets[priority],
                         sampling=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                         prompt_token_ids=[rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)])  # fmt: skip


def capacity(concurrency: int, seconds: float, targets: tuple[float, ...], model: str = "smollm2",
             mix: tuple[float, ...] = MIX) -> float:  # fmt: skip
    engine = _engine(True, concurrency, model)
    rng = random.Random(2)
    n = done = 0
    t0 = time.monotonic()
    warm = t0 + seconds / 4

    def add() -> None:
        nonlocal n
        p = rng.choices(range(3), mix)[0]
        engine.add_request(_request(rng, f"c{n}", p, targets, time.monotonic()))
        n += 1

    for _ in range(concurrency):
        add()
    # a slow or busy host may finish nothing in a short window: run on until a request finishes
    # (bounded: ten windows), so the loads below never multiply a capacity of 0
    while time.monotonic() < t0 + seconds or (done == 0 and time.monotonic() < t0 + 10 * seconds):
        for out in engine.step():
            if out.finished:
                done += time.monotonic() >= warm
                add()
    if done == 0:
        raise SystemExit(f"capacity: no request finished in {10 * seconds:.1f} s: raise --calibrate-s")
    return done / (time.monotonic() - warm)


def run_load(mode: str, rate: float, seconds: float, concurrency: int, targets: tuple[float, ...],
             seed: int, model: str = "smollm2", mix: tuple[float, ...] = MIX) -> dict[str, Any]:  # fmt: skip
    engine = _engine(mode != "off", concurrency, model)
    rng = random.Random(seed)
    arrivals: list[tuple[float, int]] = []
    t = 0.0
    while (t := t + rng.expovariate(rate)) < seconds:
        arrivals.append((t, rng.choices(range(3), mix)[0]))
    sent: dict[str, tuple[float, int]] = {}
    first: dict[str, float] = {}
    steps: list[float] = []
    express0 = engine.num_express_steps
    k = 0
    stolen = steal_seconds()
    t0 = time.monotonic()

    def take_arrivals() -> None:
        nonlocal k
        now = time.monotonic() - t0
        while k < len(arrivals) and arrivals[k][0] <= now:
            at, p = arrivals[k]
            engine.add_request(_request(rng, f"r{k}", p, targets, t0 + at))
            sent[f"r{k}"] = (t0 + at, p)
            k += 1

    def record(outs: list[Any], at: float) -> None:
        for out in outs:
            if out.request_id in sent and out.request_id not in first and out.new_token_ids:
                first[out.request_id] = at - sent[out.request_id][0]

    if mode == "mid-step":  # as the engine core process does (NOTE(mid-step-express))
        engine.set_arrivals(take_arrivals, lambda outs: record(outs, time.monotonic()))
    deadline = t0 + seconds + 60.0  # the queued lower classes drain, within bounds
    while (k < len(arrivals) or engine.has_unfinished_requests()) and time.monotonic() < deadline:
        take_arrivals()
        now = time.monotonic() - t0
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.002, arrivals[k][0] - now)))
            continue
        s0 = time.monotonic()
        outs = engine.step()
        s1 = time.monotonic()
        steps.append(s1 - s0)
        record(outs, s1)
    elapsed = time.monotonic() - t0
    res: dict[str, Any] = {"mode": mode, "rate": rate, "sent": len(sent), "elapsed_s": elapsed,
                           "steal_share": steal_share(stolen, steal_seconds(), elapsed),  # NOTE(steal) in _report
                           "steps": len(steps), "express_steps": engine.num_express_steps - express0,
                           "mid_step_express": engine.num_mid_step_express,
                           "step_ms_mean": 1e3 * statistics.fmean(steps) if steps else 0.0, "classes": {}}  # fmt: skip
    for p in range(3):
        v = sorted(first[r] for r in first if sent[r][1] == p)
        n = sum(1 for r in sent if sent[r][1] == p)
        if not v:
            continue
        res["classes"][f"p{p}"] = {
            "sent": n, "first_tokens": len(v),
            "ttft_p50_ms": 1e3 * v[len(v) // 2], "ttft_p95_ms": 1e3 * v[min(len(v) - 1, int(0.95 * len(v)))],
            "ttft_p99_ms": 1e3 * v[min(len(v) - 1, int(0.99 * len(v)))],
            "attainment": sum(1 for x in v if x <= targets[p]) / n,
        }  # fmt: skip
    res["completed_rps"] = len(first) / elapsed
    return res


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _mix(flag: str, text: str) -> tuple[float, ...]:
    try:
        mix = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag}: expected three shares like 0.2,0.3,0.5, got {text!r}") from None
    if len(mix) != 3 or min(mix) < 0 or sum(mix) <= 0:
        raise SystemExit(f"{flag}: expected three non-negative shares like 0.2,0.3,0.5, got {text!r}")
    return mix


def _cap_note(caps: list[float], concurrency: int, mix: tuple[float, ...]) -> str:
    shares = "/".join(f"{100 * x / sum(mix):g}" for x in mix)
    runs = f"the median of {len(caps)}: {', '.join(f'{c:.1f}' for c in caps)} req/s; " if len(caps) > 1 else ""
    return f"{runs}closed loop of {concurrency}, {shares}% P0/P1/P2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-s", type=float, default=20.0, help="seconds of arrivals per load step")
    ap.add_argument("--calibrate-s", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=64, help="max_num_seqs and the closed loop's size")
    ap.add_argument("--p0-target", type=float, default=0.07, help="P0's TTFT target (s): ~4x the lone TTFT over HTTP")
    ap.add_argument("--loads", default="1,3", help="multiples of the capacity")
    ap.add_argument("--model", default="smollm2", help="what the engine loads (default: the embedded SmolLM2)")
    ap.add_argument("--mix", default="0.2,0.3,0.5", help="P0,P1,P2 shares of the open-loop arrivals")
    ap.add_argument("--capacity-mix", default="0.2,0.3,0.5",
                    help="P0,P1,P2 shares of the closed loop (0,0,1: every request P2, the full-batch rate of overload.py)")
    ap.add_argument("--capacity-runs", type=int, default=1, help="closed loops run; the capacity is their median")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="the capacity the loads multiply (req/s), given: no closed loop (a fixed load for A/Bs)")
    ap.add_argument("--modes", default=",".join(MODES), help="which express-step modes run, of " + ",".join(MODES))
    ap.add_argument("--seeds", default="", help="comma-separated arrival seeds, one run each (default: 10 x the load)")
    ap.add_argument("--section", default="overload_engine", help="the docs/benchmarks.md section written")
    ap.add_argument("--title", default="", help="the section's heading after 'Overload, the engine alone' (default: the mix)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    targets = (args.p0_target, 2.0, 5.0)
    mix, cap_mix = _mix("--mix", args.mix), _mix("--capacity-mix", args.capacity_mix)
    if args.capacity_runs < 1:
        raise SystemExit(f"--capacity-runs: expected at least 1, got {args.capacity_runs}")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: expected some of {','.join(MODES)}, got {args.modes!r}")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x]
    except ValueError:
        raise SystemExit(f"--seeds: expected integers like 0,1,2, got {args.seeds!r}") from None
    caps = [] if args.rate else [capacity(args.concurrency, args.calibrate_s, targets, args.model, cap_mix)
                                 for _ in range(args.capacity_runs)]  # fmt: skip
    cap = args.rate or statistics.median(caps)
    print(f"capacity {cap:.1f} req/s{' (given)' if args.rate else ' of ' + ', '.join(f'{c:.1f}' for c in caps)}",
          flush=True)  # fmt: skip
    results = []
    for mult in (float(x) for x in args.loads.split(",")):
        for seed in seeds or [int(mult * 10)]:
            for mode in modes:
                r = run_load(mode, mult * cap, args.step_s, args.concurrency, targets, seed=seed, model=args.model,
                             mix=mix)  # fmt: skip
                r["load"], r["seed"] = mult, seed
                results.append(r)
                p0 = r["classes"].get("p0", {})
                print(f"{mult:g}x seed {seed} express steps {mode}: P0 TTFT p50/p99 "
                      f"{p0.get('ttft_p50_ms', 0):.0f}/{p0.get('ttft_p99_ms', 0):.0f} ms, attainment "
                      f"{p0.get('attainment', 0):.1%}; {r['completed_rps']:.1f} first tokens/s; CPU stolen "
                      f"{_share(r['steal_share'])}", flush=True)  # fmt: skip
    headers = ["load", "seed", "express steps", "P0 TTFT p50/p95/p99 (ms)", "P0 attainment", "P1 TTFT p50 (ms)",
               "P2 TTFT p50 (ms)", "requests started/s", "steps (express, mid-step)", "mean step (ms)",
               "CPU stolen"]  # fmt: skip
    rows = []
    for r in results:
        c = r["classes"]
        p0 = c.get("p0", {})
        rows.append([f"{r['load']:g}x", r["seed"], r["mode"],
                     f"{p0.get('ttft_p50_ms', 0):.0f}/{p0.get('ttft_p95_ms', 0):.0f}/{p0.get('ttft_p99_ms', 0):.0f}",
                     f"{p0.get('attainment', 0):.1%}", f"{c.get('p1', {}).get('ttft_p50_ms', 0):.0f}",
                     f"{c.get('p2', {}).get('ttft_p50_ms', 0):.0f}", f"{r['completed_rps']:.1f}",
                     f"{r['steps']} ({r['express_steps']}, {r['mid_step_express']})", f"{r['step_ms_mean']:.1f}",
                     _share(r["steal_share"])])  # fmt: skip
    table = markdown_table(headers, rows)
    print(table)
    if not args.no_write:
        shares = "/".join(f"{100 * x / sum(mix):g}" for x in mix)
        cmd = " ".join(["python benchmarks/overload_engine.py", *sys.argv[1:]])
        title = f", {args.title}" if args.title else "" if mix == MIX else f", arrivals {shares}% P0/P1/P2"
        body = (f"## Overload, the engine alone{title} (`benchmarks/overload_engine.py`)\n\n"
                f"`{cmd}` (SmolLM2 Q4_1, engine in-process, no HTTP and no admission: "
                f"nothing is shed). Capacity {cap:.1f} req/s ("
                f"{'given' if args.rate else _cap_note(caps, args.concurrency, cap_mix)}); open-loop "
                f"Poisson for {args.step_s:g} s per load, {shares}% P0/P1/P2, {PROMPT_TOKENS}-token prompts, 16 output "
                f"tokens; targets P0 {args.p0_target:g} s, P1 2 s, P2 5 s. TTFT: arrival to the end of the step "
                f"with the first token (for a mid-step express step: when it was published, mid-step). CPU stolen: the share of the machine's CPU time the hypervisor gave other guests during the run (NOTE(steal)). Express steps mid-step (as in `sluice serve`), at step boundaries only, and off ({', '.join(modes)} here) run one after the other.\n\n{table}\n\n{machine_line()}")  # fmt: skip
        write_section(args.section, body)
    print_json_last({"benchmark": "overload_engine", "capacity_rps": cap, "results": results})


if __name__ == "__main__":
    main()
