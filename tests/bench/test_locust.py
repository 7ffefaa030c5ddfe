"""The locustfile runs headless against the fake server and reports TTFT / TPOT / E2E rows."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sluice.bench

LOCUSTFILE = Path(sluice.bench.__file__).parent / "locustfile.py"


@pytest.mark.slow
def test_locustfile_reports_ttft_through_locust_events(fake_server, tmp_path):
    if shutil.which("locust") is None and not (Path(sys.executable).parent / "locust").exists():
        pytest.skip("locust is not installed (dev extra)")
    srv = fake_server(ttft_ms=60, tokens_per_s=200, error_rate=0.1, model="served-model")
    locust = str(Path(sys.executable).parent / "locust")
    out = subprocess.run(
        [locust, "-f", str(LOCUSTFILE), "--host", srv.url, "--headless", "-u", "3", "-r", "3",
         "-t", "3s", "--bench-output-len", "6", "--bench-input-len", "10",
         "--csv", str(tmp_path / "run"), "--only-summary", "--exit-code-on-error", "0"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["Type"]: r for r in csv.DictReader((tmp_path / "run_stats.csv").open())}
    assert {"TTFT", "TPOT", "E2E", "POST"} <= set(rows), f"missing rows: {list(rows)}"
    ttft = rows["TTFT"]
    assert int(ttft["Request Count"]) > 10
    assert 55 <= float(ttft["Median Response Time"]) <= 90, "TTFT should be the fake's 60 ms"
    assert 3 <= float(rows["TPOT"]["Median Response Time"]) <= 8, "TPOT should be 1/200 s"
    post = rows["POST"]
    assert int(post["Failure Count"]) >= 1, "the fake's HTTP 500s are locust failures"
    assert "Traceback" not in out.stderr
    models = {b.get("model") for b in srv.server.bodies}
    assert models == {"served-model"}, f"no --bench-model: the model GET /v1/models lists, as sluice bench: {models}"
