"""Small shared vocabulary used by every layer (torch-free).

Priority classes are ordered: P0 is the most urgent.  The integer value is the
class index used everywhere (engine queues, metrics labels via ``.label``).
"""

from __future__ import annotations

import enum

__all__ = ["Priority", "parse_priority", "PRIORITY_WEIGHTS"]


class Priority(enum.IntEnum):
    P0 = 0
    P1 = 1
    P2 = 2

    @property
    def label(self) -> str:
        return f"p{int(self)}"


# NOTE(wfq): weighted fair queuing shares, P0:P1:P2 = 5:3:1 (DESIGN.md).
PRIORITY_WEIGHTS: dict[Priority, float] = {Priority.P0: 5.0, Priority.P1: 3.0, Priority.P2: 1.0}


def parse_priority(value: str | int | Priority | None, default: Priority = Priority.P1) -> Priority:
    """Parse ``p0``/``P1``/``2``/``Priority.P2``; ``None`` gives the default.

    Raises ``ValueError`` with a readable message for anything else.
    """
    if value is None:
        return default
    if isinstance(value, Priority):
        return value
    if isinstance(value, bool):
        raise ValueError(f"invalid priority {value!r}: expected p0, p1 or p2")
    if isinstance(value, int):
        if value in (0, 1, 2):
            return Priority(value)
        raise ValueError(f"invalid priority {value!r}: expected p0, p1 or p2")
    text = str(value).strip().lower()
    if text.startswith("p"):
        text = text[1:]
    if text in ("0", "1", "2"):
        return Priority(int(text))
    raise ValueError(f"invalid priority {value!r}: expected p0, p1 or p2")
