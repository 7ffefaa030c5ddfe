"""``sluice bench`` end to end against the fake server: exit codes, files, sweep, compare."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sluice.bench.record import CSV_COLUMNS

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = ["--input-len", "16", "--output-len", "4", "--no-progress", "--model", "m"]


def write(path, text: str):
    path.write_text(text)
    return str(path)


def test_run_that_holds_exits_0_and_writes_well_formed_files(fake_server, bench, tmp_path):
    srv = fake_server(ttft_ms=5)
    contract = write(tmp_path / "c.yaml", "targets: {ttft_p95_ms: 500, max_error_rate: 0, min_goodput_ratio: 1}\n")  # fmt: skip
    out = tmp_path / "out"
    r = bench("run", "--url", srv.url, "-n", "40", "--concurrency", "4", "--contract", contract,
              "--priority-mix", "p0=0.5,p2=0.5", "--out", str(out), *SMALL)  # fmt: skip
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.doc
    assert doc["passed"] is True and doc["summary"]["num_requests"] == 40
    assert set(doc["summary"]["by_priority"]) == {"p0", "p2"}
    assert "CONTRACT HOLDS" in r.stdout and "PASS" in r.stdout
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert len(rows) == 40 and list(rows[0]) == CSV_COLUMNS, "one CSV row per request"
    assert all(float(x["ttft_s"]) > 0 and x["error"] == "" for x in rows)
    assert json.loads((out / "summary.json").read_text()) == doc, "summary.json is the JSON line"
    for name in ("latency_cdf.png", "timeline.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, f"{name} is not a real PNG"


def test_failing_target_exits_1_and_counts_errors_exactly(fake_server, bench):
    srv = fake_server(error_rate=0.05)
    r = bench("run", "--url", srv.url, "-n", "100", "--concurrency", "8", "--contract", "latency", *SMALL)  # fmt: skip
    assert r.exit_code == 1, "a 5% error rate breaks the latency preset's 0.3%"
    doc = r.doc
    assert doc["summary"]["num_errors"] == 5, "100 requests at error rate 0.05: exactly 5"
    failing = [t["target"] for t in doc["targets"] if not t["passed"]]
    assert failing == ["max_error_rate"]
    assert doc["load"] == {"mode": "closed", "level": 8, "concurrency": 8}, "flags beat the preset's load"  # fmt: skip
    assert "FAIL" in r.stdout and "CONTRACT FAILS" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--input-len", "zipf:2"], "invalid length"),
        (["--concurrency", "2", "--rate", "5"], "only one of"),
        (["--contract", "nope"], "neither a file nor a preset"),
        (["--workload", "/nonexistent.yaml"], "does not exist"),
        (["--url", "localhost:8000"], "invalid --url"),
        (["--duration", "soon"], "invalid duration"),
        (["--priority-mix", "p7=1"], "invalid priority"),
        (["--extra-body", "[1]"], "JSON object"),
    ],
)
def test_usage_errors_exit_2_with_one_readable_line(bench, args, message):
    r = bench("run", "--model", "m", *args)
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sluice bench: error:") and message in lines[0], r.stderr  # fmt: skip


def test_unreachable_server_without_model_is_a_usage_error(bench):
    r = bench("run", "--url", "http://127.0.0.1:9", "-n", "1")
    assert r.exit_code == 2 and "cannot list models" in r.stderr


def test_model_is_discovered_and_workload_file_and_trace_are_used(fake_server, bench, tmp_path):
    srv = fake_server(model="tiny-llm")
    write(tmp_path / "t.jsonl", "\n".join(json.dumps({"timestamp": i * 0.01, "prompt_len": 5, "max_tokens": 3}) for i in range(10)))  # fmt: skip
    wl = write(tmp_path / "w.yaml", "api: completions\ntrace: t.jsonl\n")
    r = bench("run", "--url", srv.url, "--workload", wl, "--no-progress")
    assert r.exit_code == 0, r.stderr
    doc = r.doc
    assert doc["model"] == "tiny-llm" and doc["workload"]["api"] == "completions"
    assert doc["load"]["mode"] == "trace" and doc["summary"]["num_requests"] == 10
    assert doc["summary"]["mean_output_tokens"] == 3


def test_sweep_finds_the_knee_of_a_server_that_slows_past_a_known_load(fake_server, bench, tmp_path):
    # below 4 in flight TTFT is 10 ms; each request beyond adds 40 ms to the next TTFT
    srv = fake_server(ttft_ms=10, knee_concurrency=4, knee_ttft_ms=40)
    contract = write(tmp_path / "c.yaml", "targets: {ttft_p95_ms: 60, max_error_rate: 0}\n")
    for attempt in range(2):  # a loaded 2-core host can stall a level below the knee past 60 ms (a suite run
        out = tmp_path / f"sweep{attempt}"  # saw the knee "at 2"): one more sweep, the same bounds
        r = bench("sweep", "--url", srv.url, "--concurrencies", "1,2,4,8,16", "-n", "40",
                  "--contract", contract, "--out", str(out), *SMALL)  # fmt: skip
        assert r.exit_code == 0, r.stdout + r.stderr
        doc = r.doc
        if doc["sustainable"]["level"] == 4:
            break
    assert doc["sustainable"]["level"] == 4, f"the knee is at 4 in flight, found {doc['sustainable']}"
    assert [p["passed"] for p in doc["phases"]] == [True, True, True, False], "stops after the knee"
    assert (out / "sweep.png").read_bytes().startswith(PNG)
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert {x["phase"] for x in rows} == {"0", "1", "2", "3"} and len(rows) == 160


def test_sweep_that_never_holds_exits_1(fake_server, bench, tmp_path):
    srv = fake_server(ttft_ms=30)
    contract = write(tmp_path / "c.yaml", "targets: {ttft_p50_ms: 5}\n")
    r = bench("sweep", "--url", srv.url, "--rates", "20,40", "-n", "10", "--contract", contract, *SMALL)  # fmt: skip
    assert r.exit_code == 1 and r.doc["sustainable"] is None
    assert "none: the contract failed at every step" in r.stdout


def _doc(rps: float, ttft_p95: float) -> dict:
    lat = {"p50": ttft_p95 / 2, "p95": ttft_p95, "p99": ttft_p95 * 1.2}
    return {"summary": {"rps": rps, "output_tok_s": rps * 10, "goodput_rps": rps, "error_rate": 0.0, "ttft_ms": lat, "e2e_ms": lat, "tpot_ms": None, "itl_ms": None}}  # fmt: skip


def test_compare_prints_ratios_and_gates_regressions(bench, tmp_path):
    a = write(tmp_path / "a.json", json.dumps(_doc(100, 200)))
    b = write(tmp_path / "b.json", json.dumps(_doc(120, 300)))
    r = bench("compare", a, b)
    assert r.exit_code == 0, "without --max-regression compare only reports"
    rows = {x["metric"]: x for x in r.doc["rows"]}
    assert rows["req/s"]["ratio"] == pytest.approx(1.2)
    assert rows["TTFT p95 ms"]["ratio"] == pytest.approx(1.5)
    assert rows["TPOT p50 ms"]["ratio"] is None
    assert "1.50x" in r.stdout
    r = bench("compare", a, b, "--max-regression", "0.1")
    assert r.exit_code == 1 and "TTFT p95 ms" in r.doc["regressions"]
    assert "req/s" not in r.doc["regressions"], "higher throughput is not a regression"
    r = bench("compare", a, str(tmp_path / "missing.json"))
    assert r.exit_code == 2 and "no such file" in r.stderr


def test_bench_cli_imports_no_torch_no_engine_no_locust():
    code = (
        "import sys, sluice.bench.cli, sluice.bench.session, sluice.bench.fake_server;"
        "bad=[m for m in sys.modules if m.split('.')[0] in ('torch','locust','gevent') or m.startswith(('sluice.engine','sluice.models','sluice.server','sluice.kernels'))];"
        "print(bad)"
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"sluice.bench must stay torch- and engine-free: {out.stdout}"


@pytest.mark.slow
def test_ctrl_c_stops_sending_and_still_reports(fake_server, tmp_path):
    srv = fake_server(ttft_ms=200)
    out = tmp_path / "o"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(
        [sys.executable, "-m", "sluice.bench", "run", "--url", srv.url, "--concurrency", "4",
         "-n", "100000", "-d", "60s", "--out", str(out), *SMALL],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        time.sleep(2.5)  # interpreter start-up plus a few requests
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, stderr
    doc = json.loads(stdout.strip().splitlines()[-1])
    assert doc["is_interrupted"] is True and doc["summary"]["num_requests"] >= 4
    assert doc["summary"]["num_errors"] == 0, "in-flight requests finish within the grace"
    assert (out / "summary.json").exists(), "the report is still written after Ctrl-C"


def test_progress_line_goes_to_stderr_and_stdout_still_ends_with_json(fake_server, bench):
    srv = fake_server()
    r = bench("run", "--url", srv.url, "-n", "10", "--concurrency", "2", "--progress", "--model", "m", "--output-len", "2")  # fmt: skip
    assert r.exit_code == 0
    assert "sent 10" in r.stderr and "done 10" in r.stderr, r.stderr
    assert r.doc["summary"]["num_ok"] == 10


@pytest.mark.parametrize(
    "flags, load",
    [
        (["--rate", "80"], {"mode": "poisson", "level": 80.0, "rate": 80.0}),
        (["--users", "4", "--spawn-rate", "40"], {"mode": "ramp", "level": 4, "users": 4, "spawn_rate": 40.0}),  # fmt: skip
        ([], {"mode": "closed", "level": 8, "concurrency": 8}),
    ],
)
def test_load_flags_choose_the_arrival_pattern(fake_server, bench, flags, load):
    srv = fake_server()
    r = bench("run", "--url", srv.url, "-n", "16", *flags, *SMALL)
    assert r.exit_code == 0, r.stderr
    assert r.doc["load"] == load and r.doc["summary"]["num_ok"] == 16
