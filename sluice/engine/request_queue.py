"""Waiting-queue policies behind one small interface: ``fcfs``, ``priority``, ``wfq``.

Waiting requests sit in one FIFO per class (a preempted request goes back to
the *front* of its class).  Each step the scheduler hands out prefill tokens
class by class: it tells the queue which classes have prefill work pending
(a chunked prefill already running, or a waiting request) and which are
behind their TTFT target, and the policy answers which class goes next
(``pick_class``); the scheduler then reports the tokens it gave (``charge``).

    fcfs      the class whose oldest pending request arrived first (classes ignored)
    priority  strict: P0 before P1 before P2
    wfq       a class behind its target first (most urgent first); otherwise
              weighted fair queuing of prefill tokens, weights P0:5 P1:3 P2:1

NOTE(wfq): start-time fair queuing.  Each class keeps a virtual time that
advances by ``tokens / weight`` when it is served; the eligible class with the
smallest virtual time goes next (ties to the more urgent class), so with P0
and P1 both backlogged P1 receives 3/5 of P0's prefill tokens.  The system
virtual time is the start tag of the class served last; a class whose own
tag lags it (it was idle, or blocked) starts from it when next served, so it
banks no credit for that time, and a class that arrives while another is
mid-prefill is not made to wait behind it.  Only service moves the tags
(NOTE(served-only)).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence

from sluice.engine.config import SchedulingPolicy
from sluice.engine.request import Request
from sluice.types import PRIORITY_WEIGHTS, Priority

__all__ = ["RequestQueue", "ClassChoice", "make_request_queue"]


class ClassChoice:
    """``pick_class``'s answer: the class to serve next, and whether it is *urgent*.

    An urgent class may take the step's token budget from strictly lower
    classes' decodes: under ``priority`` and ``wfq`` always (WFQ shares prefill
    tokens among classes; it never lets a lower class's decodes starve a
    higher class's prefill), under ``fcfs`` never.
    """

    __slots__ = ("priority", "is_urgent")

    def __init__(self, priority: int, is_urgent: bool):
        self.priority = priority
        self.is_urgent = is_urgent


class RequestQueue(ABC):
    def __init__(self) -> None:
        self._qs: list[deque[Request]] = [deque() for _ in Priority]

    # ------------------------------------------------------------ the queues

    def add(self, req: Request) -> None:
        self._qs[req.priority].append(req)

    def prepend(self, req: Request) -> None:
        """Put a preempted request back at the front of its class."""
        self._qs[req.priority].appendleft(req)

    def head(self, priority: int) -> Request | None:
        q = self._qs[priority]
        return q[0] if q else None

    def of_class(self, priority: int) -> Iterator[Request]:
        """Class ``priority``'s waiting requests, FIFO."""
        return iter(self._qs[priority])

    def pop_head(self, priority: int) -> Request:
        return self._qs[priority].popleft()

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

    def count_by_priority(self) -> list[int]:
        return [len(q) for q in self._qs]

    def peek(self) -> Request | None:
        """The waiting request this policy would admit next, were no prefill running."""
        heads = [None if not q else q[0].timings.arrival for q in self._qs]
        choice = self.pick_class(heads, [False] * len(heads))
        return None if choice is None else self._qs[choice.priority][0]

    # ------------------------------------------------------------ the policy

    @abstractmethod
    def pick_class(self, oldest: Sequence[float | None], behind: Sequence[bool]) -> ClassChoice | None:
        """The class to give prefill tokens next.

        ``oldest[c]``: arrival time of class c's oldest pending prefill work, None
        when it has none (or is blocked this step); ``behind[c]``: class c's
        oldest pending request has used much of its TTFT target.  Changes no
        policy state: only ``charge`` does (NOTE(served-only)).
        """

    def charge(self, priority: int, num_tokens: int) -> None:  # noqa: B027 (optional hook)
        """Account prefill tokens given to a class (negative: a refund)."""


class FCFSQueue(RequestQueue):
    def pick_class(self, oldest: Sequence[float | None], behind: Sequence[bool]) -> ClassChoice | None:
        best: int | None = None
        for c, t in enumerate(oldest):
            if t is not None and (best is None or t < oldest[best]):  # type: ignore[operator]
                best = c
        return None if best is None else ClassChoice(best, False)


class PriorityQueue(RequestQueue):
    """Strict priority: P0 before P1 before P2."""

    def pick_class(self, oldest: Sequence[float | None], behind: Sequence[bool]) -> ClassChoice | None:
        c = next((c for c, t in enumerate(oldest) if t is not None), None)
        return None if c is None else ClassChoice(c, True)


class WFQQueue(RequestQueue):
    def __init__(self, weights: dict[Priority, float] | None = None) -> None:
        super().__init__()
        self.weights = weights or PRIORITY_WEIGHTS
        self.vtime = [0.0 for _ in Priority]
        self.system_vtime = 0.0  # the start tag of the class served last

    def pick_class(self, oldest: Sequence[float | None], behind: Sequence[bool]) -> ClassChoice | None:
        eligible = [c for c, t in enumerate(oldest) if t is not None]
        if not eligible:
            return None
        # NOTE(behind-first): a class that is behind its TTFT target is served
        # before fairness: the most urgent behind class first.
        late = [c for c in eligible if behind[c]]
        best = late[0] if late else min(eligible, key=lambda c: (self._start_tag(c), c))
        return ClassChoice(best, True)

    def _start_tag(self, c: int) -> float:
        """Class ``c``'s tag were it served now: its own, or the system virtual time if that is later."""
        return max(self.vtime[c], self.system_vtime)

    def charge(self, priority: int, num_tokens: int) -> None:
        # NOTE(served-only): the tags move when a class is served, never when it is only picked.
        # A pick may find no slot or no blocks (NOTE(hol) in the scheduler); had the pick moved
        # the system virtual time, a backlogged class the slot-bound picks passed over would be
        # lifted to the tag of the class picked after it, lose every tie to it, and never be
        # served: with 4 slots and P1 backlogged, P2 got no slot for 200 waves.
        if num_tokens > 0:
            start = self._start_tag(priority)
            self.system_vtime = start
            self.vtime[priority] = start + num_tokens / self.weights[Priority(priority)]
        else:  # a refund (its request preempted in the step that served it): no new start
            self.vtime[priority] += num_tokens / self.weights[Priority(priority)]


def make_request_queue(policy: str | SchedulingPolicy) -> RequestQueue:
    """The queue of one ``--scheduling-policy`` (``SchedulingPolicy``, engine/config.py, names them)."""
    p = SchedulingPolicy(policy)
    if p is SchedulingPolicy.FCFS:
        return FCFSQueue()
    if p is SchedulingPolicy.PRIORITY:
        return PriorityQueue()
    return WFQQueue()
