"""Speculative decoding (issue 55): tok/s with and without drafts, in-process (``sluice.LLM``), greedy.

    python benchmarks/speculative.py                       # SmolLM2; writes docs/speculative.md and docs/speculative.png
    python benchmarks/speculative.py --small --no-write    # a quick look (fewer tokens, one round)

Three parts:

    self      c=1, chat prompts: the fp32 target alone (``--quantization none``), the fp32 target drafted by its
              own Q4_1 copy (``{"model": "self:q4"}``, adaptive k and fixed k=4), and the default Q4_1 path alone;
              whether the drafted run's tokens equal the fp32 target's own
    ngram     c=1, an input-grounded workload (the answer copies from the prompt): the Q4_1 path with n-gram
              drafts (adaptive, fixed k=4) and without
    load      the same workload at ``--levels`` running requests (3x as many submitted at once, the engine's
              slot cap at the level, so a steady load): off, fixed k=4, adaptive; drafted / kept
              tokens and the mean k the policy chose; ``docs/speculative.png`` plots tok/s against concurrency

Each figure is the median of ``--rounds`` runs, modes interleaved.  Prints tables, writes the
``speculative`` section of docs/speculative.md (unless ``--no-write``), and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
DOC = DOCS / "speculative.md"
PLOT = DOCS / "speculative.png"

QUESTIONS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
]
PASSAGES = [
    "The lighthouse stood on a rock at the mouth of the bay. Every evening the keeper climbed the iron stairs, "
    "trimmed the wick, wound the clockwork that turned the lens, and wrote the weather in a book. Ships that "
    "passed at night saw the beam sweep across the water once every ten seconds, and they knew where they were.",
    "To make bread, mix flour, water, salt and yeast into a dough. Knead the dough for ten minutes until it is "
    "smooth. Let it rise in a warm place for one hour. Shape it into a loaf, let it rise again for thirty "
    "minutes, and bake it in a hot oven for forty minutes until the crust is brown.",
    "The meeting is on Tuesday at ten in room 4B. Alice will present the budget, Bob will report on the new "
    "warehouse, and Carol will answer questions about the hiring plan. Please bring the printed agenda and "
    "send any new topics to Alice before Monday noon.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into "
    "sugar and oxygen. It takes place in the chloroplasts, which contain chlorophyll, the pigment that makes "
    "leaves green. The oxygen is released into the air, and the sugar feeds the plant.",
]
TASKS = ["Repeat the following text exactly, word for word:", "Copy this text, then stop:",
         "Rewrite the following text without changing it:", "Quote the following text in full:"]  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SELF_Q4 = {"model": "self:q4", "num_speculative_tokens": 4}


def _chat_ids(llm: Any, texts: list[str]) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False) for t in texts]


def _grounded(n: int) -> list[str]:
    return [f"{TASKS[i % len(TASKS)]}\n\n{PASSAGES[(i + i // len(TASKS)) % len(PASSAGES)]}" for i in range(n)]


def _run(llm: Any, prompts: list[list[int]], tokens: int, concurrency: int) -> tuple[float, list[list[int]], dict[str, Any]]:
    """(tok/s, tokens per prompt, speculation counters of the run): every prompt submitted at once, at most
    ``concurrency`` running (the engine's slot cap; a finished request's slot goes to the next at once)."""
    from sluice.engine.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    llm.engine.scheduler.max_num_seqs = concurrency
    s0 = llm.engine.make_stats()
    t0 = time.monotonic()
    out = [r.token_ids for r in llm.generate(prompts, params)]
    wall = time.monotonic() - t0
    s1 = llm.engine.make_stats()
    drafted = s1.spec_drafted_tokens - s0.spec_drafted_tokens
    accepted = s1.spec_accepted_tokens - s0.spec_accepted_tokens
    runs = s1.spec_verify_runs - s0.spec_verify_runs
    ks = [b - a for a, b in zip(s0.spec_k_counts or [0] * len(s1.spec_k_counts), s1.spec_k_counts)]
    mean_k = sum(k * n for k, n in enumerate(ks)) / max(1, sum(ks))
    spec = {"drafted": drafted, "accepted": accepted, "accept_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_len": accepted / runs if runs else 0.0, "mean_k": mean_k}  # fmt: skip
    return sum(len(t) for t in out) / wall, out, spec


def _median_runs(modes: dict[str, Any], prompts: dict[str, list[list[int]]], tokens: int, concurrency: int,
                 rounds: int) -> dict[str, tuple[float, list[list[int]], dict[str, Any]]]:  # fmt: skip
    """Each mode's median tok/s over ``rounds`` interleaved runs (its last run's tokens and counters)."""
    tps: dict[str, list[float]] = {m: [] for m in modes}
    last: dict[str, tuple[float, list[list[int]], dict[str, Any]]] = {}
    for _ in range(rounds):
        for name, llm in modes.items():
            last[name] = _run(llm, prompts[name], tokens, concurrency)
            tps[name].append(last[name][0])
    return {m: (statistics.median(tps[m]), *last[m][1:]) for m in modes}


def bench_self(model: str, tokens: int, rounds: int) -> tuple[list[list[object]], dict[str, Any]]:
    from sluice import LLM

    modes = {
        "fp32 target": LLM(model, quantization="none"),
        "fp32 + self:q4, adaptive": LLM(model, quantization="none", speculative_config=SELF_Q4),
        "fp32 + self:q4, k=4": LLM(model, quantization="none", speculative_config={**SELF_Q4, "k_policy": "fixed"}),
        "Q4_1 path": LLM(model),
    }
    prompts = {m: _chat_ids(llm, QUESTIONS) for m, llm in modes.items()}
    for m, llm in modes.items():  # warm-up (the draft's first prefill, kernel plans)
        _run(llm, prompts[m][:1], 8, 1)
    res = _median_runs(modes, prompts, tokens, 1, rounds)
    base = res["fp32 target"]
    rows, out = [], {}
    for m, (tps, toks, spec) in res.items():
        same = toks == base[1] if m.startswith("fp32") else "-"
        rows.append([m, tps, tps / base[0], spec["accept_rate"] if spec["drafted"] else "-",
                     spec["mean_accepted_len"] if spec["drafted"] else "-", f"{spec['mean_k']:.2f}", same])  # fmt: skip
        out[m] = {"tok_s": tps, "speedup": tps / base[0], **spec, "same_tokens": same}
    return rows, out


def bench_ngram(model: str, tokens: int, levels: list[int], rounds: int, n_prompts: int) -> tuple[list[list[object]], dict[str, Any]]:
    from sluice import LLM

    seqs = max(levels)
    modes = {
        "off": LLM(model, max_num_seqs=seqs),
        "ngram k=4": LLM(model, max_num_seqs=seqs, speculative_config={**NGRAM, "k_policy": "fixed"}),
        "ngram adaptive": LLM(model, max_num_seqs=seqs, speculative_config=NGRAM),
    }
    prompts = {m: _chat_ids(llm, _grounded(max(n_prompts, 3 * seqs))) for m, llm in modes.items()}
    for m, llm in modes.items():
        _run(llm, prompts[m][:2], 8, 2)
    rows, out = [], {}
    for c in levels:
        n = max(n_prompts, 3 * c)  # past the first wave, slots free one by one: a steady c running
        res = _median_runs(modes, {m: p[:n] for m, p in prompts.items()}, tokens, c, rounds)
        base = res["off"]
        for m, (tps, toks, spec) in res.items():
            rows.append([c, m, tps, tps / base[0], spec["accept_rate"] if spec["drafted"] else "-",
                         spec["mean_accepted_len"] if spec["drafted"] else "-", f"{spec['mean_k']:.2f}",
                         toks == base[1]])  # fmt: skip
            out[f"c{c}_{m}"] = {"tok_s": tps, "speedup": tps / base[0], **spec, "same_tokens": toks == base[1]}
    return rows, out


def plot(out: dict[str, Any], levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in ("off", "ngram k=4", "ngram adaptive"):
        ax.plot(levels, [out[f"c{c}_{m}"]["tok_s"] for c in levels], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s")
    ax.set_title("SmolLM2 Q4_1, input-grounded answers: n-gram speculation")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=96, help="max output tokens per request")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts", type=int, default=8, help="requests per run (at least 3x the concurrency)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="32 tokens, 4 prompts at c=1, one round")
    ap.add_argument("--skip-self", action="store_true", help="leave out the fp32 + self:q4 part")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.small:
        args.tokens, args.rounds, args.prompts = 32, 1, 4

    result: dict[str, Any] = {"machine": machine_line(), "tokens": args.tokens, "levels": args.levels}
    parts = [f"`python benchmarks/speculative.py` ({args.model}, {machine_line()}; greedy, up to {args.tokens} "
             f"tokens per request, medians of {args.rounds} interleaved runs):", ""]  # fmt: skip
    if not args.skip_self:
        rows, result["self"] = bench_self(args.model, args.tokens, args.rounds)
        table = markdown_table(["c=1, chat", "tok/s", "x fp32", "accepted", "mean kept run", "mean k", "same tokens"], rows)
        print(table, "\n")
        parts += ["Self-speculation: the fp32 target drafted by its own Q4_1 weights.", "", table, ""]
    rows, result["ngram"] = bench_ngram(args.model, args.tokens, args.levels, args.rounds, args.prompts)
    table = markdown_table(["c", "input-grounded", "tok/s", "x off", "accepted", "mean kept run", "mean k",
                            "same tokens"], rows)  # fmt: skip
    print(table)
    parts += ["N-gram drafts on the Q4_1 path, answers that copy from the prompt.", "", table, ""]
    if not args.no_write:
        plot(result["ngram"], args.levels, PLOT)
        parts += ["![tok/s against concurrency](speculative.png)", ""]
        write_section("speculative", "\n".join(parts), DOC)
    print_json_last(result)


if __name__ == "__main__":
    main()
