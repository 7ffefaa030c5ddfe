"""The seed's locust run against the default server: 200 users, spawn rate 20, no wait between requests
(issue 57).  With the default flags it completes at least 0.9x what ``--slo off`` completes, with no 429.

A real ``sluice serve`` API process over the fake engine core (16 slots, 20-ms steps), the shipped
locustfile with no ``--bench-model`` (it asks ``GET /v1/models``).  About 50 s: marked slow.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

import sluice.bench

LOCUSTFILE = Path(sluice.bench.__file__).parent / "locustfile.py"
LOCUST = Path(sys.executable).parent / "locust"


def _locust(url: str, out: Path, seconds: int) -> dict[str, dict[str, str]]:
    run = subprocess.run(
        [str(LOCUST), "-f", str(LOCUSTFILE), "--host", url, "--headless", "-u", "200", "-r", "20",
         "-t", f"{seconds}s", "--bench-input-len", "16", "--bench-output-len", "16", "--bench-api", "completions",
         "--csv", str(out), "--only-summary", "--exit-code-on-error", "0", "--stop-timeout", "5"],
        capture_output=True, text=True, timeout=seconds + 40, cwd=out.parent,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return {r["Type"] + " " + r["Name"]: r for r in csv.DictReader(Path(f"{out}_stats.csv").open())}


@pytest.mark.slow
def test_the_seed_locust_run_completes_as_much_as_slo_off_with_no_429(server_factory, tmp_path) -> None:
    if not LOCUST.exists():
        pytest.skip("locust is not installed (dev extra)")
    done = {}
    for slo in ("auto", "off"):
        srv = server_factory(step_delay=0.02, max_num_seqs=16, slo=slo)
        rows = _locust(srv.url, tmp_path / slo, 20)
        post = rows["POST /v1/completions"]
        assert int(post["Failure Count"]) == 0, f"--slo {slo}: every request is queued and served: {post}"
        assert int(rows["GET /v1/models"]["Failure Count"]) == 0, "the locustfile asks the server for its model"
        done[slo] = int(rows["E2E /v1/completions"]["Request Count"])
        srv.stop()
    assert done["auto"] >= 0.9 * done["off"], f"completed requests, default flags vs --slo off: {done}"
