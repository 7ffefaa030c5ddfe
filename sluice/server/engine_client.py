"""The API process's handle on the engine core process.

``EngineClient`` spawns the engine core, sends requests and aborts over ZMQ,
and fans the per-step ``EngineCoreOutputs`` out to one ``RequestStream`` per
HTTP request (a request with ``n > 1`` or several prompts has several engine
request ids feeding the same stream).

Engine death is noticed at once (the process sentinel is watched by the event
loop): every open stream receives ``EngineDeadError`` and ``on_dead`` is
called, so no request ever hangs on a dead engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from sluice.engine.config import EngineConfig, ModelInfo
from sluice.engine.protocol import (
    EngineAbort,
    EngineControl,
    EngineOutput,
    EngineRequest,
    EngineStats,
    LoRALoadRecord,
)
from sluice.errors import (
    EngineDeadError,
    InvalidRequestError,
    ModelLoadError,
    ServiceUnavailableError,
    SluiceError,
)
from sluice.server.engine_proc import Lending, default_engine_factory, run_engine_core
from sluice.server.ipc import Decoders, IpcPaths, Kind, encode

__all__ = ["EngineClient", "RequestStream"]

log = logging.getLogger("sluice.server")


class RequestStream:
    """Outputs of one HTTP request's engine requests, in arrival order.

    Items are ``EngineOutput`` or a ``SluiceError`` that ends the stream.
    """

    __slots__ = ("request_ids", "queue")

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.queue: asyncio.Queue[EngineOutput | SluiceError] = asyncio.Queue()

    async def get_batch(self) -> list[EngineOutput | SluiceError]:
        """Wait for at least one item, then take everything already queued."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    def fail(self, error: SluiceError) -> None:
        self.queue.put_nowait(error)


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        *,
        engine_factory: Callable[[EngineConfig], Any] | None = None,
        on_dead: Callable[[], None] | None = None,
        on_stats: Callable[[EngineStats], None] | None = None,
        on_lora_loads: Callable[[list[LoRALoadRecord]], None] | None = None,
        lending: Lending | None = None,
    ):
        self.config = config
        self._lending = lending  # NOTE(lane-lend): goes to the engine core process
        self._factory = engine_factory or default_engine_factory
        self._on_dead = on_dead
        self._on_stats = on_stats
        self._on_lora_loads = on_lora_loads
        self._paths = IpcPaths.create()
        # NOTE(raw-zmq): plain sockets, with the PULL socket's FD watched by the event
        # loop, cost a fraction of zmq.asyncio's futures per message; this path runs
        # once per engine step, so it bounds the API process's CPU per token.
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(self._paths.input_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(self._paths.output_addr)
        self._dec = Decoders()
        self._streams: dict[str, RequestStream] = {}  # engine request id -> stream
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._out_fd: int | None = None
        self.model_info: ModelInfo | None = None
        self.ready = asyncio.Event()
        self.is_dead = False
        self.is_closing = False
        self.stats = EngineStats()
        self.start_error: str | None = None
        self._controls: dict[int, asyncio.Future[dict[str, Any]]] = {}  # control id -> its reply
        self._next_control = 0

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Spawn the engine core and start the output loop (returns at once)."""
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(self._factory, self.config, self._paths.input_addr, self._paths.output_addr, self._lending),
            name="sluice-engine-core",
            daemon=True,
        )
        self._proc.start()
        loop = asyncio.get_running_loop()
        loop.add_reader(self._proc.sentinel, self._on_exit)
        fd = self._out.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self._out_fd = fd
        loop.add_reader(fd, self._on_readable)
        self._on_readable()  # the FD is edge-triggered: drain anything already there

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def wait_ready(self) -> ModelInfo:
        await self.ready.wait()
        if self.model_info is None:
            raise ModelLoadError(self.start_error or "the engine core failed to start")
        return self.model_info

    async def close(self, timeout: float = 5.0) -> None:
        self.is_closing = True
        proc = self._proc
        if proc is not None:
            # the sentinel fires on exit; we are closing, so that is not a death
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(proc.sentinel)
            if proc.is_alive():
                proc.terminate()
                deadline = time.monotonic() + timeout
                while proc.is_alive() and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                if proc.is_alive():
                    proc.kill()
            proc.join(1.0)
        if self._out_fd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._out_fd)
            self._out_fd = None
        self._in.close(0)
        self._out.close(0)
        self._ctx.term()
        self._paths.cleanup()

    def _on_exit(self) -> None:
        proc = self._proc
        if proc is None:
            return
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        if self.is_closing:
            return
        self.is_dead = True
        code = proc.exitcode
        if not self.ready.is_set():
            self.start_error = self.start_error or f"the engine core exited during start-up (exit code {code})"
            self.ready.set()
        log.error("engine core process died (exit code %s); failing %d requests", code, len(self._streams))
        err = EngineDeadError("the engine core process died; retry on another replica", retry_after=1.0)
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.fail(err)
        self._streams.clear()
        for fut in self._controls.values():
            if not fut.done():
                fut.set_exception(err)
        self._controls.clear()
        if self._on_dead is not None:
            self._on_dead()

    # -- requests ------------------------------------------------------------------

    def add_requests(self, requests: list[EngineRequest], lane: int = 0) -> RequestStream:
        """Send ``requests`` (``lane``: always 0 here, one engine core; ``LanedClient`` has several)."""
        if self.is_dead:
            raise EngineDeadError("the engine core process is not running", retry_after=1.0)
        stream = RequestStream([r.request_id for r in requests])
        for r in requests:
            self._streams[r.request_id] = stream
        self._send(encode(Kind.REQUESTS, requests))
        return stream

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        if ids and not self.is_dead:
            self._send(encode(Kind.ABORT, EngineAbort(request_ids=ids)))

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished ids (no abort sent)."""
        for rid in request_ids:
            self._streams.pop(rid, None)

    async def control(self, command: str, timeout: float = 600.0, **args: Any) -> dict[str, Any]:
        """Run an operator command in the engine core (between two steps) and return its report
        (``lora_load``: once the adapter is loaded, which takes no step)."""
        if self.is_dead:
            raise EngineDeadError("the engine core process is not running", retry_after=1.0)
        self._next_control += 1
        cid = self._next_control
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._controls[cid] = fut
        try:
            self._send(encode(Kind.CONTROL, EngineControl(id=cid, command=command, args=args)))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._controls.pop(cid, None)

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    def _send(self, frames: list[bytes]) -> None:
        # NOTE(nonblocking-send): the engine drains its input every step, so the
        # default HWM (1000 messages) is never reached in practice; if it is, the
        # engine is wedged and the request fails fast instead of blocking the loop.
        try:
            self._in.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise ServiceUnavailableError("the engine core is not accepting requests", retry_after=1.0) from None

    # -- output fan-out ------------------------------------------------------------

    def _on_readable(self) -> None:
        sock = self._out
        # NOTE(no-again): test EVENTS instead of catching zmq.Again; building that
        # exception costs more than handling the message.
        while True:
            try:
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator,arg-type]
                    return
                kind, payload = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # closed under us during shutdown
                return
            try:
                self._handle(kind, payload)
            except Exception:  # noqa: BLE001 -- keep draining: the FD is edge-triggered
                log.exception("bad message from the engine core")

    def _handle(self, kind: bytes, payload: bytes) -> None:
        dec = self._dec
        if kind == Kind.OUTPUTS:
            batch = dec.outputs.decode(payload)
            streams = self._streams
            for out in batch.outputs:
                stream = streams.get(out.request_id)
                if stream is None:
                    continue  # aborted or released earlier
                if out.finished:
                    del streams[out.request_id]
                stream.queue.put_nowait(out)
            if batch.stats is not None:
                self.stats = batch.stats
                if self._on_stats is not None:
                    self._on_stats(batch.stats)
            if batch.lora_loads and self._on_lora_loads is not None:
                self._on_lora_loads(batch.lora_loads)
        elif kind == Kind.CONTROL_REPLY:
            reply = dec.control_reply.decode(payload)
            fut = self._controls.get(reply.id)
            if fut is not None and not fut.done():
                if reply.error is not None:
                    fut.set_exception(reply.error.to_exception())
                else:
                    fut.set_result(reply.result)
        elif kind == Kind.READY:
            self.model_info = dec.ready.decode(payload)
            self.ready.set()
        elif kind == Kind.ERROR:
            self.start_error = dec.error.decode(payload).message
            log.error("engine core failed to start: %s", self.start_error)
            self.ready.set()


def engine_error(out: EngineOutput) -> SluiceError:
    """An engine-side rejection (``EngineOutput.error``) back in our error tree."""
    if out.error is None:
        return InvalidRequestError("rejected by the engine")
    return out.error.to_exception()
