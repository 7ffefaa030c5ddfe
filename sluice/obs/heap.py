"""The Python heap of a long-running sluice process: freeze what start-up built.

NOTE(gc-freeze): CPython's full collection (generation 2) walks every object
the collector tracks.  After start-up the API process holds hundreds of
thousands of them (the tokenizer, FastAPI and pydantic models, transformers'
modules), and one full collection takes a large fraction of a second on a small
host; under load one comes every few seconds, and for its duration the event
loop answers nothing: no token is streamed, no 429 is sent, ``/health`` waits.
Under overload that was the tail of P0's time to first token and of the 429s
(docs/design/overload.md, "GC frozen after start-up").
``gc.freeze()`` once start-up is done moves those objects to the permanent
generation, which collections no longer walk; what is allocated later is
collected as before (objects frozen and later dropped are still freed by
reference counting; only start-up garbage in reference cycles would stay,
and the ``gc.collect()`` before the freeze clears that).  vLLM and SGLang do
the same after their start-up.  Each process calls it once: the API process
when the engine is ready, the engine core process after loading the model,
the gateway before it starts serving.
"""

from __future__ import annotations

import gc
import logging
import time

__all__ = ["freeze_startup_heap"]

log = logging.getLogger("sluice.obs.heap")


def freeze_startup_heap(process: str) -> int:
    """Collect, then freeze every object alive now; returns how many were frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.debug("%s: froze %d start-up objects in %.0f ms (NOTE(gc-freeze))", process, n,
              (time.perf_counter() - t0) * 1000)  # fmt: skip
    return n
