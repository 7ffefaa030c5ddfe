"""Aggregate ``RequestRecord`` s into the figures a report and a contract read.

``summarize`` is pure: records + the measured window in, a JSON-ready dict out::

    {"num_requests", "num_ok", "num_errors", "error_rate", "duration_s", "rps",
     "output_tok_s", "goodput_rps", "goodput_ratio", "mean_input_tokens",
     "mean_output_tokens", "ttft_ms": {...}, "tpot_ms": {...}, "itl_ms": {...},
     "e2e_ms": {...}, "errors": {reason: count},
     "by_priority": {"p0": {same keys, no by_priority}, ...}}

Latency blocks are ``{"count", "mean", "p50", "p90", "p95", "p99", "max"}`` in
milliseconds, ``None`` when no request produced the value.  Rates are per second
of the window (first send to last completion).  Only successful requests enter
latencies; errors enter ``error_rate`` and ``errors``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.bench.record import RequestRecord

__all__ = ["RequestSLO", "PERCENTILES", "latency_stats", "summarize", "window_s"]

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class RequestSLO:
    """Per-request limits for goodput (a request is good when ok and within all of them)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def is_good(self, r: RequestRecord) -> bool:
        if not r.is_ok:
            return False
        checks = ((self.ttft_ms, r.ttft_s), (self.tpot_ms, r.tpot_s), (self.e2e_ms, r.e2e_s))
        return all(lim is None or (v is not None and v * 1000 <= lim) for lim, v in checks)


def latency_stats(values_s: Sequence[float]) -> dict[str, float] | None:
    """Percentiles of seconds, reported in milliseconds."""
    if not values_s:
        return None
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"count": float(a.size), "mean": float(a.mean())}
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES), strict=True):
        out[f"p{p}"] = float(v)
    out["max"] = float(a.max())
    return out


def window_s(records: Sequence[RequestRecord]) -> float:
    """First send to last completion; 0 for no records."""
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.start_s for r in records)


def _error_reason(error: str) -> str:
    # NOTE(error-groups): group by the text before any detail a server may vary
    # (ids, byte offsets): "HTTP 500", "connection error: ClientPayloadError", ...
    head = error.split(":", 2)
    return ":".join(head[:2]).strip() if error.startswith(("HTTP", "connection")) else head[0]


def _summarize_class(records: Sequence[RequestRecord], duration_s: float, slo: RequestSLO) -> dict[str, Any]:
    ok = [r for r in records if r.is_ok]
    n, n_ok = len(records), len(ok)
    dur = duration_s if duration_s > 0 else math.inf  # no window: rates are 0, never NaN
    num_good = sum(1 for r in ok if slo.is_good(r))
    itl = [x for r in ok for x in r.itl_s]
    num_out = sum(r.num_output_tokens for r in ok)
    return {
        "num_requests": n,
        "num_ok": n_ok,
        "num_errors": n - n_ok,
        "error_rate": (n - n_ok) / n if n else 0.0,
        "duration_s": duration_s,
        "rps": n_ok / dur if n_ok else 0.0,
        "output_tok_s": num_out / dur if n_ok else 0.0,
        "goodput_rps": num_good / dur if num_good else 0.0,
        "goodput_ratio": num_good / n if n else 0.0,
        "mean_input_tokens": sum(r.num_input_tokens for r in ok) / n_ok if n_ok else 0.0,
        "mean_output_tokens": num_out / n_ok if n_ok else 0.0,
        "ttft_ms": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": latency_stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": latency_stats(itl),
        "e2e_ms": latency_stats([r.e2e_s for r in ok]),
        "errors": dict(Counter(_error_reason(r.error) for r in records if r.error).most_common()),
    }


def summarize(
    records: Sequence[RequestRecord], duration_s: float | None = None, slo: RequestSLO | None = None
) -> dict[str, Any]:
    """Overall figures plus the same per priority class present in the records."""
    dur = window_s(records) if duration_s is None else duration_s
    slo = slo or RequestSLO()
    out = _summarize_class(records, dur, slo)
    classes = sorted({r.priority for r in records})
    out["by_priority"] = {
        c: _summarize_class([r for r in records if r.priority == c], dur, slo) for c in classes
    }
    return out
