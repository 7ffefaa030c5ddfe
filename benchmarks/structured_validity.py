"""Structured outputs over HTTP: are the answers valid, and does compiling hold up unconstrained requests?

    python benchmarks/structured_validity.py                      # SmolLM2, 25 answers x 24 schemas, writes the doc
    python benchmarks/structured_validity.py --per-schema 2 --tool-answers 4 --new-schemas 10 --no-write  # shorter
    python benchmarks/structured_validity.py --model /tmp/tiny ... --no-write                            # smoke

The two benchmark targets of issue 54 that benchmarks/structured.py (engine, in process) does not
measure; this script starts its own ``sluice serve`` on 127.0.0.1 and stops it at the end, always:

    validity      ``--per-schema`` answers to each of the ``SCHEMAS`` (nested objects, bounded arrays,
                  enums, anyOf, patterns, ranged numbers, formats), ``response_format: json_schema``,
                  temperature 0.7, ``--concurrency`` in flight, with the official ``openai`` client; each
                  finished answer is checked with ``jsonschema`` (Draft 2020-12, formats asserted with
                  its FormatChecker); answers cut by ``max_tokens`` (finish_reason "length") are counted
                  apart. Then the same for tool calls: ``TOOLS`` with ``tool_choice: "required"``, each
                  call's arguments checked against its function's ``parameters``.
    compile       unconstrained streams (``--stream-concurrency`` in flight, ``max_tokens`` 16) and their
                  TTFT p50 / p95, alone ("none"), while ``--new-schemas`` distinct schemas are sent (each
                  with a property name of its own, so each compiles cold: "cold"), and while as many
                  requests of one already compiled schema are sent ("cached": the same extra decode load
                  without the compiles); the three interleaved ``--rounds`` times. Then the compile cost
                  itself: the engine's ``sluice_structured_compile_seconds`` from /metrics, and the TTFT of
                  one request alone with a new schema and with the same schema again.

Prints tables, writes the ``structured_validity`` section of docs/structured_outputs.md (unless
``--no-write``), and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402
from benchmarks.structured_validity_schemas import SCHEMAS, TOOL_PROMPTS, TOOLS, cold_schema  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "structured_outputs.md"
SYSTEM = "You are a data extraction assistant. Answer with JSON only."
STREAM_PROMPTS = ["Say hello.", "Name a colour.", "Count to five.", "What is 2 + 2?", "Name a fruit.",
                  "Write one word.", "Name a city.", "Tell me a short fact."]  # fmt: skip


# ---------------------------------------------------------------- checking answers

RFC3339 = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})$")


def is_date_time(value: object) -> bool:
    """RFC 3339 date-time (jsonschema asserts it only with the rfc3339-validator package, absent here)."""
    if not isinstance(value, str):
        return True
    if not RFC3339.match(value):
        return False
    try:  # a real calendar date and time; a leap second (:60) passes as :59
        datetime.fromisoformat(re.sub(r":60(?=[.Zz+-])", ":59", value.upper().replace("Z", "+00:00")))
    except ValueError:
        return False
    return True


def validator(schema: dict[str, Any]) -> Any:
    """Draft 2020-12 with formats asserted: jsonschema's FormatChecker (date, email, uuid, ...) plus date-time."""
    from jsonschema import Draft202012Validator, FormatChecker

    Draft202012Validator.check_schema(schema)
    formats = FormatChecker()
    formats.checks("date-time")(is_date_time)
    return Draft202012Validator(schema, format_checker=formats)


def check(schema_validator: Any, text: str) -> str | None:
    """None when ``text`` is a JSON document the schema accepts, else why not (the first error)."""
    try:
        doc = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        return f"not JSON: {e}"
    errors = sorted(schema_validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if not errors:
        return None
    e = errors[0]
    return f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"


class Tally:
    """Counts of one schema's (or tool set's) answers; ``failures`` keeps each invalid answer and why."""

    def __init__(self) -> None:
        self.valid = self.invalid = self.cut = self.errors = 0
        self.tokens: list[int] = []
        self.failures: list[dict[str, str]] = []
        self.answers: list[dict[str, Any]] = []  # every answer, for --answers
        self.error_messages: list[str] = []

    def as_row(self) -> dict[str, Any]:
        return {"valid": self.valid, "invalid": self.invalid, "cut": self.cut, "errors": self.errors,
                "mean_tokens": statistics.fmean(self.tokens) if self.tokens else 0.0}  # fmt: skip


# ---------------------------------------------------------------- validity


async def run_validity(client: Any, model: str, args: argparse.Namespace) -> dict[str, Tally]:
    tallies = {name: Tally() for name in SCHEMAS}
    validators = {name: validator(s["schema"]) for name, s in SCHEMAS.items()}
    sem = asyncio.Semaphore(args.concurrency)

    async def one(name: str, i: int) -> None:
        spec, t = SCHEMAS[name], tallies[name]
        rf = {"type": "json_schema", "json_schema": {"name": name, "schema": spec["schema"], "strict": True}}
        async with sem:
            try:
                r = await client.chat.completions.create(
                    model=model, temperature=args.temperature, max_tokens=args.max_tokens, response_format=rf,
                    messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": spec["prompt"]}])  # fmt: skip
            except Exception as e:  # an HTTP error is counted, never a crash of the run
                t.errors += 1
                t.error_messages.append(f"{type(e).__name__}: {e}"[:300])
                return
        choice = r.choices[0]
        t.tokens.append(r.usage.completion_tokens if r.usage else 0)
        t.answers.append({"schema": name, "finish_reason": choice.finish_reason, "answer": choice.message.content})
        if choice.finish_reason == "length":
            t.cut += 1
            return
        why = check(validators[name], choice.message.content or "")
        if why is None:
            t.valid += 1
        else:
            t.invalid += 1
            t.failures.append({"schema": name, "answer": choice.message.content or "", "why": why,
                               "finish_reason": str(choice.finish_reason)})  # fmt: skip

    jobs = [one(name, i) for i in range(args.per_schema) for name in SCHEMAS]  # interleaved: every schema in each batch
    await asyncio.gather(*jobs)
    return tallies


async def run_tools(client: Any, model: str, args: argparse.Namespace) -> Tally:
    t = Tally()
    validators = {tool["function"]["name"]: validator(tool["function"]["parameters"]) for tool in TOOLS}
    sem = asyncio.Semaphore(args.concurrency)

    async def one(prompt: str) -> None:
        async with sem:
            try:
                r = await client.chat.completions.create(
                    model=model, temperature=args.temperature, max_tokens=args.max_tokens, tools=TOOLS,
                    tool_choice="required", messages=[{"role": "user", "content": prompt}])  # fmt: skip
            except Exception as e:
                t.errors += 1
                t.error_messages.append(f"{type(e).__name__}: {e}"[:300])
                return
        choice = r.choices[0]
        t.tokens.append(r.usage.completion_tokens if r.usage else 0)
        calls = choice.message.tool_calls or []
        t.answers.append({"schema": "tools", "prompt": prompt, "finish_reason": choice.finish_reason,
                          "content": choice.message.content, "calls": [c.model_dump() for c in calls]})  # fmt: skip
        if choice.finish_reason == "length":
            t.cut += 1
            return
        whys = [] if calls else [f"no tool call (finish_reason {choice.finish_reason})"]
        for call in calls:
            v = validators.get(call.function.name)
            whys.append(f"unknown function {call.function.name!r}" if v is None
                        else check(v, call.function.arguments))  # fmt: skip
        whys = [w for w in whys if w]
        if choice.finish_reason != "tool_calls":
            whys.append(f"finish_reason {choice.finish_reason!r}, not 'tool_calls'")
        if not whys:
            t.valid += 1
        else:
            t.invalid += 1
            t.failures.append({"schema": "tools", "answer": json.dumps([c.model_dump() for c in calls]),
                               "why": "; ".join(whys), "finish_reason": str(choice.finish_reason)})  # fmt: skip

    prompts = [TOOL_PROMPTS[i % len(TOOL_PROMPTS)] for i in range(args.tool_answers)]
    await asyncio.gather(*(one(p) for p in prompts))
    return t


# ---------------------------------------------------------------- compile under load


async def stream_ttft(http: Any, url: str, model: str, body: dict[str, Any]) -> float:
    """Seconds from sending to the first content (or tool-call) delta of a streamed chat completion."""
    t0 = time.monotonic()
    async with http.stream("POST", url + "/v1/chat/completions", json={**body, "model": model, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        ttft = None
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                delta = choices[0].get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    ttft = time.monotonic() - t0
        if ttft is None:
            raise RuntimeError("stream ended without content")
        return ttft


def plain_body(i: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": STREAM_PROMPTS[i % len(STREAM_PROMPTS)]}], "max_tokens": 16,
            "temperature": 0.7}  # fmt: skip


def schema_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Describe a product as JSON."}], "max_tokens": 8,
            "temperature": 0.7, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}  # fmt: skip


async def load_phase(http: Any, url: str, model: str, args: argparse.Namespace,
                     schemas: list[dict[str, Any]] | None) -> dict[str, Any]:  # fmt: skip
    """Unconstrained streams in a closed loop; with ``schemas``, those requests at the same time, and only the
    streams started after the first of them was sent and before the last ended count. Without, the streams
    started in ``--base-s`` seconds count."""
    ttfts: list[float] = []
    errors = 0
    burst_end: float | None = None
    phase_start = float("inf")
    stop = asyncio.Event()

    async def streams(k: int) -> None:
        nonlocal errors
        i = k
        while not stop.is_set():
            started = time.monotonic()
            try:
                ttft = await stream_ttft(http, url, model, plain_body(i))
            except Exception:
                errors += 1
                ttft = None
            if ttft is not None and started >= phase_start and (burst_end is None or started < burst_end):
                ttfts.append(ttft)
            i += args.stream_concurrency

    async def burst() -> tuple[int, float]:
        nonlocal burst_end
        sem, failed, t0 = asyncio.Semaphore(args.schema_concurrency), 0, time.monotonic()

        async def one(s: dict[str, Any]) -> None:
            nonlocal failed
            async with sem:
                try:
                    await stream_ttft(http, url, model, schema_body(s))
                except Exception:
                    failed += 1

        await asyncio.gather(*(one(s) for s in schemas or []))
        burst_end = time.monotonic()
        return failed, burst_end - t0

    tasks = [asyncio.create_task(streams(k)) for k in range(args.stream_concurrency)]
    try:
        await asyncio.sleep(1.0)  # the streams reach their steady state before the schemas start
        phase_start = time.monotonic()
        if schemas:
            failed, burst_s = await burst()
        else:
            await asyncio.sleep(args.base_s)
            failed, burst_s = 0, args.base_s
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return {"ttfts": list(ttfts), "stream_errors": errors, "schema_errors": failed, "seconds": burst_s}


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def compile_metrics(text: str) -> dict[str, float]:
    """``sluice_structured_compile_seconds`` sum and count, compiles and cache hits, from /metrics text."""
    out = {}
    for key, name in (("sum", "sluice_structured_compile_seconds_sum"), ("count", "sluice_structured_compile_seconds_count"),
                      ("compiles", "sluice_structured_compiles_total"), ("hits", "sluice_structured_cache_hits_total")):  # fmt: skip
        m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        out[key] = float(m.group(1)) if m else float("nan")
    return out


async def run_compile(http: Any, url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    warm = cold_schema("warm_cached_field")
    await stream_ttft(http, url, model, schema_body(warm))  # compiled once: "cached" sends it again and again
    pooled: dict[str, list[float]] = {"none": [], "cold": [], "cached": []}
    phases: list[dict[str, Any]] = []
    metrics: dict[str, float] = {"sum": 0.0, "count": 0.0}
    kinds = ("none", "cold", "cached")
    for rnd in range(args.rounds):
        for kind in kinds[rnd % 3:] + kinds[:rnd % 3]:  # the order turns each round: no phase always follows another
            schemas = None if kind == "none" else (
                [cold_schema(f"r{rnd}_f{j}") for j in range(args.new_schemas)] if kind == "cold" else [warm] * args.new_schemas)  # fmt: skip
            before = compile_metrics((await http.get(url + "/metrics")).text)
            res = await load_phase(http, url, model, args, schemas)
            after = compile_metrics((await http.get(url + "/metrics")).text)
            if kind == "cold":
                metrics["sum"] += after["sum"] - before["sum"]
                metrics["count"] += after["count"] - before["count"]
            pooled[kind] += res["ttfts"]
            phases.append({"round": rnd, "kind": kind, "n": len(res["ttfts"]), "p50_ms": 1000 * quantile(res["ttfts"], 0.5),
                           "p95_ms": 1000 * quantile(res["ttfts"], 0.95), "seconds": res["seconds"],
                           "stream_errors": res["stream_errors"], "schema_errors": res["schema_errors"],
                           "compiles": after["compiles"] - before["compiles"], "cache_hits": after["hits"] - before["hits"],
                           "load": os.getloadavg()[0]})  # fmt: skip
    # one request alone: a new schema (API validation + engine compile), then the same one again (both cached)
    cold_ms, warm_ms = [], []
    for j in range(args.solo):
        s = cold_schema(f"solo_{j}")
        cold_ms.append(1000 * await stream_ttft(http, url, model, schema_body(s)))
        warm_ms.append(1000 * await stream_ttft(http, url, model, schema_body(s)))
    summary = {k: {"n": len(v), "p50_ms": 1000 * quantile(v, 0.5), "p95_ms": 1000 * quantile(v, 0.95)} for k, v in pooled.items()}
    return {"phases": phases, "pooled": summary,
            "engine_compile_mean_ms": 1000 * metrics["sum"] / metrics["count"] if metrics["count"] else float("nan"),
            "engine_compiles": metrics["count"], "solo_cold_ttft_p50_ms": statistics.median(cold_ms) if cold_ms else float("nan"),
            "solo_cached_ttft_p50_ms": statistics.median(warm_ms) if warm_ms else float("nan")}  # fmt: skip


# ---------------------------------------------------------------- main


def start_server(args: argparse.Namespace) -> Any:
    from benchmarks.serving_procs import start_sluice

    ns = argparse.Namespace(model=args.model, levels=[max(32, args.concurrency, args.stream_concurrency + args.schema_concurrency)],
                            kv_cache_memory=args.kv_cache_memory, num_threads=None)  # fmt: skip
    return start_sluice(ns)


async def run_all(args: argparse.Namespace, url: str, model: str) -> dict[str, Any]:
    import httpx
    import openai

    out: dict[str, Any] = {}
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=300, max_retries=0) as client:
        if args.per_schema:
            t0 = time.monotonic()
            out["validity"] = await run_validity(client, model, args)
            out["validity_s"] = time.monotonic() - t0
            out["loads"] = [os.getloadavg()[0]]
        if args.tool_answers:
            t0 = time.monotonic()
            out["tools"] = await run_tools(client, model, args)
            out["tools_s"] = time.monotonic() - t0
            out.setdefault("loads", []).append(os.getloadavg()[0])
    if args.rounds:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            out["compile"] = await run_compile(http, url, model, args)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--per-schema", type=int, default=25, help="answers per schema (24 schemas)")
    p.add_argument("--tool-answers", type=int, default=60)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--new-schemas", type=int, default=100)
    p.add_argument("--stream-concurrency", type=int, default=8)
    p.add_argument("--schema-concurrency", type=int, default=8)
    p.add_argument("--base-s", type=float, default=15.0, help="seconds of the phase without schemas")
    p.add_argument("--rounds", type=int, default=4, help="rounds of none / cold / cached (0: skip the compile part)")
    p.add_argument("--solo", type=int, default=10, help="schemas timed alone, new then cached")
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--answers", type=Path, default=None, help="write every answer here, one JSON line each")
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


def report(args: argparse.Namespace, res: dict[str, Any], load: tuple[float, float], details: str) -> dict[str, Any]:
    parts, result = [], {"bench": "structured_validity", "model": args.model, "loadavg_max": max(load)}
    loads = [*load, *res.get("loads", []), *(p["load"] for p in res.get("compile", {}).get("phases", []))]
    result["loadavg_max"] = max(loads)
    host = (f"1-min load average {load[0]:.1f} before, {load[1]:.1f} after, at most {max(loads):.1f} between parts" +
            (": **the host was shared** with other work while this ran" if max(loads) > 1.0 else ""))  # fmt: skip
    head = f"`python benchmarks/structured_validity.py` ({args.model}, {details}; {machine_line()}; {host}):"
    parts.append(head)
    failures: list[dict[str, str]] = []
    if "validity" in res:
        tallies: dict[str, Tally] = res["validity"]
        rows = [[n, SCHEMAS[n]["shape"], t.valid, t.invalid, t.cut, t.errors, round(statistics.fmean(t.tokens)) if t.tokens else 0]
                for n, t in tallies.items()]  # fmt: skip
        tot = {k: sum(getattr(t, k) for t in tallies.values()) for k in ("valid", "invalid", "cut", "errors")}
        finished = tot["valid"] + tot["invalid"]
        rows.append(["**all**", f"{len(tallies)} schemas", tot["valid"], tot["invalid"], tot["cut"], tot["errors"], ""])
        table = markdown_table(["schema", "shape", "valid", "invalid", "cut (length)", "errors", "mean tokens"], rows)
        print(table)
        parts.append(
            f"**Validity**: {sum(tot.values())} answers ({args.per_schema} per schema), temperature {args.temperature}, "
            f"max_tokens {args.max_tokens}, {args.concurrency} in flight, `response_format: json_schema` with the official "
            f"`openai` client, {res['validity_s']:.0f} s; each finished answer checked with `jsonschema` Draft 2020-12 "
            f"with its FormatChecker (formats asserted). **{tot['valid']} of {finished} finished answers valid**"
            f" ({tot['invalid']} invalid); {tot['cut']} cut by max_tokens, counted apart; {tot['errors']} HTTP errors.\n\n{table}")
        result.update({f"validity_{k}": v for k, v in tot.items()})
        for t in tallies.values():
            failures += t.failures
    if "tools" in res:
        t = res["tools"]
        row = [["tools (3 functions, tool_choice required)", t.valid, t.invalid, t.cut, t.errors,
                round(statistics.fmean(t.tokens)) if t.tokens else 0]]  # fmt: skip
        table = markdown_table(["tool calls", "valid", "invalid", "cut (length)", "errors", "mean tokens"], row)
        print(table)
        parts.append(f"**Tool calls**: {args.tool_answers} answers, `tool_choice: \"required\"`, the same sampling; an "
                     "answer is valid when it holds at least one call, finish_reason is `tool_calls` and every call's "
                     f"arguments match its function's `parameters` ({res['tools_s']:.0f} s).\n\n{table}")  # fmt: skip
        result.update({f"tools_{k}": v for k, v in t.as_row().items()})
        failures += t.failures
    if failures:
        lines = [f"- `{f['schema']}`: {f['why']} (finish_reason {f['finish_reason']}): `{f['answer'][:400]}`" for f in failures[:20]]
        print("INVALID ANSWERS:\n" + "\n".join(lines))
        parts.append("Invalid answers (first 20):\n\n" + "\n".join(lines))
    result["failures"] = failures[:20]
    if "compile" in res:
        c = res["compile"]
        pool = c["pooled"]
        rows = [[p["round"], p["kind"], p["n"], p["p50_ms"], p["p95_ms"], p["seconds"], p["compiles"], p["cache_hits"],
                 p["stream_errors"] + p["schema_errors"], p["load"]] for p in c["phases"]]  # fmt: skip
        table = markdown_table(["round", "with", "streams", "TTFT p50 ms", "TTFT p95 ms", "phase s", "engine compiles",
                                "cache hits", "errors", "load avg"], rows)  # fmt: skip
        by_round = {(p["round"], p["kind"]): p["p50_ms"] for p in c["phases"]}
        per_round = [by_round[(r, "cold")] / by_round[(r, "cached")] for r in range(args.rounds)]
        print(table)
        ratio = {k: pool[k]["p50_ms"] / pool["none"]["p50_ms"] for k in ("cold", "cached")}
        ratio95 = {k: pool[k]["p95_ms"] / pool["none"]["p95_ms"] for k in ("cold", "cached")}
        met = ratio["cold"] <= 1.10
        pooled_rows = [[k, pool[k]["n"], pool[k]["p50_ms"], pool[k]["p95_ms"], ratio.get(k, 1.0), ratio95.get(k, 1.0)]
                       for k in ("none", "cold", "cached")]  # fmt: skip
        ptable = markdown_table(["with", "streams", "TTFT p50 ms", "TTFT p95 ms", "p50 ratio to none", "p95 ratio to none"], pooled_rows)
        print(ptable)
        parts.append(
            f"**Compile under load**: {args.stream_concurrency} unconstrained streams (max_tokens 16) in a closed loop, "
            f"alone for {args.base_s:.0f} s (\"none\"), while {args.new_schemas} new schemas are sent, {args.schema_concurrency} "
            f"in flight, max_tokens 8, each with a property of its own so that each compiles cold (\"cold\"), and while "
            f"{args.new_schemas} requests of one schema compiled already are sent the same way (\"cached\": the same "
            f"extra requests without the compiles); {args.rounds} interleaved rounds, the TTFTs of the streams started "
            f"while the schema requests were being sent. Target (TTFT within 10% of its value without the compiles, p50 of "
            f"cold over none): **{'met' if met else 'NOT met'}** ({ratio['cold']:.2f}; cold over cached "
            f"{pool['cold']['p50_ms'] / pool['cached']['p50_ms']:.2f}, per round "
            f"{', '.join(f'{x:.2f}' for x in per_round)}).\n\n{ptable}\n\nPer phase:\n\n{table}\n\n"
            f"Compile time: the engine's `sluice_structured_compile_seconds` over the cold phases: "
            f"{c['engine_compile_mean_ms']:.2f} ms per schema on average ({c['engine_compiles']:.0f} compiles). "
            f"One request alone, max_tokens 8, TTFT with a new schema (the API's validation and the engine's compile) "
            f"{c['solo_cold_ttft_p50_ms']:.1f} ms, with the same schema again (both cached) {c['solo_cached_ttft_p50_ms']:.1f} ms "
            f"(medians of {args.solo}).")  # fmt: skip
        result.update({"ttft_none_p50_ms": pool["none"]["p50_ms"], "ttft_none_p95_ms": pool["none"]["p95_ms"],
                       "ttft_cold_p50_ms": pool["cold"]["p50_ms"], "ttft_cold_p95_ms": pool["cold"]["p95_ms"],
                       "ttft_cached_p50_ms": pool["cached"]["p50_ms"], "ttft_cached_p95_ms": pool["cached"]["p95_ms"],
                       "ttft_ratio_cold_p50": ratio["cold"], "ttft_ratio_cold_p95": ratio95["cold"],
                       "ttft_ratio_cached_p50": ratio["cached"], "compile_target_met": met,
                       "ttft_ratio_cold_to_cached_p50": pool["cold"]["p50_ms"] / pool["cached"]["p50_ms"],
                       "ttft_ratio_cold_to_cached_p50_per_round": per_round,
                       "engine_compile_mean_ms": c["engine_compile_mean_ms"],
                       "solo_cold_ttft_p50_ms": c["solo_cold_ttft_p50_ms"],
                       "solo_cached_ttft_p50_ms": c["solo_cached_ttft_p50_ms"]})  # fmt: skip
    result["body"] = "\n\n".join(parts)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    # SIGTERM unwinds like Ctrl-C, so the finally below stops the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = start_server(args)
    try:
        res = asyncio.run(run_all(args, server.url, server.model))
    finally:
        server.stop()
    if args.answers:
        tallies = [*res.get("validity", {}).values(), *([res["tools"]] if "tools" in res else [])]
        args.answers.write_text("".join(json.dumps(a) + "\n" for t in tallies for a in t.answers))
    result = report(args, res, (load_before, os.getloadavg()[0]), server.details)
    body = result.pop("body")
    if not args.no_write:
        write_section("structured_validity", "## Benchmarks: validity and compile under load\n\n" + body, DOC)
    print_json_last(result)
    return result


if __name__ == "__main__":
    main()
