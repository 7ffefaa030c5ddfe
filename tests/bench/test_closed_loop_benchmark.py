"""``benchmarks/closed_loop.py``'s verdict (issue 57's target), without starting a server."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import closed_loop  # noqa: E402


def _level(c: int, requests: int, errors: int, tok_s: float) -> dict[str, Any]:
    return {"concurrency": c, "requests": requests, "errors": errors, "num_429": errors, "error_rate": errors / requests,
            "output_tok_per_s": tok_s, "ttft_p50_s": 1.0, "ttft_p95_s": 2.0, "steal_share": None, "load_avg_1m": 1.0}  # fmt: skip


def _results(default: list[dict[str, Any]]) -> dict[str, Any]:
    off = [_level(32, 128, 0, 350.0), _level(128, 512, 0, 400.0)]
    return {"machine": "m", "command": "python benchmarks/closed_loop.py", "requests_per_stream": 4,
            "skipped": {"vLLM-CPU": "not installed"},
            "systems": {"default": {"name": "sluice (default flags)", "levels": default},
                        "off": {"name": "sluice --slo off", "levels": off}}}  # fmt: skip


def test_the_target_needs_few_errors_and_the_throughput_of_slo_off_at_every_level() -> None:
    body, met = closed_loop.render(_results([_level(32, 128, 0, 340.0), _level(128, 512, 1, 390.0)]))
    assert met, "0.2% errors and 0.97x / 0.975x --slo off's tok/s meet the target"
    assert "**met**" in body and "vLLM-CPU: not run (not installed)" in body
    _, met = closed_loop.render(_results([_level(32, 128, 0, 340.0), _level(128, 512, 2, 390.0)]))
    assert not met, "0.4% errors at c=128 is over 0.3%"
    _, met = closed_loop.render(_results([_level(32, 128, 0, 320.0), _level(128, 512, 0, 390.0)]))
    assert not met, "0.91x --slo off's tok/s at c=32 is under 0.95x"
