"""What the bench measures for one request (``RequestRecord``), and its CSV form.

Times are seconds.  ``start_s``/``end_s`` are relative to the start of the run
(``time.perf_counter()`` based), so records of one run share one time axis.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RequestRecord", "CSV_COLUMNS", "write_csv"]


@dataclass
class RequestRecord:
    index: int  # RequestSpec.index
    priority: str  # "p0" / "p1" / "p2"
    start_s: float  # when the request was sent, seconds after the run start
    end_s: float = 0.0  # when the last byte (or the error) arrived
    ttft_s: float | None = None  # first content token - start
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    num_input_tokens: int = 0  # usage.prompt_tokens, else the intended length
    num_output_tokens: int = 0  # usage.completion_tokens, else content chunks seen
    status: int = 0  # HTTP status; 0 when no response came
    error: str = ""  # "" when ok; else a one-line reason
    prefix_group: int | None = None
    phase: int = 0  # sweep step (0 for a single run)

    @property
    def is_ok(self) -> bool:
        return not self.error

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (vLLM's definition)."""
        if self.ttft_s is None or self.num_output_tokens < 2 or not self.is_ok:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


CSV_COLUMNS = [
    "index", "phase", "priority", "prefix_group", "start_s", "end_s", "ttft_s", "tpot_s",
    "e2e_s", "itl_mean_s", "itl_max_s", "num_input_tokens", "num_output_tokens", "status",
    "error",
]  # fmt: skip


def _f(x: float | None) -> str:
    return "" if x is None else f"{x:.6f}"


def write_csv(records: Iterable[RequestRecord], path: Path) -> None:
    """One row per request; empty cells where a value does not exist (no TTFT on error)."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in records:
            itl_mean = sum(r.itl_s) / len(r.itl_s) if r.itl_s else None
            w.writerow(
                [
                    r.index, r.phase, r.priority,
                    "" if r.prefix_group is None else r.prefix_group,
                    _f(r.start_s), _f(r.end_s), _f(r.ttft_s), _f(r.tpot_s), _f(r.e2e_s),
                    _f(itl_mean), _f(max(r.itl_s) if r.itl_s else None),
                    r.num_input_tokens, r.num_output_tokens, r.status, r.error,
                ]
            )  # fmt: skip
