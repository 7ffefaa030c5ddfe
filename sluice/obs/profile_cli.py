"""``sluice profile URL --seconds N --out DIR``: take a profile of a running ``sluice serve``.

    sluice profile http://127.0.0.1:8001 --seconds 10 --out prof/ --api-key sk-admin

POSTs ``/admin/profile`` (``sluice.server.profiling``), shows the window and
the download with a progress bar, and unpacks the archive into ``DIR``: a
flame graph (SVG) and a speedscope profile of the API and engine core
processes, the engine's Chrome trace, and ``summary.json`` (what was sampled,
and what sampling cost).  HTTP only: no torch, no engine.
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import typer

__all__ = ["register", "fetch_profile"]


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_command)


def profile_command(
    url: str = typer.Argument(..., help="Base URL of a sluice serve replica, e.g. http://127.0.0.1:8001"),
    seconds: float = typer.Option(10.0, "--seconds", "-s", help="Profile window in seconds."),
    out: Path = typer.Option(Path("profile"), "--out", "-o", help="Directory for the unpacked files."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="SLUICE_API_KEY",
                                       help="Admin key, when the server has keys."),  # fmt: skip
    native: bool = typer.Option(False, "--native", help="Native (C/C++) frames too: pauses each process "
                                                        "per sample, so more overhead."),  # fmt: skip
    rate: int | None = typer.Option(None, "--rate", help="Samples per second (server default 100)."),
) -> None:
    """Take a flame graph, speedscope profile and engine trace of a running server."""
    body: dict[str, Any] = {"seconds": seconds, "native": native}
    if rate is not None:
        body["rate"] = rate
    files, summary = fetch_profile(url, body, out, api_key=api_key, progress=sys.stderr.isatty())
    print(f"profile: {len(files)} files in {out}")
    for f in files:
        print(f"  {out / f}")
    cost = summary.get("overhead", {})
    if cost.get("sampler_cpu_percent") is not None:
        print(f"  sampling cost: py-spy used {cost['sampler_cpu_percent']:.1f}% of one core over the window")
    print("open the .svg in a browser; load a .speedscope.json at https://www.speedscope.app; "
          "the engine trace at https://ui.perfetto.dev (or chrome://tracing)")  # fmt: skip


def fetch_profile(
    url: str, body: dict[str, Any], out: Path, *, api_key: str | None = None, progress: bool = False
) -> tuple[list[str], dict[str, Any]]:
    """POST ``/admin/profile``, unpack the archive into ``out``; (file names, summary)."""
    import httpx

    from sluice.errors import SluiceError

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    seconds = float(body.get("seconds", 10.0))
    done = threading.Event()
    bar = _WindowBar(seconds, done) if progress else None
    if bar is not None:
        bar.start()
    try:
        with httpx.Client(timeout=httpx.Timeout(10.0, read=seconds + 300.0)) as client:
            r = client.post(url.rstrip("/") + "/admin/profile", json=body, headers=headers)
    except httpx.HTTPError as e:
        raise SluiceError(f"cannot reach {url}: {e}") from None
    finally:
        done.set()
        if bar is not None:
            bar.join()
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        err = SluiceError(f"POST /admin/profile: {r.status_code}: {message}")
        err.status_code = r.status_code
        raise err
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(r.content)) as z:
        names = [n for n in z.namelist() if not n.endswith("/") and _is_safe(n)]
        for n in names:
            target = out / n
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(n))
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return sorted(names), summary


def _is_safe(name: str) -> bool:
    return not name.startswith("/") and ".." not in Path(name).parts and os.sep + os.sep not in name


class _WindowBar(threading.Thread):
    """A rich progress bar over the profile window, then 'processing' until the answer."""

    def __init__(self, seconds: float, done: threading.Event):
        super().__init__(daemon=True)
        self.seconds = seconds
        self.done = done

    def run(self) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=True) as p:
            task = p.add_task(f"profiling for {self.seconds:g} s", total=self.seconds)
            t0 = time.monotonic()
            while not self.done.wait(0.1):
                elapsed = time.monotonic() - t0
                p.update(task, completed=min(elapsed, self.seconds))
                if elapsed >= self.seconds:
                    p.update(task, description="writing flame graph, speedscope profile and trace")
