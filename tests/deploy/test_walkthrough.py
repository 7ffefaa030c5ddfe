"""``examples/operations/walkthrough.py`` runs: two replicas, a gateway, load, a
profile with its four files, the dashboard's panels with data, doctor's advice."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _free_block() -> int:
    """A port P with P, P+1 and P+999 free (the script's replicas and gateway)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
        if p + 999 > 65535:
            continue
        try:
            for q in (p, p + 1, p + 999):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    raise RuntimeError("no free ports")


def test_walkthrough_runs_end_to_end(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "examples/operations/walkthrough.py", "--out", str(tmp_path / "w"),
                        "--seconds", "12", "--profile-seconds", "2", "--port", str(_free_block())],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["profile_files"] == ["engine_trace.json", "flamegraph.svg", "profile.speedscope.json", "summary.json"]
    assert result["panels_with_data"] >= 15, f"the load must show on the dashboard's panels: {result}"
    assert "deploy/grafana/sluice.json panels" in r.stdout and ("advice" in r.stdout or "warning" in r.stdout)
