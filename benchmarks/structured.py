"""Structured outputs in the engine: grammar compile and mask times, constrained throughput, jump-forward.

    python benchmarks/structured.py                         # SmolLM2 (in-process sluice.LLM), writes the doc
    python benchmarks/structured.py --levels 1 8 --tokens 32 --no-write        # shorter
    python benchmarks/structured.py --model /tmp/tiny --levels 2 --reps 3 --no-write   # smoke

Three parts, all in this process (llguidance 1.x, the engine's own ``sluice.engine.structured``):

    compile       each constraint of ``CONSTRAINTS`` compiled ``--reps`` times from scratch (cold: grammar
                  text + llguidance matcher) and taken from the compiler's cache (cached: lookup + the
                  request's copy); p50 / p95 over all; then the time of the first mask (llguidance builds
                  its lexer lazily) and of each mask after it, walking a valid answer token by token
    throughput    output tok/s of ``--levels`` concurrent requests (one ``generate`` call each, 64 tokens,
                  greedy), 0 / 50 / 100% of them constrained by a schema with a long free string (so every
                  request makes the same number of tokens), and the ratio to the unconstrained run;
                  the shares run interleaved, ``--rounds`` times, medians
    jump-forward  a schema with many keys (``ORDER``), jump-forward off and on in turn (``--rounds``),
                  the same requests: engine steps, wall time (median), and whether the tokens are the
                  same (they must be)

Prints tables, writes the ``structured`` section of docs/structured_outputs.md (unless
``--no-write``), and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "structured_outputs.md"

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "email": {"type": "string", "format": "email"}}, "required": ["name", "age"]}  # fmt: skip
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                     "country": {"enum": ["FR", "DE", "US", "JP"]}}, "required": ["name", "country"],
                     "additionalProperties": False},  # fmt: skip
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 8}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number"}}, "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "paid": {"type": "boolean"},
        "notes": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]},
    },
    "required": ["order_id", "customer", "items", "paid", "notes"],
    "additionalProperties": False,
}
WIDE = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]}
        for i in range(60)}, "required": [f"field_{i}" for i in range(0, 60, 2)]}  # fmt: skip
STORY = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
         "story": {"type": "string", "minLength": 2000}}, "required": ["title", "story"],
         "additionalProperties": False}  # fmt: skip
TOOL_CALL = ('start: "<tool_call>" call "</tool_call>"\ncall: %json ' + json.dumps({
    "oneOf": [{"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {"type": "object",
               "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}},
               "required": ["name", "arguments"]},
              {"type": "object", "properties": {"name": {"const": "search"}, "arguments": {"type": "object",
               "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}},
               "required": ["name", "arguments"]}]}))  # fmt: skip

# (name, StructuredOutputs fields, a valid answer for the mask walk)
CONSTRAINTS: list[tuple[str, dict[str, Any], str]] = [
    ("json_object", {"json_object": True}, '{"a": [1, 2, {"b": null}], "c": "d"}'),
    ("person", {"json": json.dumps(PERSON)}, '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"}'),
    ("order", {"json": json.dumps(ORDER)}, json.dumps({"order_id": "ABC-123456", "customer": {"name": "Bo",
     "country": "FR"}, "items": [{"sku": "x1", "quantity": 2, "price": 9.5}], "paid": True, "notes": None})),
    ("wide (60 keys)", {"json": json.dumps(WIDE)}, json.dumps({f"field_{i}": ["s", 1, True][i % 3] for i in range(0, 60, 2)})),
    ("tool call (lark + %json)", {"grammar": TOOL_CALL},
     '<tool_call>{"name": "search", "arguments": {"query": "llguidance", "limit": 3}}</tool_call>'),
    ("regex", {"regex": r"\d{3}-\d{3}-\d{4}( x\d{1,5})?"}, "555-123-4567 x89"),
    ("choice", {"choice": ["positive", "negative", "neutral"]}, "neutral"),
]  # fmt: skip


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def bench_compile(hf_tokenizer: Any, reps: int) -> tuple[list[list[object]], dict[str, Any]]:
    import llguidance
    import llguidance.numpy as lnp

    from sluice.engine.protocol import StructuredOutputs
    from sluice.engine.structured import (
        GrammarCompiler,
        GrammarState,
        compile_grammar,
        constraint_key,
        grammar_spec,
        make_ll_tokenizer,
    )

    t0 = time.monotonic()
    tok = make_ll_tokenizer(hf_tokenizer, [hf_tokenizer.eos_token_id], len(hf_tokenizer))
    tokenizer_s = time.monotonic() - t0
    compiler = GrammarCompiler(lambda: tok, num_threads=1)
    executor = llguidance.LLExecutor(1)
    rows, cold_all, cached_all, masks_all = [], [], [], []
    for name, fields, answer in CONSTRAINTS:
        key = constraint_key(StructuredOutputs(**fields))
        cold = []
        for _ in range(reps):
            t = time.perf_counter()
            m = compile_grammar(key[0], grammar_spec(*key), tok)
            cold.append(time.perf_counter() - t)
            assert not m.is_error(), m.get_error()
        compiler.submit(key)
        while compiler.entry(key) is None:
            time.sleep(0.001)
        cached = []
        for _ in range(reps):
            t = time.perf_counter()
            compiler.submit(key)
            entry = compiler.entry(key)
            assert entry is not None and entry.matcher is not None
            GrammarState(key, 0.0, True).start(entry.matcher, [])
            cached.append(time.perf_counter() - t)
        # the mask walk: a fresh copy of a freshly compiled matcher, one valid answer
        state = GrammarState(key, 0.0, True)
        state.start(compile_grammar(key[0], grammar_spec(*key), tok), [])
        bits = lnp.allocate_token_bitmask(1, tok.vocab_size)
        ids = tok.tokenize_str(answer)
        times = []
        for t_id in ids:
            t = time.perf_counter()
            lnp.fill_next_token_bitmask_par(executor, [(state.matcher, 0)], bits)
            times.append(time.perf_counter() - t)
            assert state.accept(t_id), (name, state.error)
        first, rest = times[0], times[1:] or times
        cold_all += cold
        cached_all += cached
        masks_all += rest
        rows.append([name, len(grammar_spec(*key)), 1e3 * statistics.median(cold), 1e3 * _pct(cold, 0.95),
                     1e3 * statistics.median(cached), 1e3 * first, 1e6 * statistics.mean(rest), 1e6 * max(rest), len(ids)])  # fmt: skip
    compiler.close()
    summary = {"tokenizer_s": tokenizer_s, "cold_p50_ms": 1e3 * statistics.median(cold_all),
               "cold_p95_ms": 1e3 * _pct(cold_all, 0.95), "cached_p50_ms": 1e3 * statistics.median(cached_all),
               "cached_p95_ms": 1e3 * _pct(cached_all, 0.95), "mask_mean_us": 1e6 * statistics.mean(masks_all),
               "mask_p95_us": 1e6 * _pct(masks_all, 0.95)}  # fmt: skip
    return rows, summary


def _prompts(llm: Any, n: int) -> list[list[int]]:
    topics = ["a dragon", "the sea", "a robot", "Paris", "a cat", "winter", "a library", "the moon"]
    msgs = [[{"role": "user", "content": f"Write a JSON object with a title and a long story about {topics[i % 8]} "
              f"(number {i})."}] for i in range(n)]  # fmt: skip
    return [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(m), add_special_tokens=False) for m in msgs]


def bench_throughput(llm: Any, levels: list[int], tokens: int, rounds: int) -> tuple[list[list[object]], dict[str, Any]]:
    """NOTE(interleaved): the shares run in turn, ``rounds`` times, and each figure is the median over
    the rounds: on a machine shared with other work a slow minute then hits every share alike."""
    from sluice.engine.protocol import SamplingParams, StructuredOutputs

    free = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=tokens, temperature=0.0, structured=StructuredOutputs(json=json.dumps(STORY)))
    llm.generate(_prompts(llm, 2), [free, constrained])  # warm-up: compile, first masks
    rows, out = [], {}
    for c in levels:
        prompts = _prompts(llm, c)
        # (label, share constrained, masks computed on their thread while the model runs)
        shares = [("0%", 0.0, True), ("50%", 0.5, True), ("100%", 1.0, True)]
        if c == 1:
            shares = [shares[0], shares[2]]
        if c == max(levels):  # NOTE(mask-overlap): the same, masks computed after the forward pass
            shares.append(("100%, masks inline", 1.0, False))
        runs: dict[str, list[tuple[float, float, float, float]]] = {sh[0]: [] for sh in shares}
        for _ in range(rounds):
            for label, share, overlap in shares:
                llm.engine.grammars.overlap = overlap
                k = round(c * share)
                params = [constrained if i < k else free for i in range(c)]
                s0 = llm.engine.make_stats()
                t0, cpu0 = time.monotonic(), time.process_time()
                res = llm.generate(prompts, params)
                wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
                s1 = llm.engine.make_stats()
                n = sum(len(r.token_ids) for r in res)
                steps = max(1, s1.structured_mask_steps - s0.structured_mask_steps)
                runs[label].append((n / wall, 1e3 * cpu / n, 1e3 * (s1.structured_mask_seconds - s0.structured_mask_seconds) / steps,
                                    1e3 * (s1.structured_mask_wait_seconds - s0.structured_mask_wait_seconds) / steps))  # fmt: skip
        llm.engine.grammars.overlap = True
        med = {label: [statistics.median(x[i] for x in runs[label]) for i in range(4)] for label in runs}
        base = med["0%"]
        for label, _, _ in shares:
            tps, cpu_ms, mask_ms, wait_ms = med[label]
            rows.append([c, label, tps, tps / base[0], cpu_ms, cpu_ms / base[1], mask_ms, wait_ms])
            out[f"c{c}_{label.replace('%', '').replace(', masks ', '_')}"] = {"tok_s": tps, "ratio": tps / base[0], "cpu_ms_per_token": cpu_ms,
                                            "cpu_ratio": cpu_ms / base[1], "mask_ms": mask_ms, "mask_wait_ms": wait_ms}  # fmt: skip
    return rows, out


def bench_jump_forward(llm: Any, n: int, rounds: int) -> tuple[list[list[object]], dict[str, Any]]:
    """Jump-forward off and on in turn, ``rounds`` times, on one engine (NOTE(interleaved)); medians."""
    from sluice.engine.protocol import SamplingParams, StructuredOutputs

    params = SamplingParams(max_tokens=256, temperature=0.0, structured=StructuredOutputs(json=json.dumps(ORDER)))
    prompts = _prompts(llm, n)
    llm.generate(prompts[:1], params)  # warm-up
    runs: dict[bool, list[tuple[int, int, int, float, int]]] = {False: [], True: []}
    tokens: dict[bool, list[list[int]]] = {}
    for _ in range(rounds):
        for jf in (False, True):
            llm.engine.config.jump_forward = jf  # read by each add_request
            s0 = llm.engine.make_stats()
            t0 = time.monotonic()
            res = llm.generate(prompts, params)
            wall = time.monotonic() - t0
            s1 = llm.engine.make_stats()
            tokens[jf] = [r.token_ids for r in res]
            valid = sum(1 for r in res if r.finish_reason == "stop" and _valid(r.text))
            runs[jf].append((sum(len(t) for t in tokens[jf]), s1.jump_forward_tokens - s0.jump_forward_tokens,
                             s1.num_steps - s0.num_steps, wall, valid))  # fmt: skip
    llm.engine.config.jump_forward = True
    rows, out = [], {}
    for jf in (False, True):
        n_tok, forced, steps, _, valid = runs[jf][-1]
        wall = statistics.median(r[3] for r in runs[jf])
        rows.append(["on" if jf else "off", n, n_tok, forced, steps, wall, n_tok / wall, f"{valid}/{n}"])
        out["on" if jf else "off"] = {"steps": steps, "wall_s": wall, "tok_s": n_tok / wall, "forced": forced}
    out["same_tokens"] = tokens[True] == tokens[False]
    out["steps_saved"] = 1.0 - out["on"]["steps"] / max(1, out["off"]["steps"])
    out["speedup"] = out["off"]["wall_s"] / out["on"]["wall_s"]
    return rows, out


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), ORDER)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request in the throughput runs")
    ap.add_argument("--reps", type=int, default=20, help="compiles per constraint")
    ap.add_argument("--rounds", type=int, default=3, help="throughput runs per share, interleaved (medians)")
    ap.add_argument("--jf-requests", type=int, default=8)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    from sluice import LLM

    engine_args: dict[str, Any] = {"max_num_seqs": max(32, *args.levels)}
    llm = LLM(args.model, **engine_args)
    c_rows, c_sum = bench_compile(llm.tokenizer.hf, args.reps)
    c_table = markdown_table(["constraint", "grammar chars", "cold p50 ms", "cold p95 ms", "cached p50 ms",
                              "first mask ms", "mask mean us", "mask max us", "tokens walked"], c_rows)  # fmt: skip
    print(c_table, "\n")
    t_rows, t_out = bench_throughput(llm, args.levels, args.tokens, args.rounds)
    t_table = markdown_table(["c", "constrained", "tok/s", "ratio to 0%", "CPU ms/token", "CPU ratio to 0%",
                              "mask ms/step", "mask wait ms/step"], t_rows)  # fmt: skip
    print(t_table, "\n")
    j_rows, j_out = bench_jump_forward(llm, args.jf_requests, args.rounds)
    llm.engine.close()
    j_table = markdown_table(["jump-forward", "requests", "tokens", "forced tokens", "steps", "wall s (median)", "tok/s",
                              "valid"], j_rows)  # fmt: skip
    print(j_table)
    print(f"same tokens with and without jump-forward: {j_out['same_tokens']}")

    body = "\n".join([
        f"`python benchmarks/structured.py` ({args.model}, {machine_line()}):", "",
        f"Compile ({args.reps} times per constraint; the tokenizer, built once per engine: "
        f"{c_sum['tokenizer_s']:.2f} s). Cold p50 {c_sum['cold_p50_ms']:.2f} ms, p95 {c_sum['cold_p95_ms']:.2f} ms; "
        f"cached p50 {c_sum['cached_p50_ms']:.3f} ms, p95 {c_sum['cached_p95_ms']:.3f} ms. Mask per token "
        f"(after the first): mean {c_sum['mask_mean_us']:.0f} us, p95 {c_sum['mask_p95_us']:.0f} us.", "",
        c_table, "",
        f"Throughput, {args.tokens} output tokens per request, greedy; constrained requests follow a schema with "
        "a long free string (the same number of tokens as the others); medians of "
        f"{args.rounds} interleaved rounds (CPU: this process's CPU time per output token; mask ms/step: "
        "from the start of a step's mask job to its end, on its thread):", "",
        t_table, "",
        f"Jump-forward A/B ({args.jf_requests} requests, the `ORDER` schema, greedy); same tokens: "
        f"{j_out['same_tokens']}, steps saved {100 * j_out['steps_saved']:.0f}%, wall-time speedup "
        f"{j_out['speedup']:.2f}x:", "",
        j_table,
    ])  # fmt: skip
    if not args.no_write:
        write_section("structured", body, DOC)
    print_json_last({"compile": c_sum, "throughput": t_out, "jump_forward": j_out})


if __name__ == "__main__":
    main()
