"""Helpers shared by the benchmark scripts: write one section of docs/benchmarks.md.

Each benchmark owns one section, delimited by HTML comments, so scripts run in
any order (and by different people) never clobber each other's tables::

    <!-- BEGIN offline_throughput -->
    ...
    <!-- END offline_throughput -->

The file is rewritten atomically (temp file + rename): never half-written.
"""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
import time
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEvery table here is written by a script under `benchmarks/`; rerun it to refresh its section.\n"


def machine_line() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"measured {time.strftime('%Y-%m-%d %H:%M')}"
    )


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(name: str, body: str, doc: Path = DOC) -> None:
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else HEADER
    block = f"<!-- BEGIN {name} -->\n{body.rstrip()}\n<!-- END {name} -->"
    pat = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S)
    text = pat.sub(lambda _: block, text) if pat.search(text) else text.rstrip() + "\n\n" + block + "\n"
    fd, tmp = tempfile.mkstemp(dir=doc.parent, prefix=".benchmarks.", suffix=".md")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, doc)


def print_json_last(result: dict) -> None:
    """A benchmark's last stdout line is one JSON document."""
    print(json.dumps(result, sort_keys=True), flush=True)
