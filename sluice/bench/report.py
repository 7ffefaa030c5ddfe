"""The run document (``summary.json``, the final JSON line) and its human forms.

    phase_document(result, contract)  -> {"load", "summary", "targets", "passed", ...}
    memory_report(records, memory)    -> KV memory per request (the ``cost`` preset)
    print_report(doc, console)        -> rich tables: figures, per class, contract
    write_outputs(out_dir, doc, records) -> requests.csv, summary.json, *.png

``passed`` is ``None`` when no contract was given.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from sluice.bench.contract import Contract, evaluate
from sluice.bench.record import RequestRecord, write_csv
from sluice.bench.runner import PhaseResult
from sluice.bench.summary import summarize

__all__ = ["phase_document", "memory_report", "print_report", "speculation_line", "write_outputs", "fmt"]


def phase_document(result: PhaseResult, contract: Contract | None) -> dict[str, Any]:
    summary = summarize(result.records, slo=contract.request_slo() if contract else None)
    results = evaluate(contract, summary) if contract else []
    doc: dict[str, Any] = {
        "load": result.load.to_dict(),
        "num_cancelled": result.num_cancelled,
        "is_interrupted": result.is_interrupted,
        "wall_s": result.wall_s,
        "summary": summary,
        "targets": [r.to_dict() for r in results],
        "passed": all(r.passed for r in results) if contract else None,
    }
    if contract and contract.memory:
        doc["memory"] = memory_report(result.records, contract.memory)
    return doc


def memory_report(records: Sequence[RequestRecord], memory: dict[str, Any]) -> dict[str, Any] | None:
    """KV-cache memory each successful request held at its end.

    NOTE(kv-memory): a request holds ceil(tokens / block_size) blocks (DESIGN.md);
    bytes = blocks x block_size x kv_bytes_per_token (layers x kv heads x head dim
    x 2 (K and V) x bytes per element).  Measured token counts, estimated bytes.
    """
    ok = [r for r in records if r.is_ok]
    if not ok:
        return None
    bs = int(memory.get("block_size", 16))
    per_tok = float(memory.get("kv_bytes_per_token", 0))
    blocks = np.array([math.ceil((r.num_input_tokens + r.num_output_tokens) / bs) for r in ok], dtype=float)  # fmt: skip
    mib = blocks * bs * per_tok / 2**20
    return {
        "block_size": bs,
        "kv_bytes_per_token": per_tok,
        "blocks_per_request": {"mean": float(blocks.mean()), "p95": float(np.percentile(blocks, 95)), "max": float(blocks.max())},  # fmt: skip
        "kv_mib_per_request": {"mean": float(mib.mean()), "p95": float(np.percentile(mib, 95)), "max": float(mib.max())},  # fmt: skip
    }


def fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != 0 and abs(v) < 0.01:
            return f"{v:.2g}"
        return f"{v:,.{digits}f}"
    return str(v)


_LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def _latency_table(summary: dict[str, Any], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("ms", "p50", "p90", "p95", "p99", "max", "mean"):
        t.add_column(col, justify="right" if col != "ms" else "left")
    for name, key in _LATENCIES:
        b = summary.get(key)
        t.add_row(name, *(fmt(b[s]) if b else "-" for s in ("p50", "p90", "p95", "p99", "max", "mean")))
    return t


def _p95(summary: dict[str, Any], key: str) -> str:
    return fmt(summary[key]["p95"]) if summary.get(key) else "-"


def _class_table(summary: dict[str, Any]) -> Table:
    t = Table(title="Per priority class", title_justify="left")
    for col in ("class", "requests", "errors", "req/s", "out tok/s", "goodput/s", "TTFT p95", "E2E p95"):  # fmt: skip
        t.add_column(col, justify="right")
    rows = [("all", summary)] + sorted(summary.get("by_priority", {}).items())
    for name, s in rows:
        t.add_row(name, str(s["num_requests"]), str(s["num_errors"]), fmt(s["rps"]), fmt(s["output_tok_s"]), fmt(s["goodput_rps"]), _p95(s, "ttft_ms"), _p95(s, "e2e_ms"))  # fmt: skip
    return t


def _targets_table(targets: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("target", "limit", "measured", "result"):
        t.add_column(col, justify="left" if col == "target" else "right")
    for r in targets:
        verdict = "[green]PASS[/]" if r["passed"] else "[red]FAIL[/]"
        t.add_row(r["target"], f"{r['op']} {fmt(r['threshold'], 3)}", fmt(r["measured"], 3), verdict)
    return t


def speculation_line(spec: dict[str, Any]) -> str:
    """One line of the server's speculation counters over a phase (``server_metrics.speculation_report``)."""
    methods = ", ".join(f"{m} {fmt(100 * v['acceptance_rate'])}%" for m, v in sorted(spec["by_method"].items()) if v.get("drafted"))
    return (
        f"  speculation (the server's counters): {spec['drafted']:,} drafted, {spec['accepted']:,} accepted "
        f"({fmt(100 * spec['acceptance_rate'])}%{'; ' + methods if len(spec['by_method']) > 1 else ''}), "
        f"{spec['emitted']:,} emitted by verifying steps, mean kept run {fmt(spec['mean_accepted_len'], 2)}, "
        f"mean k {fmt(spec['mean_k'], 2)}"
    )


def print_report(doc: dict[str, Any], console: Console) -> None:
    """Human tables for a run or a sweep (stdout); the JSON line is printed by the caller."""
    for i, ph in enumerate(doc.get("phases", [doc])):
        s = ph["summary"]
        head = f"{doc.get('kind', 'run')} phase {i}: " if "phases" in doc else ""
        console.print(
            f"[bold]{head}{ph['load']['mode']} load {fmt(ph['load']['level'])}[/]: "
            f"{s['num_requests']} requests, {s['num_errors']} errors ({s['error_rate']:.2%}), "
            f"{fmt(s['rps'])} req/s, {fmt(s['output_tok_s'])} output tok/s over {fmt(s['duration_s'])} s"
            + (f", {ph['num_cancelled']} cancelled" if ph["num_cancelled"] else "")
        )
        if "phases" not in doc:
            console.print(_latency_table(s, "Latency (ms, successful requests)"))
            if len(s.get("by_priority", {})) > 1:
                console.print(_class_table(s))
            for reason, n in s["errors"].items():
                console.print(f"  error x{n}: {reason}")
        if ph.get("speculation"):
            console.print(speculation_line(ph["speculation"]))
        if ph["targets"]:
            verdict = "[green]holds[/]" if ph["passed"] else "[red]fails[/]"
            console.print(_targets_table(ph["targets"], f"Contract {doc.get('contract')}: {verdict}"))
    if doc.get("memory"):
        m = doc["memory"]
        console.print(
            f"KV memory per request: {fmt(m['blocks_per_request']['mean'])} blocks mean, "
            f"{fmt(m['kv_mib_per_request']['mean'], 2)} MiB mean, {fmt(m['kv_mib_per_request']['p95'], 2)} MiB p95"
        )
    for k, v in (doc.get("settings") or {}).items():
        console.print(f"  setting {k}: {v}")
    if "sustainable" in doc:
        best = doc["sustainable"]
        console.print(
            "[bold]Sustainable load[/]: "
            + (f"{best['mode']} {fmt(best['level'])} ({fmt(best['rps'])} req/s)" if best else "none: the contract failed at every step")  # fmt: skip
        )
    if doc.get("passed") is not None:
        console.print("[bold green]CONTRACT HOLDS[/]" if doc["passed"] else "[bold red]CONTRACT FAILS[/]")


def write_outputs(out_dir: Path, doc: dict[str, Any], records: Sequence[RequestRecord]) -> list[Path]:
    """requests.csv, summary.json and the plots; returns the paths written."""
    from sluice.bench import plots  # matplotlib costs ~0.5 s: only when writing files

    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(records, out_dir / "requests.csv")
    (out_dir / "summary.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    written = [out_dir / "requests.csv", out_dir / "summary.json"]
    written += plots.write_plots(out_dir, doc, records)
    return written
