"""Engine steps of SmolLM2 under each quantized-GEMM plan this CPU has, side by side in one run.

    python benchmarks/kernel_paths.py                 # autotuned plan + every vector path forced
    python benchmarks/kernel_paths.py --plans auto,avx512vnni --rounds 3

What a kernel change buys where the serving engine spends its time: a lone
prompt of 1 and of 13 tokens (a premium request's express step, issue 11), and
decode steps of 16 and 64 rows (contexts of ~30 tokens, the overload
benchmark's shape).  Each plan runs in its own process (``SLUICE_KERNEL_PATH``
forces a path; ``auto`` is the autotuned plan, which may mix paths per batch
size) on an in-process ``EngineCore``; plans alternate over ``--rounds``
rounds and each figure is the best round's median, so a slow moment of the
machine does not land on one plan only.  Every plan computes the same bits
(docs/kernels.md), so only the time differs.  Writes section ``kernel_paths``
of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402

COLUMNS = ["lone prompt 1 tok (ms)", "lone prompt 13 tok (ms)", "decode 16 rows (ms)", "decode 64 rows (ms)"]


def measure_here() -> dict[str, float]:
    """The four step times (ms) for this process's plan (run in a child process)."""
    import torch

    from sluice.engine.config import EngineConfig
    from sluice.engine.core import EngineCore
    from sluice.engine.protocol import EngineRequest, SamplingParams

    core = EngineCore(EngineConfig(model="smollm2", max_num_seqs=64, max_num_batched_tokens=4096,
                                   kv_cache_memory=1 << 30))  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    ids = iter(range(1 << 30))

    def prompt(n: int) -> list[int]:
        return torch.randint(1000, 30000, (n,), generator=gen).tolist()  # type: ignore[no-any-return]

    def add(n: int, max_tokens: int) -> None:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(EngineRequest(request_id=f"r{next(ids)}", prompt_token_ids=prompt(n), sampling=sp,
                                       arrival_time=time.monotonic()))  # fmt: skip

    def lone(n: int, reps: int = 15) -> float:
        times = []
        for _ in range(reps):
            add(n, 1)
            t = time.perf_counter()
            while core.has_unfinished_requests():
                core.step()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    def decode(rows: int, steps: int = 8) -> float:
        for _ in range(rows):
            add(16, steps + 8)
        while core.make_stats().num_decoding < rows:
            core.step()
        core.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t)
        while core.has_unfinished_requests():
            core.step()
        return 1e3 * statistics.median(times)

    lone(13, 3)  # warm-up
    vals = [lone(1), lone(13), decode(16), decode(64)]
    return {"kernel_path": core.runner.kernel_path, **dict(zip(COLUMNS, vals))}  # type: ignore[dict-item]


def run_plan(plan: str) -> dict[str, float]:
    env = dict(os.environ)
    env.pop("SLUICE_KERNEL_PATH", None)
    if plan != "auto":
        env["SLUICE_KERNEL_PATH"] = plan
    out = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def default_plans() -> list[str]:
    from sluice.kernels import qlinear as ql

    return ["auto"] + [p.label for p in ql.available_paths() if p != ql.Path.SCALAR]


def keep_best(best: dict[str, dict[str, float]], plan: str, res: dict[str, float]) -> None:
    """Fold one round of ``plan`` into ``best``: the lowest time per column over the rounds."""
    prev = best.setdefault(plan, dict(res))
    for k, v in res.items():
        prev[k] = min(prev[k], v)


def table_rows(plans: list[str], best: dict[str, dict[str, float]], labels: dict[str, str]) -> list[list[object]]:
    """One row per plan: its paths, the four times, and its 64-row decode step over the first plan's."""
    base = best[plans[0]][COLUMNS[3]]
    return [[plan, labels[plan], *(f"{best[plan][c]:.2f}" for c in COLUMNS), f"{best[plan][COLUMNS[3]] / base:.2f}x"]
            for plan in plans]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", default="", help="comma-separated: auto and/or path labels (default: auto + every vector path)")
    ap.add_argument("--rounds", type=int, default=2, help="times each plan runs, alternating")
    ap.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure_here()))
        return
    plans = [p.strip() for p in a.plans.split(",") if p.strip()] or default_plans()
    best: dict[str, dict[str, float]] = {}
    labels: dict[str, str] = {}
    for r in range(a.rounds):
        for plan in plans:
            res = run_plan(plan)
            labels[plan] = str(res.pop("kernel_path"))
            keep_best(best, plan, res)
            print(f"round {r + 1} {plan:12s} " + "  ".join(f"{k.split(' (')[0]} {v:.2f}" for k, v in res.items()), flush=True)
    table = markdown_table(["plan", "paths used", *COLUMNS, f"decode 64 vs {plans[0]}"], table_rows(plans, best, labels))
    body = (
        "## Engine steps per kernel plan (`benchmarks/kernel_paths.py`)\n\n"
        f"{machine_line()}. SmolLM2-135M-Instruct Q4_1/Q8_0 as shipped, in-process `EngineCore`, greedy. "
        "`auto` is the autotuned plan (a path per weight shape and batch bucket); the others force one path. "
        "Lone prompt: one request of random token ids, prefill + first token. Decode: one step of N running "
        f"requests with contexts of ~20-30 tokens. Median of 8-15 steps; best of {a.rounds} alternating rounds.\n\n"
        + table + "\n"
    )
    print(table)
    if not a.no_write:
        write_section("kernel_paths", body)
    print_json_last({"benchmark": "kernel_paths", "machine": machine_line(), "plans": best, "paths": labels})


if __name__ == "__main__":
    main()
