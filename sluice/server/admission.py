"""Admission control: a bounded waiting queue, lowest class shed first (pure).

A request is *queued* from admission until its first output arrives (the
engine has scheduled and prefilled it).  The queue is bounded in requests
(``max_queued_requests``) and in tokens (``max_queued_tokens``: prompt +
max_tokens).  When a new request does not fit:

- if queued requests of a strictly lower class (larger ``Priority``) can make
  room, the newest of the lowest class are shed (they get 429 at once and
  are aborted in the engine) and the new request is admitted;
- otherwise the new request gets 429 at once.  Never a timeout.

NOTE(shed-lowest-first): a P0 burst is never turned away while P2 work waits;
shedding newest-first keeps the oldest P2 requests' queueing investment.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.errors import OverloadedError
from sluice.types import Priority

__all__ = ["AdmissionController"]


@dataclass
class _Entry:
    key: str  # the HTTP request's id
    priority: Priority
    num_tokens: int  # prompt + max_tokens, all choices
    seq: int  # admission order


class AdmissionController:
    def __init__(self, max_queued_requests: int, max_queued_tokens: int, retry_after: float = 1.0):
        self.max_requests = max_queued_requests
        self.max_tokens = max_queued_tokens
        self.retry_after = retry_after
        self._queued: dict[str, _Entry] = {}
        self._num_tokens = 0
        self._seq = 0

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_queued_tokens(self) -> int:
        return self._num_tokens

    def admit(self, key: str, priority: Priority, num_tokens: int) -> list[str]:
        """Admit ``key`` or raise ``OverloadedError``; returns the keys shed to make room."""
        if num_tokens > self.max_tokens:
            raise OverloadedError(
                f"request needs {num_tokens} queued tokens, over the server's limit of "
                f"{self.max_tokens} (--max-queued-tokens)",
                retry_after=self.retry_after,
            )
        victims: list[_Entry] = []
        n, t = len(self._queued), self._num_tokens
        if n + 1 > self.max_requests or t + num_tokens > self.max_tokens:
            # candidates: strictly lower classes, lowest class first, newest first
            lower = sorted(
                (e for e in self._queued.values() if e.priority > priority),
                key=lambda e: (-int(e.priority), -e.seq),
            )
            for e in lower:
                if n + 1 <= self.max_requests and t + num_tokens <= self.max_tokens:
                    break
                victims.append(e)
                n -= 1
                t -= e.num_tokens
            if n + 1 > self.max_requests or t + num_tokens > self.max_tokens:
                raise OverloadedError(
                    f"server overloaded: {len(self._queued)} requests / {self._num_tokens} tokens "
                    f"queued (limits {self.max_requests} / {self.max_tokens}); retry later",
                    retry_after=self.retry_after,
                )
        for e in victims:
            self.remove(e.key)
        self._seq += 1
        self._queued[key] = _Entry(key, priority, num_tokens, self._seq)
        self._num_tokens += num_tokens
        return [e.key for e in victims]

    def remove(self, key: str) -> None:
        """The request started (first output), finished, or went away."""
        e = self._queued.pop(key, None)
        if e is not None:
            self._num_tokens -= e.num_tokens
