"""TTFT targets per class: ``--slo p0=0.5s,p1=2s,p2=5s`` (or ``slo:`` in the config file), pure.

    SloTargets.parse("p0=0.5s,p1=2s")     # p2 keeps its default
    SloTargets.parse("p0=300ms")          # units: s, ms; a bare number is seconds

NOTE(auto-slo): a class given no target gets ``max(floor, multiple x the request's unloaded TTFT)``
(``AUTO_FLOORS``, ``AUTO_MULTIPLES``), the unloaded TTFT from the engine's measured step time: P0 is
held to a few times what an idle engine does for that very prompt (the engine bounds its steps to
match, NOTE(row-cap)), and a long prompt on a slow machine is not refused for a target no idle engine
could meet.  A derived target binds only while another class is active beside the request's
(NOTE(lone-class) in ``sluice.server.admission``).  The prediction it is held against is the
scheduler's model of itself, ``sluice.engine.ttft_model``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sluice.types import Priority

__all__ = ["SloTargets", "AUTO_FLOORS", "AUTO_MULTIPLES"]

AUTO_FLOORS = (0.1, 2.0, 5.0)  # seconds, P0 / P1 / P2
AUTO_MULTIPLES = (4.0, 10.0, 25.0)  # x the request's unloaded TTFT
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


def _parse_seconds(text: str) -> float:
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"invalid duration {text!r}: expected e.g. 0.5s, 500ms or 2")
    value = float(m.group(1)) / (1000.0 if m.group(2) == "ms" else 1.0)
    if value <= 0.0:
        raise ValueError(f"a TTFT target must be > 0, got {text!r}")
    return value


@dataclass(frozen=True)
class SloTargets:
    """TTFT target per class, in seconds; ``None``: derived from the unloaded TTFT (NOTE(auto-slo))."""

    seconds: tuple[float | None, float | None, float | None] = (None, None, None)

    @classmethod
    def parse(cls, text: str | None) -> SloTargets:
        if text is None or not text.strip() or text.strip() == "auto":
            return cls()
        values: list[float | None] = [None, None, None]
        for part in text.split(","):
            if not part.strip():
                continue
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"invalid SLO entry {part.strip()!r}: expected CLASS=SECONDS, e.g. p0=0.5s")
            try:
                p = Priority[name.strip().upper()]
            except KeyError:
                raise ValueError(f"unknown class {name.strip()!r} in the SLO: use p0, p1, p2") from None
            values[p] = _parse_seconds(value)
        return cls((values[0], values[1], values[2]))

    def target(self, priority: int, unloaded: float) -> float:
        """The class's TTFT target for a request whose unloaded TTFT is ``unloaded`` seconds."""
        explicit = self.seconds[priority]
        if explicit is not None:
            return explicit
        return max(AUTO_FLOORS[priority], AUTO_MULTIPLES[priority] * unloaded)

    def describe(self) -> str:
        return ",".join(f"p{p}={'auto' if s is None else f'{s:g}s'}" for p, s in enumerate(self.seconds))
