"""What the server itself counted during a phase: its ``/metrics`` read before and after.

Today that is speculative decoding (issue 55): a sluice server exports
``sluice_spec_*`` counters (DESIGN.md's metric names, ``sluice/server/telemetry.py``)
and the bench reports, per phase, the tokens drafted, kept and emitted, the
acceptance rate by proposer, the mean kept run and the k the policy chose::

    before = await scrape(session, url, api_key)
    ... the phase ...
    after = await scrape(session, url, api_key)
    speculation_report(before, after)   # None: no speculation counters (off, or not sluice)

NOTE(server-counters): best effort.  Any OpenAI-compatible endpoint may be
benched, and most have no ``/metrics`` or other names; a failed read, a
missing family or a counter that went down (the server restarted mid-phase)
gives no report, never an error.  Counters are cumulative for the server's
life, so a phase's figures are the difference; other clients' requests in
the same window are counted too (the report says whose counters they are).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Samples", "parse_metrics", "scrape", "speculation_report"]

# (sample name, sorted label pairs) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

_SPEC = "sluice_spec_"
_PER_METHOD = {  # report key -> counter sample (labelled by method)
    "drafted": "sluice_spec_drafted_tokens_total",
    "accepted": "sluice_spec_accepted_tokens_total",
    "emitted": "sluice_spec_emitted_tokens_total",
    "verify_runs": "sluice_spec_verify_runs_total",
}
_K_CHOSEN = "sluice_spec_k_chosen_total"


def parse_metrics(text: str) -> Samples:
    """Prometheus text -> samples (the ``sluice_spec_*`` ones; others are not needed)."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(_SPEC):
            continue
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


async def scrape(session: aiohttp.ClientSession, url: str, api_key: str | None = None,
                 timeout_s: float = 5.0) -> Samples | None:  # fmt: skip
    """``GET {url}/metrics`` parsed, or None when it cannot be read (NOTE(server-counters))."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(url.rstrip("/") + "/metrics", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:  # fmt: skip
            if resp.status != 200:
                return None
            text = await resp.text()
        return parse_metrics(text)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError, IndexError, KeyError):
        return None  # unreachable, or text the Prometheus parser refuses


def _by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels).get(label, ""): v for (n, labels), v in samples.items() if n == name}


def speculation_report(before: Samples | None, after: Samples | None) -> dict[str, Any] | None:
    """The phase's speculation figures, or None (no counters, nothing drafted, or a counter reset).

    ``{"drafted", "accepted", "emitted", "verify_runs", "acceptance_rate", "mean_accepted_len",
    "by_method": {method: the same five counts and the rate}, "k_chosen": {k: times}, "mean_k"}``
    """
    if before is None or after is None:
        return None
    by_method: dict[str, dict[str, float]] = {}
    for key, name in _PER_METHOD.items():
        b, a = _by_label(before, name, "method"), _by_label(after, name, "method")
        for method, v in a.items():
            d = v - b.get(method, 0.0)
            if d < 0:
                return None  # the server restarted: these are not this phase's counts
            by_method.setdefault(method, {})[key] = d
    kb, ka = _by_label(before, _K_CHOSEN, "k"), _by_label(after, _K_CHOSEN, "k")
    k_chosen: dict[int, float] = {}
    for k, v in ka.items():
        d = v - kb.get(k, 0.0)
        if d < 0:
            return None
        if k.isdigit() and d:
            k_chosen[int(k)] = d
    if not by_method and not k_chosen:
        return None
    for m in by_method.values():
        m["acceptance_rate"] = m.get("accepted", 0.0) / m["drafted"] if m.get("drafted") else 0.0
    total = {key: sum(m.get(key, 0.0) for m in by_method.values()) for key in _PER_METHOD}
    planned = sum(k_chosen.values())
    return {
        **{k: int(v) for k, v in total.items()},
        "acceptance_rate": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
        "mean_accepted_len": total["accepted"] / total["verify_runs"] if total["verify_runs"] else 0.0,
        "by_method": by_method,
        "k_chosen": {str(k): int(v) for k, v in sorted(k_chosen.items())},
        "mean_k": sum(k * n for k, n in k_chosen.items()) / planned if planned else 0.0,
    }
