"""Step sweeps: one phase per load level, to find the instance's sustainable load (pure).

The sweep goes up the levels in order and stops at the first failing step
after a passing one (the knee); steps that fail *before* any pass (a
``min_rps`` target a low rate cannot meet) do not stop it.  The sustainable
load is the highest passing level below the knee.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["parse_levels", "should_continue", "sustainable"]


def parse_levels(text: str, what: str) -> list[float]:
    """``"8,16,32"`` -> ``[8.0, 16.0, 32.0]``: ascending, positive, unique."""
    try:
        levels = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"invalid {what} {text!r}: expected numbers separated by commas") from None
    if not levels or any(not x > 0 for x in levels):
        raise ValueError(f"invalid {what} {text!r}: give one or more numbers > 0")
    if sorted(set(levels)) != levels:
        raise ValueError(f"invalid {what} {text!r}: levels must be increasing and unique")
    return levels


def should_continue(passed: Sequence[bool]) -> bool:
    """Keep sweeping unless a step failed after some step had passed."""
    return not (len(passed) >= 2 and not passed[-1] and any(passed[:-1]))


def sustainable(phases: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The highest passing phase before the knee, as ``{mode, level, rps, phase}``."""
    best = None
    seen_pass = False
    for i, ph in enumerate(phases):
        if ph["passed"]:
            seen_pass = True
            best = {"mode": ph["load"]["mode"], "level": ph["load"]["level"], "rps": ph["summary"]["rps"], "phase": i}  # fmt: skip
        elif seen_pass:
            break
    return best
