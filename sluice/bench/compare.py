"""``sluice bench compare A.json B.json``: two runs side by side, with ratios (pure).

Each row is one figure of the two ``summary.json`` documents (for a sweep, the
sustainable step).  ``ratio`` is B / A.  With ``max_regression`` (e.g. 0.1), a
row *regresses* when B is worse than A by more than that fraction: a latency
or error rate higher, a rate lower.  Release gates exit non-zero on any.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CompareRow", "compare_docs", "load_doc"]

# (label, path in the summary, True when higher is better)
_ROWS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("req/s", ("rps",), True),
    ("output tok/s", ("output_tok_s",), True),
    ("goodput req/s", ("goodput_rps",), True),
    ("error rate", ("error_rate",), False),
    ("TTFT p50 ms", ("ttft_ms", "p50"), False),
    ("TTFT p95 ms", ("ttft_ms", "p95"), False),
    ("TTFT p99 ms", ("ttft_ms", "p99"), False),
    ("TPOT p50 ms", ("tpot_ms", "p50"), False),
    ("TPOT p95 ms", ("tpot_ms", "p95"), False),
    ("ITL p95 ms", ("itl_ms", "p95"), False),
    ("E2E p50 ms", ("e2e_ms", "p50"), False),
    ("E2E p95 ms", ("e2e_ms", "p95"), False),
    ("E2E p99 ms", ("e2e_ms", "p99"), False),
)


@dataclass(frozen=True)
class CompareRow:
    label: str
    a: float | None
    b: float | None
    ratio: float | None  # b / a; None when either is missing or a is 0
    is_higher_better: bool
    is_regression: bool

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.label, "a": self.a, "b": self.b, "ratio": self.ratio, "regression": self.is_regression}  # fmt: skip


def load_doc(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{p}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not a JSON document ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("summary"), dict):
        raise ValueError(f"{p}: not a sluice bench summary.json (no 'summary' object)")
    return doc


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    v: Any = summary
    for k in path:
        if not isinstance(v, dict) or v.get(k) is None:
            return None
        v = v[k]
    return float(v)


def compare_docs(a: dict[str, Any], b: dict[str, Any], max_regression: float | None = None) -> list[CompareRow]:
    rows = []
    for label, path, higher in _ROWS:
        va, vb = _get(a["summary"], path), _get(b["summary"], path)
        ratio = vb / va if va and vb is not None else None
        worse = False
        if max_regression is not None and va is not None and vb is not None:
            if higher:
                worse = vb < va * (1 - max_regression)
            else:
                # an error rate going from 0 to anything is a regression
                worse = vb > va * (1 + max_regression) and vb - va > 1e-12
        rows.append(CompareRow(label, va, vb, ratio, higher, worse))
    return rows
