"""Incremental Server-Sent Events decoder (pure, no I/O).

Feed it the bytes of a response as they arrive; it returns the ``data``
payloads of every event completed so far, never buffering more than one
unfinished event::

    dec = SSEDecoder()
    dec.feed(b'data: {"a": 1}\\n\\nda')   # -> [b'{"a": 1}']
    dec.feed(b'ta: [DONE]\\n\\n')         # -> [b'[DONE]']

Multi-line ``data:`` fields are joined with ``\\n`` (the SSE spec); comments
(``:keep-alive``) and other fields (``event:``, ``id:``, ``retry:``) are ignored.
"""

from __future__ import annotations

__all__ = ["SSEDecoder"]


class SSEDecoder:
    def __init__(self) -> None:
        self._buf = b""  # bytes of an unfinished line
        self._data: list[bytes] = []  # data lines of the event being read

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        lines = buf.split(b"\n")
        self._buf = lines.pop()  # the last piece has no newline yet
        out: list[bytes] = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:  # blank line: the event is complete
                if self._data:
                    out.append(self._data[0] if len(self._data) == 1 else b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
        return out

    @property
    def has_pending(self) -> bool:
        """True when bytes of an unfinished event are buffered (a truncated stream)."""
        return bool(self._buf.strip() or self._data)
