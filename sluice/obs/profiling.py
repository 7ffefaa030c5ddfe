"""Sampling profiles of running processes with py-spy, and the bounded directory that keeps them.

``PySpySampler.sample`` runs one ``py-spy record --format raw`` per process,
all at once, and returns their collapsed stacks (``sluice.obs.flamegraph``
draws them) plus what the sampling cost (py-spy's own CPU time, from the
children's rusage).  Two modes:

    non-blocking (default)  py-spy reads the target's memory without stopping it:
                            the target pays nothing but a core shared with py-spy
    native                  ``--native`` C/C++ frames too; py-spy must pause the
                            target for each sample (py-spy cannot unwind native
                            stacks of a running process), so it costs the target time

py-spy attaches with ``ptrace``/``process_vm_readv``: in a container that needs
``CAP_SYS_PTRACE`` (or ``kernel.yama.ptrace_scope`` 0 and the same user).
Without it, ``ProfilerUnavailableError`` says so and how to grant it.

``ProfileStore`` keeps finished archives under one directory, at most
``keep`` of them and ``max_bytes`` in all, removing the oldest first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import resource
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from sluice.errors import ProfilerUnavailableError
from sluice.obs.flamegraph import Stacks, parse_collapsed

__all__ = [
    "Target",
    "SamplingResult",
    "PySpySampler",
    "ProfileStore",
    "find_py_spy",
    "allow_ptrace_by_descendants",
    "PTRACE_FIX",
]

PTRACE_FIX = (
    "grant ptrace: docker run --cap-add SYS_PTRACE; Kubernetes securityContext.capabilities.add: [SYS_PTRACE]; "
    "on a host, run as the server's user with kernel.yama.ptrace_scope=0 (sysctl) or as root"
)


@dataclass(frozen=True)
class Target:
    label: str  # api | engine_core
    pid: int


@dataclass
class SamplingResult:
    stacks: dict[str, Stacks] = field(default_factory=dict)  # "api (pid 12)" -> stacks
    num_samples: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # label -> py-spy's complaint, one line
    sampler_cpu_seconds: float = 0.0  # py-spy's user + system time, all targets
    wall_seconds: float = 0.0


def find_py_spy() -> str | None:
    """py-spy next to this interpreter (a venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


_PR_SET_PTRACER = 0x59616D61  # prctl option of the Yama LSM


def allow_ptrace_by_descendants(pid: int | None = None) -> bool:
    """Let ``pid`` (default: this process) and its descendants ptrace this process.

    NOTE(yama): with ``kernel.yama.ptrace_scope = 1`` (Ubuntu's default, and so
    in most containers) a process may only trace its own descendants; py-spy is
    a child of the API process, so the API process names itself and the engine
    core names the API process.  Same user only, as always; False where Yama is
    absent (nothing to allow) or prctl fails.
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid or os.getpid()), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _complaint(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("py-spy>")]
    return lines[0] if lines else "py-spy failed"


def _is_permission_error(text: str) -> bool:
    t = text.lower()
    return any(s in t for s in ("permission denied", "operation not permitted", "os error 1)", "eperm"))


class PySpySampler:
    def __init__(self, py_spy: str | None = None, command_prefix: tuple[str, ...] = ()):
        self.py_spy = py_spy or find_py_spy()
        self.command_prefix = command_prefix  # tests run py-spy as another user to check the ptrace error

    def argv(self, target: Target, seconds: float, rate: int, native: bool, output: Path) -> list[str]:
        if self.py_spy is None:
            raise ProfilerUnavailableError("py-spy is not installed: pip install py-spy")
        mode = ["--native"] if native else ["--nonblocking"]
        duration = str(max(1, round(seconds)))  # py-spy takes whole seconds
        return [*self.command_prefix, self.py_spy, "record", "--pid", str(target.pid), "--duration", duration,
                "--rate", str(rate), "--format", "raw", "--output", str(output), *mode]  # fmt: skip

    async def sample(
        self, targets: list[Target], seconds: float, out_dir: Path, *, rate: int = 100, native: bool = False
    ) -> SamplingResult:
        """Sample every target for ``seconds``; a permission failure raises, others are reported."""
        cpu0, t0 = _children_cpu(), time.monotonic()
        procs = []
        for t in targets:
            out = out_dir / f"{t.label}.collapsed.txt"
            argv = self.argv(t, seconds, rate, native, out)
            p = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
            )
            procs.append((t, p, out))
        result = SamplingResult()
        try:
            waits = await asyncio.wait_for(
                asyncio.gather(*(p.communicate() for _, p, _ in procs)), timeout=seconds + 60.0
            )
        finally:
            for _, p, _ in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
                    await p.wait()
        result.sampler_cpu_seconds = _children_cpu() - cpu0
        result.wall_seconds = time.monotonic() - t0
        for (t, p, out), (_, err) in zip(procs, waits):
            key = f"{t.label} (pid {t.pid})"
            text = err.decode(errors="replace")
            if p.returncode != 0:
                if _is_permission_error(text):
                    raise ProfilerUnavailableError(
                        f"py-spy may not attach to the {t.label} process (pid {t.pid}): ptrace is not permitted. "
                        f"Fix: {PTRACE_FIX}"
                    )
                result.errors[t.label] = _complaint(text)
                continue
            stacks = parse_collapsed(out.read_text()) if out.exists() else {}
            result.stacks[key] = stacks
            result.num_samples[key] = sum(stacks.values())
            out.unlink(missing_ok=True)
        return result


class ProfileStore:
    """``<dir>/<stamp>-<n>/`` while a profile is written, ``<dir>/<stamp>-<n>.zip`` once done."""

    def __init__(self, directory: Path, keep: int = 10, max_bytes: int = 512 * 2**20):
        self.directory = directory
        self.keep = keep
        self.max_bytes = max_bytes
        self._seq = itertools.count()

    def new_run(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        run = self.directory / f"profile-{stamp}-{os.getpid()}-{next(self._seq)}"
        run.mkdir()
        return run

    def finish(self, run: Path) -> Path:
        """Zip the run directory (then remove it) and apply the caps; the archive's path."""
        archive = run.with_suffix(".zip")
        with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as z:
            for f in sorted(run.iterdir()):
                z.write(f, arcname=f.name)
        shutil.rmtree(run, ignore_errors=True)
        self.prune(keep_latest=archive)
        return archive

    def archives(self) -> list[Path]:
        """Oldest first."""
        return sorted(self.directory.glob("profile-*.zip"), key=lambda p: (p.stat().st_mtime, p.name))

    def prune(self, keep_latest: Path | None = None) -> list[Path]:
        """Remove the oldest archives beyond ``keep`` or ``max_bytes`` (never ``keep_latest``)."""
        removed: list[Path] = []
        zips = self.archives()
        total = sum(p.stat().st_size for p in zips)
        for p in zips:
            if len(zips) - len(removed) <= self.keep and total <= self.max_bytes:
                break
            if p == keep_latest:
                continue
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
            removed.append(p)
        for stale in self.directory.glob("profile-*"):  # runs that died half-written
            if stale.is_dir() and time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
        return removed
