"""NOTE(mid-step-express) through the processes: the engine core process takes new requests
and aborts mid-step (an abort is applied when the step ends), publishes a nested step's first
tokens at once, and holds controls for the step's end.  A fake engine with 0.4 s steps takes
arrivals halfway."""

from __future__ import annotations

import threading
import time

import httpx

from tests.server.conftest import scrape, start_fake_server, wait_for

STEP_S = 0.4


def _stream_p2(
    url: str, max_tokens: int, stop_after: int | None = None, first: threading.Event | None = None
) -> list[str]:
    """A streaming p2 completion; with ``stop_after``, hang up after that many chunks. ``first`` is set
    when the first token arrives: a step has just ended, so the next one has just begun."""
    chunks: list[str] = []
    body = {"model": "fake", "prompt": "hello there", "max_tokens": max_tokens, "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"x-priority": "p2"}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(line)
                if first is not None:
                    first.set()
                if stop_after is not None and len(chunks) >= stop_after:
                    break
    return chunks


def _timed_p0(url: str) -> tuple[httpx.Response, float]:
    """A one-token p0 completion and the seconds it took."""
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", headers={"x-priority": "p0"}, timeout=30,
                   json={"model": "fake", "prompt": "quick", "max_tokens": 1, "temperature": 0})  # fmt: skip
    return r, time.monotonic() - t0


def test_a_p0_arriving_mid_step_is_answered_before_the_step_ends_and_aborts_wait_for_it() -> None:
    srv = start_fake_server(step_delay=STEP_S, engine_kwargs={"mid_step": True})
    try:
        # Timed from a step's start (the p2's first token), so the p0 arrives in the step's first half:
        # mid-step it is answered at the halfway mark (~0.15 s), otherwise when the step after ends
        # (>= 0.7 s). Polling the metrics for "running" instead could land past the halfway mark, where
        # a mid-step answer takes up to 0.4 s, and fail on a slow machine.
        first = threading.Event()
        p2 = threading.Thread(target=_stream_p2, args=(srv.url, 6), kwargs={"first": first})
        p2.start()
        assert first.wait(10), "the p2 streams"
        time.sleep(0.05)  # inside a 0.4 s step, before its halfway mark
        r, elapsed = _timed_p0(srv.url)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        assert elapsed < STEP_S, f"answered mid-step, not after the running step and one more: {elapsed:.2f} s"
        p2.join(30)
        # a client hanging up mid-step: its abort is taken mid-step and honoured when the step ends
        hung = threading.Thread(target=_stream_p2, args=(srv.url, 50, 1))
        hung.start()
        hung.join(30)
        assert wait_for(lambda: scrape(srv.url).get("sluice_num_requests_running", 1) == 0, timeout=10), (
            "the abort read mid-step reached the engine: nothing left running"
        )
        r = httpx.post(srv.url + "/v1/completions", json={"model": "fake", "prompt": "after", "max_tokens": 2},
                       timeout=30)  # fmt: skip
        assert r.status_code == 200, "the engine keeps serving"
    finally:
        srv.stop()


def test_a_p0_arriving_mid_step_right_after_an_abort_is_still_answered_mid_step() -> None:
    # NOTE(mid-step-aborts) in sluice.server.engine_proc: an abort read mid-step used to be held
    # for the step's end, and every request behind it with it (messages keep their order), so a
    # P0 that came in after a shed or a hang-up waited out the step and one more.
    srv = start_fake_server(step_delay=STEP_S, engine_kwargs={"mid_step": True})
    try:
        keep = threading.Thread(target=_stream_p2, args=(srv.url, 8))  # keeps the engine stepping
        keep.start()
        assert wait_for(lambda: scrape(srv.url).get("sluice_num_requests_running", 0) >= 1, timeout=5)
        # its first token comes at a step's end; it hangs up at once: the abort lands early in the next step
        assert len(_stream_p2(srv.url, 50, stop_after=1)) == 1
        time.sleep(0.03)  # the API process sees the hang-up and sends the abort first
        r, elapsed = _timed_p0(srv.url)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        assert elapsed < 0.75 * STEP_S, f"nested in the step the abort came in, not held behind it: {elapsed:.2f} s"
        keep.join(30)
        assert wait_for(lambda: scrape(srv.url).get("sluice_num_requests_running", 1) == 0, timeout=10), (
            "the abort was honoured: nothing left running"
        )
    finally:
        srv.stop()


def test_without_mid_step_the_p0_waits_for_the_running_step() -> None:
    srv = start_fake_server(step_delay=STEP_S)
    try:
        p2 = threading.Thread(target=_stream_p2, args=(srv.url, 4))
        p2.start()
        assert wait_for(lambda: scrape(srv.url).get("sluice_num_requests_running", 0) >= 1, timeout=5)
        time.sleep(0.05)
        r, elapsed = _timed_p0(srv.url)
        assert r.status_code == 200 and elapsed >= STEP_S, "the rest of the running step and its own"
        p2.join(30)
    finally:
        srv.stop()
