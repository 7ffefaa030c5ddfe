"""The SSE decoder: events split anywhere across reads still come out whole."""

from __future__ import annotations

from sluice.bench.sse import SSEDecoder

STREAM = b'data: {"a": 1}\n\n: keep-alive\n\nevent: x\ndata: {"b": 2}\r\n\r\ndata: line1\ndata: line2\n\ndata: [DONE]\n\n'
EXPECTED = [b'{"a": 1}', b'{"b": 2}', b"line1\nline2", b"[DONE]"]


def test_every_split_point_gives_the_same_events():
    for cut in range(len(STREAM) + 1):
        dec = SSEDecoder()
        got = dec.feed(STREAM[:cut]) + dec.feed(STREAM[cut:])
        assert got == EXPECTED, f"splitting the stream at byte {cut} changed the events"
        assert not dec.has_pending


def test_byte_by_byte_and_truncation_is_visible():
    dec = SSEDecoder()
    got = [e for i in range(len(STREAM)) for e in dec.feed(STREAM[i : i + 1])]
    assert got == EXPECTED
    dec2 = SSEDecoder()
    assert dec2.feed(b'data: {"half') == []
    assert dec2.has_pending, "an unfinished event must be reported as pending (truncated stream)"
