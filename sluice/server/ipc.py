"""Wire format between the API process and the engine core process.

Two ZeroMQ PUSH/PULL pipes over ``ipc://`` sockets in a private temp dir; the
API process binds both, the engine core connects.  Every message is two
frames: a one-byte kind and a msgspec-msgpack payload::

    API -> engine   b"R"  list[EngineRequest]     add (n > 1 arrives as one batch)
                    b"A"  EngineAbort             abort
                    b"C"  EngineControl           operator command (admin routes: profile, kv, ...)
    engine -> API   b"O"  EngineCoreOutputs       one per engine step (+ stats)
                    b"Y"  ModelInfo               ready: the model is loaded
                    b"E"  EngineError             start-up failed (one readable line)
                    b"K"  EngineControlReply      answer to one EngineControl
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from dataclasses import dataclass

import msgspec
import psutil

from sluice.engine.config import ModelInfo
from sluice.engine.protocol import (
    EngineAbort,
    EngineControl,
    EngineControlReply,
    EngineCoreOutputs,
    EngineError,
    EngineRequest,
)

__all__ = ["IpcPaths", "Kind", "encode", "Decoders", "sweep_stale_ipc_dirs"]


class Kind:
    REQUESTS = b"R"
    ABORT = b"A"
    OUTPUTS = b"O"
    READY = b"Y"
    ERROR = b"E"
    CONTROL = b"C"
    CONTROL_REPLY = b"K"


_PREFIX = "sluice-ipc-"  # + the API process's pid: NOTE(ipc-sweep)


@dataclass(frozen=True)
class IpcPaths:
    directory: str
    input_addr: str  # API -> engine
    output_addr: str  # engine -> API

    @classmethod
    def create(cls) -> IpcPaths:
        sweep_stale_ipc_dirs()
        d = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
        return cls(d, f"ipc://{d}/in", f"ipc://{d}/out")

    def cleanup(self) -> None:
        for name in ("in", "out"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.directory, name))
        with contextlib.suppress(OSError):
            os.rmdir(self.directory)


def sweep_stale_ipc_dirs(tmp: str | None = None) -> list[str]:
    """Remove the socket dirs of API processes that are gone (killed with no shutdown).

    NOTE(ipc-sweep): a dir is named ``sluice-ipc-<API pid>-<random>``; ``close()``
    removes it, but a process killed with SIGKILL leaves it behind.  A dir whose
    pid no longer runs, holding nothing but the two sockets, neither of which
    anything listens on, is removed by the next server to start (the listening
    check keeps a live server's dir when another PID namespace shares the temp
    dir).  Returns the dirs removed.
    """
    removed = []
    root = tmp or tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name[len(_PREFIX):].split("-", 1)[0] if name.startswith(_PREFIX) else ""
            if not pid.isdigit() or psutil.pid_exists(int(pid)):
                continue
            d = os.path.join(root, name)
            with contextlib.suppress(OSError):
                files = set(os.listdir(d))
                if files <= {"in", "out"} and not any(_is_listening(os.path.join(d, f)) for f in files):
                    IpcPaths(d, "", "").cleanup()
                    removed.append(d)
    return removed


def _is_listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:  # anything else: not ours to judge
            return True
    return True


_encoder = msgspec.msgpack.Encoder()


def encode(kind: bytes, payload: object) -> list[bytes]:
    return [kind, _encoder.encode(payload)]


class Decoders:
    """Typed decoders (one set per process; decoders are not thread-safe)."""

    def __init__(self) -> None:
        self.requests = msgspec.msgpack.Decoder(list[EngineRequest])
        self.abort = msgspec.msgpack.Decoder(EngineAbort)
        self.outputs = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.ready = msgspec.msgpack.Decoder(ModelInfo)
        self.error = msgspec.msgpack.Decoder(EngineError)
        self.control = msgspec.msgpack.Decoder(EngineControl)
        self.control_reply = msgspec.msgpack.Decoder(EngineControlReply)
