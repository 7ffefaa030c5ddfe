"""The engine core process: a busy loop around ``EngineCore``.

    poll input (block only when idle) -> add / abort / control -> step -> publish outputs

It owns the model, the KV cache and the scheduler (all inside ``EngineCore``)
and nothing else: no HTTP, no tokenizer.  It publishes one
``EngineCoreOutputs`` (with an ``EngineStats`` snapshot) per step, and one more
when it goes idle so that gauges fall back to zero.  It exits when the API
process goes away (parent pid changes) or on SIGTERM.

``engine_factory`` is any picklable callable ``EngineConfig -> EngineCoreProtocol``;
tests pass ``sluice.server.testing.FakeEngineCore``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Protocol

import zmq

from sluice.engine.config import EngineConfig
from sluice.engine.protocol import (
    EngineControl,
    EngineControlReply,
    EngineCoreOutputs,
    EngineCoreProtocol,
    EngineError,
    EngineOutput,
    FinishReason,
    LoRALoadRecord,
)
from sluice.errors import InvalidRequestError, ModelLoadError, SluiceError
from sluice.obs.heap import freeze_startup_heap
from sluice.server.engine_setup import StepProfiler, profile_control
from sluice.server.ipc import Decoders, Kind, encode

__all__ = ["run_engine_core", "default_engine_factory", "Lending"]

log = logging.getLogger("sluice.engine_core")

IDLE_POLL_MS = 500  # how often an idle engine checks that its parent is alive
LOAD_POLL_MS = 5  # how often an engine with only LoRA adapter loads in flight looks at them


def default_engine_factory(config: EngineConfig) -> EngineCoreProtocol:
    from sluice.engine.core import EngineCore

    return EngineCore(config)


class Lending(Protocol):
    """Told before each step whether this engine has work (NOTE(lane-lend) in ``sluice.server.lanes``)."""

    def update(self, busy: bool) -> None: ...


def run_engine_core(
    engine_factory: Callable[[EngineConfig], EngineCoreProtocol],
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    lending: Lending | None = None,
) -> None:
    """Process entry point (spawned by ``EngineClient``)."""
    parent = os.getppid()
    stopping = False

    def _on_term(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the API process, which drains

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(input_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(output_addr)
    try:
        engine = engine_factory(config)
    except Exception as e:  # noqa: BLE001 -- reported to the API process as one line
        err = e if isinstance(e, SluiceError) else ModelLoadError(f"{type(e).__name__}: {e}")
        push.send_multipart(encode(Kind.ERROR, EngineError.from_exception(err)))
        push.close()
        sys.exit(3)
    freeze_startup_heap("engine")  # NOTE(gc-freeze) in sluice.obs.heap: the model's modules, not walked each step
    push.send_multipart(encode(Kind.READY, engine.model_info))
    _publish_stats(push, engine)  # gauges and /admin/kv are right before the first request

    dec = Decoders()
    profiler = StepProfiler()  # torch.profiler, off until POST /admin/profile
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    was_busy = False
    lora_tickets: dict[int, int] = {}  # LoRA load ticket -> the lora_load control awaiting its answer
    rejected: list[EngineOutput] = []
    held: list[tuple[bytes, bytes]] = []  # messages read mid-step that wait for the step's end

    def handle(kind: bytes, payload: bytes) -> None:
        if kind == Kind.REQUESTS:
            for req in dec.requests.decode(payload):
                try:
                    engine.add_request(req)
                except SluiceError as e:
                    rejected.append(_rejection(req.request_id, e))
        elif kind == Kind.ABORT:
            engine.abort(dec.abort.decode(payload).request_ids)
        elif kind == Kind.CONTROL:
            reply = _control(engine, profiler, dec.control.decode(payload), lora_tickets)
            if reply is not None:  # None: a LoRA load, answered when it finished
                push.send_multipart(encode(Kind.CONTROL_REPLY, reply))
            _publish_stats(push, engine)

    def take_arrivals() -> None:
        """Mid-step (NOTE(mid-step-express) in sluice.engine.core): add new requests, take aborts; hold the rest.

        NOTE(mid-step-aborts): an abort only queues its ids (the engine applies it
        when the step ends, as it would at a boundary), so it is taken mid-step too.
        Held, it would hold every request behind it (messages keep their order): a P0
        that came in after a shed (the admission sheds queued lower-class requests
        under overload) or a client's hang-up waited out the running step.
        Controls (profiling, LoRA, KV checkpoints) touch engine state: they wait.
        """
        while poller.poll(0):
            kind, payload = pull.recv_multipart()
            if kind in (Kind.REQUESTS, Kind.ABORT) and not held:  # held first: messages keep their order
                handle(kind, payload)
            else:
                held.append((kind, payload))

    def publish_early(outputs: list[EngineOutput]) -> None:
        push.send_multipart(encode(Kind.OUTPUTS, EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic())))

    engine.set_arrivals(take_arrivals, publish_early)
    while not stopping:
        for kind, payload in held:
            handle(kind, payload)
        held.clear()
        busy = engine.has_unfinished_requests()
        timeout = 0 if busy else LOAD_POLL_MS if engine.has_pending_lora_loads() else IDLE_POLL_MS
        # NOTE(drain-input): take every queued message before stepping so that a
        # burst of arrivals lands in one schedule() instead of one per step.
        while poller.poll(timeout):
            timeout = 0
            handle(*pull.recv_multipart())
        if os.getppid() != parent:
            break
        busy = engine.has_unfinished_requests()
        if lending is not None:
            lending.update(busy)
        outputs = (profiler.step(engine) if profiler.is_active else engine.step()) if busy else []
        loads = engine.take_lora_loads()
        if busy or was_busy or rejected or loads:
            push.send_multipart(
                encode(
                    Kind.OUTPUTS,
                    EngineCoreOutputs(
                        outputs=rejected + outputs,  # a rejection made mid-step goes out with its step
                        stats=engine.make_stats(),
                        timestamp=time.monotonic(),
                        lora_loads=loads,
                    ),
                )
            )
        for rec in loads:  # after the outputs: the reply finds the adapter in the stats already
            cid = lora_tickets.pop(rec.ticket, None) if rec.ticket else None
            if cid is not None:
                push.send_multipart(encode(Kind.CONTROL_REPLY, _load_reply(cid, rec)))
        rejected.clear()
        was_busy = busy
    # NOTE(kv-checkpoint-on-exit): a graceful stop (SIGTERM, or the API process
    # gone) writes the cached prefix blocks the disk tier lacks, so a restart
    # hits; with write-through that is only the last few blocks.
    try:
        engine.close(checkpoint=True)
    except Exception:  # noqa: BLE001 -- exiting anyway
        log.exception("closing the engine failed")
    pull.close(linger=0)
    push.close()
    ctx.term()


def _publish_stats(push: zmq.Socket, engine: EngineCoreProtocol) -> None:
    stats = EngineCoreOutputs(outputs=[], stats=engine.make_stats(), timestamp=time.monotonic())
    push.send_multipart(encode(Kind.OUTPUTS, stats))


def _control(
    engine: EngineCoreProtocol, profiler: StepProfiler, msg: EngineControl, lora_tickets: dict[int, int]
) -> EngineControlReply | None:
    """Run an operator command; None when the answer comes later (``lora_load``: once loaded)."""
    try:
        if msg.command.startswith("profile_"):
            return EngineControlReply(id=msg.id, result=profile_control(profiler, msg.command))
        if msg.command == "lora_load":
            a = msg.args
            lora_tickets[engine.load_lora_adapter(a["name"], a["path"], a.get("traceparent"))] = msg.id
            return None
        if msg.command == "lora_unload":
            engine.unload_lora_adapter(msg.args["name"])
            return EngineControlReply(id=msg.id, result={"lora_name": msg.args["name"]})
        if msg.command == "kv_checkpoint":
            return EngineControlReply(id=msg.id, result=engine.kv_checkpoint())
        raise InvalidRequestError(f"unknown engine command {msg.command!r}")
    except Exception as e:  # noqa: BLE001 -- the admin route reports it; the engine keeps serving
        err = e if isinstance(e, SluiceError) else SluiceError(f"{type(e).__name__}: {e}")
        return EngineControlReply(id=msg.id, error=EngineError.from_exception(err))


def _load_reply(control_id: int, rec: LoRALoadRecord) -> EngineControlReply:
    if rec.error is not None:
        err = EngineError(type="invalid_request_error", message=rec.error, code="invalid_lora_adapter", param="lora_path")
        return EngineControlReply(id=control_id, error=err)
    return EngineControlReply(id=control_id, result={"lora_name": rec.adapter, "lora_path": rec.path,
                                                     "load_seconds": rec.end - rec.start, "num_bytes": rec.num_bytes})  # fmt: skip


def _rejection(request_id: str, e: SluiceError) -> EngineOutput:
    return EngineOutput(
        request_id=request_id,
        new_token_ids=[],
        finished=True,
        finish_reason=FinishReason.ABORT,
        error=EngineError.from_exception(e),
    )
