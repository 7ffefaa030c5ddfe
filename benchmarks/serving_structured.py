"""Structured outputs over HTTP: ``sluice serve`` side by side with llama.cpp's llama-server, same GGUF.

    python benchmarks/serving_structured.py --peer llama                 # SmolLM2 Q4_1, c=1 and c=8
    python benchmarks/serving_structured.py --levels 1 --requests 2 --no-write   # smoke: sluice alone
    python benchmarks/serving_structured.py --peer-url http://127.0.0.1:8080 --peer-name vllm-cpu  # a server already up

Workload: ``/v1/chat/completions`` with ``response_format: {"type": "json_schema"}`` of
``benchmarks/structured.py``'s ``PERSON`` schema (name, age, optional email), a distinct
prompt per request, temperature 0, ``max_tokens`` 64 (the answer ends when the
grammar does: no ``ignore_eos``), closed loop at each level.  Per server and
level: the share of answers that parse and validate against the schema
(``jsonschema``), the share cut by ``max_tokens``, req/s, output tok/s (completion
tokens of all requests over the level's wall time) and the mean completion length
(llama-server pretty-prints the JSON, so its answers are longer: compare req/s).

Prints the table, writes it to the ``structured_serving`` section of
docs/structured_outputs.md (unless ``--no-write``) and prints one JSON line
last.  Only 127.0.0.1 is contacted; every process started here is stopped here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks._report import machine_line, markdown_table, print_json_last, write_section  # noqa: E402
from benchmarks.serving_procs import Server, start_llama, start_sluice  # noqa: E402
from benchmarks.structured import PERSON  # noqa: E402

DOC = ROOT / "docs" / "structured_outputs.md"
NAMES = ["Ada", "Bob", "Chen", "Dana", "Emil", "Fatima", "Goro", "Hana", "Ivan", "Jade", "Kofi", "Lena",
         "Milo", "Nora", "Omar", "Pia"]  # fmt: skip


def prompt(i: int) -> str:
    name = NAMES[i % len(NAMES)]
    return f"Describe a person called {name} {i}, aged {20 + i % 50}, as JSON with name, age and email."


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def one(client: Any, url: str, model: str, i: int, max_tokens: int) -> tuple[str, int, str]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt(i)}], "temperature": 0,
            "max_tokens": max_tokens,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}  # fmt: skip
    r = await client.post(url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    data = r.json()
    choice = data["choices"][0]
    return choice["message"]["content"] or "", int(data["usage"]["completion_tokens"]), choice["finish_reason"]


async def level(url: str, model: str, c: int, n: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    todo = list(range(n))
    results: list[tuple[str, int, str]] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while todo:
            results.append(await one(client, url, model, todo.pop(0), max_tokens))

    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, url, model, 10_000, max_tokens)  # warm-up (first grammar compile, first step)
        t0 = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(c)))
        wall = time.monotonic() - t0
    tokens = sum(r[1] for r in results)
    return {"concurrency": c, "requests": n, "valid": sum(valid(r[0]) for r in results) / n,
            "cut": sum(r[2] == "length" for r in results) / n, "tok_s": tokens / wall,
            "mean_tokens": tokens / n, "wall_s": wall, "sample": results[0][0][:120]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="what sluice serves (llama-server: the same GGUF)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=2, help="requests per level = this x concurrency (min 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--peer", choices=["llama"], default=None, help="start llama-server on the same GGUF")
    ap.add_argument("--peer-url", default=None, help="an OpenAI-compatible server already running (127.0.0.1)")
    ap.add_argument("--peer-name", default="peer")
    ap.add_argument("--no-sluice", action="store_true")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    # what serving_procs' starters read
    args.llama_gguf, args.llama_slots, args.llama_port, args.num_threads, args.kv_cache_memory = None, 8, 0, None, None

    rows: list[list[object]] = []
    out: dict[str, Any] = {"machine": machine_line(), "servers": {}}

    def run(name: str, url: str, model: str, details: str) -> None:
        out["servers"][name] = {"details": details, "levels": []}
        for c in args.levels:
            r = asyncio.run(level(url, model, c, max(4, args.requests * c), args.max_tokens))
            out["servers"][name]["levels"].append(r)
            rows.append([name, c, r["requests"], f"{r['valid']:.0%}", f"{r['cut']:.0%}", f"{r['requests'] / r['wall_s']:.2f}",
                         f"{r['tok_s']:.1f}", f"{r['mean_tokens']:.1f}"])  # fmt: skip
            print(f"{name} c={c}: {r}", file=sys.stderr)

    starters = [] if args.no_sluice else [("sluice", lambda: start_sluice(args))]
    if args.peer == "llama":
        starters.append(("llama-server", lambda: start_llama(args)))
    for name, start in starters:
        srv: Server = start()
        try:
            run(name, srv.url, srv.model, srv.details)
        finally:
            srv.stop()
    if args.peer_url:
        import httpx

        model = httpx.get(args.peer_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        run(args.peer_name, args.peer_url, model, args.peer_url)

    # llama-server pretty-prints its JSON (newlines, indents: ~40% more tokens), so req/s compares the work done
    headers = ["server", "concurrency", "requests", "valid JSON (schema)", "cut at max_tokens", "req/s", "output tok/s",
               "mean tokens"]  # fmt: skip
    table = markdown_table(headers, rows)
    print(table)
    if not args.no_write:
        details = "\n".join(f"- {k}: {v['details']}" for k, v in out["servers"].items())
        cmd = "python benchmarks/serving_structured.py " + " ".join(sys.argv[1:])
        write_section("structured_serving", f"{out['machine']}\n\n`{cmd}`\n\n{details}\n\n{table}", DOC)
    print_json_last(out)


if __name__ == "__main__":
    main()
