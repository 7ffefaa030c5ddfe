"""A float32 model on sluice's fixed-order float kernel against BLAS (NOTE(float-kernel)), side by side.

    python benchmarks/float_kernel.py                      # SmolLM2 fp32; writes section float_kernel of docs/kernels.md
    python benchmarks/float_kernel.py --rounds 1 --no-write

Two arms, each in its own process (the engine's threads are process state): the default (every linear
moved onto the float kernel, the whole model on the work pool) and ``SLUICE_FLOAT_KERNEL=blas`` (BLAS
matrices on torch's threads).  Each arm measures, on one ``sluice.LLM``:

    layers <rows>   the model's linears and LM head alone, one pass over random rows, best of 5 (ms)
    prefill         one ~600-token prompt to its first token (s; prefix caching off)
    c=1, c=8        greedy decode, 64 tokens a request, 1 and 8 requests at once (tok/s)

and whether the two arms' greedy tokens are the same.  Arms alternate over ``--rounds`` rounds; each
figure is its median.  Prints the table, writes it (unless ``--no-write``), prints one JSON line last.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "kernels.md"
ARMS = {"float kernel": "", "BLAS": "blas"}
ROWS = (1, 2, 5, 8, 16, 64)
PASSAGE = "The history of the city is long and complicated, and its people remember most of it. "


def measure(model: str, rows: tuple[int, ...], tokens: int, prefill_repeat: int) -> dict[str, Any]:
    """One arm, in this process (``SLUICE_FLOAT_KERNEL`` set by the caller)."""
    import torch

    from sluice import LLM, SamplingParams

    llm = LLM(model, quantization="none", max_num_seqs=8, enable_prefix_caching=False)
    runner = llm.engine.runner
    model_ = runner.model
    lins = {n: lin for n, lin in model_.linears().items() if n != "embed"}  # the embedding is a lookup
    out: dict[str, Any] = {"kinds": sorted({k for lin in model_.linears().values() for k, _, _ in lin.parts}),
                           "pool_threads": runner.work_pool_threads}  # fmt: skip
    llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up (kernel plans, first step)
    hidden = model_.cfg.hidden_size
    with torch.inference_mode():
        for m in rows:
            xs = {k: torch.randn(m, k) for k in {lin.in_features for lin in lins.values()}}
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for lin in lins.values():
                    lin(xs[lin.in_features])
                model_.compute_logits(torch.randn(m, hidden))
                best = min(best, time.perf_counter() - t)
            out[f"layers_{m}_ms"] = 1e3 * best
    one = SamplingParams(temperature=0.0, max_tokens=1)
    t = time.perf_counter()
    llm.generate([PASSAGE * prefill_repeat], one)
    out["prefill_s"] = time.perf_counter() - t
    out["prefill_tokens"] = len(llm.tokenizer.encode(PASSAGE * prefill_repeat))
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    toks: list[list[int]] = []
    for c in (1, 8):
        prompts = [f"Question {i}: name a fruit, a colour and a city, and say why." for i in range(c)]
        t = time.perf_counter()
        res = llm.generate(prompts, sp)
        out[f"c{c}_tok_s"] = c * tokens / (time.perf_counter() - t)
        toks += [list(r.outputs[0].token_ids) for r in res]
    out["tokens"] = toks
    return out


def run_arm(arm: str, model: str, rows: tuple[int, ...], tokens: int, prefill_repeat: int) -> dict[str, Any]:
    env = {**os.environ, "SLUICE_FLOAT_KERNEL": ARMS[arm]}
    cmd = [sys.executable, __file__, "--_arm", "--model", model, "--tokens", str(tokens),
           "--prefill-repeat", str(prefill_repeat), "--rows", ",".join(map(str, rows))]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{arm}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--prefill-repeat", type=int, default=40, help="copies of the passage in the prefill prompt")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts of the layers-alone pass")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default="float_kernel",
                    help="the docs/kernels.md section to write (one per CPU kind kept: e.g. float_kernel_epyc)")
    ap.add_argument("--_arm", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        rows = tuple(int(r) for r in args.rows.split(","))
    except ValueError:
        ap.error(f"--rows {args.rows!r}: comma-separated row counts")
    if args._arm:
        res = measure(args.model, rows, args.tokens, args.prefill_repeat)
        print(json.dumps(res), flush=True)
        return res
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    for _ in range(args.rounds):
        for arm in ARMS:
            runs[arm].append(run_arm(arm, args.model, rows, args.tokens, args.prefill_repeat))
    keys = [f"layers_{m}_ms" for m in rows] + ["prefill_s", "c1_tok_s", "c8_tok_s"]
    med = {a: {k: statistics.median(r[k] for r in runs[a]) for k in keys} for a in ARMS}
    same = runs["float kernel"][-1]["tokens"] == runs["BLAS"][-1]["tokens"]
    names = [f"layers + LM head, {m} row{'s' if m > 1 else ''} (ms)" for m in rows]
    names += [f"prefill, {runs['BLAS'][-1]['prefill_tokens']} tokens (s)", "decode c=1 (tok/s)",
              "decode c=8 (tok/s)"]  # fmt: skip
    table_rows: list[list[object]] = [[n, med["float kernel"][k], med["BLAS"][k], med["BLAS"][k] / med["float kernel"][k]
                                       if k.endswith(("_ms", "_s")) and not k.endswith("tok_s")
                                       else med["float kernel"][k] / med["BLAS"][k]] for n, k in zip(names, keys)]  # fmt: skip
    table = markdown_table(["SmolLM2 fp32" if args.model == "smollm2" else args.model, "float kernel", "BLAS",
                            "kernel speed-up"], table_rows)  # fmt: skip
    print(table)
    result = {"machine": machine_line(), "rounds": args.rounds, "median": med, "same_tokens": same,
              "kinds": {a: runs[a][-1]["kinds"] for a in ARMS}, "pool_threads": {a: runs[a][-1]["pool_threads"] for a in ARMS}}  # fmt: skip
    if not args.no_write:
        body = "\n".join([
            f"`python benchmarks/float_kernel.py` ({args.model}, {machine_line()}; each arm in its own process, "
            f"medians of {args.rounds} alternating rounds; `kernel speed-up` > 1: the float kernel is faster; "
            f"greedy tokens of the two arms {'the same' if same else 'NOT the same'}):", "", table, ""])  # fmt: skip
        write_section(args.section, body, DOC)
    print_json_last(result)
    return result


if __name__ == "__main__":
    main()
