"""Decode steps at long contexts: where attention is most of a step.

    python benchmarks/long_context.py                        # this checkout
    python benchmarks/long_context.py --base /path/to/other  # and another checkout, alternating rounds

One or two sequences of random token ids with 512 to 4096 keys, 16 of 512 and
64 of 128 keys, in-process
``EngineCore`` on SmolLM2 as shipped, greedy: the median decode step and the
part of it spent in the attention backend (``attend_qkv`` timed), per case.
With few sequences the paged-attention kernel has few work items (one per
token and KV head: 3 for one SmolLM2 row), so how they split over the
threads decides the step (NOTE(key-segments) in
``sluice/kernels/csrc/paged_attention.cpp``).  ``--base`` measures another
checkout (its sources, its compiled extensions) the same way, the two
alternating over ``--rounds``; each figure is the best round's median, so a
slow moment of the machine does not land on one side only.  Writes section
``long_context`` of docs/benchmarks.md.
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

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("SLUICE_BENCH_TREE", str(_ROOT)))  # the child imports the tree it measures

CASES = [(1, 512), (1, 2048), (1, 4096), (2, 2048), (16, 512), (64, 128)]  # (sequences, keys)


def measure_here(steps: int = 15) -> dict[str, list[float]]:
    """{"<rows> x <keys>": [step ms, attention ms]} for the sluice this process imports."""
    import torch

    from benchmarks._step_profile import _Timer
    from sluice.engine.config import EngineConfig
    from sluice.engine.core import EngineCore
    from sluice.engine.protocol import EngineRequest, SamplingParams

    core = EngineCore(EngineConfig(model="smollm2", max_num_seqs=64, max_model_len=4608, kv_cache_memory=1 << 30))
    attention = _Timer(core.runner.attention, "attend_qkv")  # what the fused layers call
    gen = torch.Generator().manual_seed(0)
    out: dict[str, list[float]] = {}
    for n, (rows, keys) in enumerate(CASES):
        for i in range(rows):
            prompt = torch.randint(1000, 30000, (keys,), generator=gen).tolist()
            sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
            core.add_request(EngineRequest(request_id=f"c{n}-{i}", prompt_token_ids=prompt, sampling=sp,
                                           arrival_time=time.monotonic()))  # fmt: skip
        while core.make_stats().num_decoding < rows:
            core.step()
        core.step()
        times, attention.seconds = [], 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t0)
        out[f"{rows} x {keys}"] = [1e3 * statistics.median(times), 1e3 * attention.seconds / steps]
        while core.has_unfinished_requests():
            core.step()
    return out


def run_tree(tree: Path) -> dict[str, list[float]]:
    """One child process measuring the checkout at ``tree`` (its own venv's python when it has one)."""
    py = tree / ".venv" / "bin" / "python"
    env = {**os.environ, "SLUICE_BENCH_TREE": str(tree), "PYTHONPATH": str(tree)}
    cmd = [str(py) if py.exists() else sys.executable, __file__, "--child"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tree)
    if proc.returncode != 0:
        raise SystemExit(f"long_context: the run in {tree} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def best_of(rounds: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per case, the round with the lowest step time (its attention time with it)."""
    return {case: min((r[case] for r in rounds), key=lambda v: v[0]) for case in rounds[0]}


def table_rows(this: dict[str, list[float]], base: dict[str, list[float]] | None) -> list[list[object]]:
    rows: list[list[object]] = []
    for case, (step, attn) in this.items():
        row: list[object] = [case, f"{step:.2f}", f"{attn:.2f}", f"{attn / step:.0%}"]
        if base is not None:
            b_step, b_attn = base[case]
            row += [f"{b_step:.2f}", f"{b_attn:.2f}", f"{step / b_step:.2f}x"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=None, help="another checkout to measure alongside (A/B)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per checkout, alternating")
    ap.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure_here()))
        return
    if a.base is not None and not (a.base / "sluice").is_dir():
        ap.error(f"--base {a.base}: not a sluice checkout (no sluice/ in it)")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    from benchmarks._report import machine_line, markdown_table, print_json_last, write_section

    mine: list[dict[str, list[float]]] = []
    theirs: list[dict[str, list[float]]] = []
    for r in range(a.rounds):
        for label, tree, into in (("this", _ROOT, mine), ("base", a.base, theirs)):
            if tree is None:
                continue
            into.append(run_tree(tree))
            print(f"round {r + 1} {label}: " + "  ".join(f"{k} {v[0]:.2f}/{v[1]:.2f} ms" for k, v in into[-1].items()),
                  flush=True)  # fmt: skip
    this, base = best_of(mine), best_of(theirs) if theirs else None
    headers = ["sequences x keys", "decode step (ms)", "attention (ms)", "attention share"]
    if base is not None:
        headers += ["base step (ms)", "base attention (ms)", "step vs base"]
    table = markdown_table(headers, table_rows(this, base))
    body = (
        "## Decode steps at long contexts (`benchmarks/long_context.py`)\n\n"
        f"{machine_line()}. SmolLM2-135M-Instruct Q4_1/Q8_0 as shipped, fp32 KV cache, in-process `EngineCore`, "
        "greedy; sequences of random token ids, the median of 15 decode steps once all have their first token; "
        "attention is the time in the attention backend. "
        + (f"Base: the checkout at `{a.base}`, measured the same way. " if base is not None else "")
        + f"Best of {a.rounds} alternating rounds.\n\n" + table + "\n"
    )
    print(table)
    if not a.no_write:
        write_section("long_context", body)
    print_json_last({"benchmark": "long_context", "machine": machine_line(), "this": this, "base": base})


if __name__ == "__main__":
    main()
