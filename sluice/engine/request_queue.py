"""Waiting-queue policies behind one small interface: ``fcfs``, ``priority``, ``wfq``.

The scheduler asks the queue which waiting request to admit next (``peek`` /
``pop``) and tells it how many prefill tokens each class received
(``charge``), which is what weighted fair queuing needs.

NOTE(wfq): each class keeps a virtual time that advances by
``tokens / weight`` whenever it is served; the backlogged class with the
smallest virtual time goes next, so with P0 and P1 both backlogged P1 receives
3/5 of P0's prefill tokens (weights 5:3:1).  A class that was idle re-enters at
the current virtual time (no banked credit).  Inside a class: FCFS, with
preempted requests put back at the front.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from sluice.engine.request import Request
from sluice.types import PRIORITY_WEIGHTS, Priority

__all__ = ["QueuePolicy", "RequestQueue", "make_request_queue"]


class QueuePolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"
    WFQ = "wfq"


class RequestQueue(ABC):
    @abstractmethod
    def add(self, req: Request) -> None: ...

    @abstractmethod
    def prepend(self, req: Request) -> None:
        """Put a preempted request back at the front of its class."""

    @abstractmethod
    def peek(self) -> Request | None: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, req: Request) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def charge(self, priority: Priority, num_tokens: int) -> None:  # noqa: B027 (optional hook)
        """Account prefill tokens served to a class (only WFQ uses it)."""

    def count_by_priority(self) -> list[int]:
        out = [0, 0, 0]
        for r in self:
            out[int(r.priority)] += 1
        return out


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request | None:
        return self._q[0] if self._q else None

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> bool:
        try:
            self._q.remove(req)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class _ClassQueues(RequestQueue):
    def __init__(self) -> None:
        self._qs: list[deque[Request]] = [deque() for _ in Priority]

    def add(self, req: Request) -> None:
        self._qs[req.priority].append(req)

    def prepend(self, req: Request) -> None:
        self._qs[req.priority].appendleft(req)

    @abstractmethod
    def _next_class(self) -> int | None: ...

    def peek(self) -> Request | None:
        c = self._next_class()
        return None if c is None else self._qs[c][0]

    def pop(self) -> Request:
        c = self._next_class()
        if c is None:
            raise IndexError("pop from an empty request queue")
        return self._qs[c].popleft()

    def remove(self, req: Request) -> bool:
        try:
            self._qs[req.priority].remove(req)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return sum(len(q) for q in self._qs)

    def __iter__(self) -> Iterator[Request]:
        for q in self._qs:
            yield from q


class PriorityQueue(_ClassQueues):
    """Strict priority: P0 before P1 before P2."""

    def _next_class(self) -> int | None:
        return next((c for c, q in enumerate(self._qs) if q), None)


class WFQQueue(_ClassQueues):
    def __init__(self, weights: dict[Priority, float] | None = None) -> None:
        super().__init__()
        self.weights = weights or PRIORITY_WEIGHTS
        self.vtime = [0.0 for _ in Priority]

    def _active_floor(self) -> float:
        active = [self.vtime[c] for c, q in enumerate(self._qs) if q]
        return min(active) if active else max(self.vtime)

    def add(self, req: Request) -> None:
        c = req.priority
        if not self._qs[c]:
            self.vtime[c] = max(self.vtime[c], self._active_floor())
        super().add(req)

    def prepend(self, req: Request) -> None:
        c = req.priority
        if not self._qs[c]:
            self.vtime[c] = max(self.vtime[c], self._active_floor())
        super().prepend(req)

    def _next_class(self) -> int | None:
        best: int | None = None
        for c, q in enumerate(self._qs):
            # ties go to the more urgent class (lower index)
            if q and (best is None or self.vtime[c] < self.vtime[best]):
                best = c
        return best

    def charge(self, priority: Priority, num_tokens: int) -> None:
        self.vtime[priority] += num_tokens / self.weights[Priority(priority)]


def make_request_queue(policy: str | QueuePolicy) -> RequestQueue:
    p = QueuePolicy(policy)
    if p is QueuePolicy.FCFS:
        return FCFSQueue()
    if p is QueuePolicy.PRIORITY:
        return PriorityQueue()
    return WFQQueue()
