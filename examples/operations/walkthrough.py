"""The docs/operations.md walk-through in one script: two replicas and a gateway,
load, a flame graph, the dashboard's panels, and ``sluice doctor``'s advice.

    python examples/operations/walkthrough.py --out walkthrough/ [--seconds 30] [--port 8001]

1. starts two ``sluice serve`` replicas (SmolLM2, ports P and P+1, one core each
   when the machine has two or more) and ``sluice gateway`` on P+999 in front;
2. drives them with ``sluice bench run`` (mixed p0/p1/p2) through the gateway;
3. while the load runs, takes a profile of replica 1 with ``sluice profile``
   (flame graph SVG, speedscope, engine trace) into OUT/profile/;
4. evaluates every panel of deploy/grafana/sluice.json: with a local
   ``prometheus`` binary (Debian: apt-get install prometheus) it scrapes the
   three processes and runs each panel's PromQL; without one it shows the raw
   samples of each panel's metrics from ``/metrics``;
5. prints ``sluice doctor``'s warnings and fixes, and stops everything.

The last stdout line is one JSON document (files written, panels with data).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
SLUICE = [sys.executable, "-m", "sluice.cli"]
RATE_WINDOW = "10s"  # $__rate_interval with 1 s scrapes


def log(msg: str) -> None:
    print(f"[walkthrough] {msg}", flush=True)


class Procs:
    """Child process groups, stopped with SIGTERM (the replicas drain) on exit."""

    def __init__(self, out: Path):
        self.out = out
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log_file = (self.out / f"{name}.log").open("wb")
        p = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited (see its log)")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"{url} not healthy after {timeout:.0f} s")


def start_prometheus(procs: Procs, out: Path, targets: dict[str, list[str]]) -> str | None:
    binary = shutil.which("prometheus")
    if binary is None:
        return None
    port = free_port()
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "5s"},
           "rule_files": [str(ROOT / "deploy/prometheus/rules.yml")],
           "scrape_configs": [{"job_name": job, "static_configs": [{"targets": t}]} for job, t in targets.items()]}  # fmt: skip
    (out / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    p = procs.start("prometheus", [binary, f"--config.file={out / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={out / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"])  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(60):
        if p.poll() is not None:
            return None
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                return url
        time.sleep(0.5)
    return None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def panels(doc: dict[str, Any]) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(row, panel title, [(PromQL, legend format)]) of every panel of the dashboard."""
    out, row = [], ""
    for p in doc["panels"]:
        if p["type"] == "row":
            row = p["title"]
            continue
        out.append((row, p["title"], [(t["expr"], t.get("legendFormat", "")) for t in p.get("targets", [])
                                      if t.get("expr")]))  # fmt: skip
    return out


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's legend format: ``p95 {{priority}}`` -> ``p95 p1``."""
    import re

    if fmt:
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in ("__name__", "job")) or "-"


def grafana_to_promql(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_WINDOW).replace('instance=~"$instance"', 'instance=~".*"')


def evaluate_with_prometheus(url: str, doc: dict[str, Any], at: float) -> list[dict[str, Any]]:
    """Each panel's queries at time ``at`` (unix seconds), series named by the panel's legend."""
    rows = []
    for row, title, exprs in panels(doc):
        series = []
        for expr, fmt in exprs:
            params = {"query": grafana_to_promql(expr), "time": f"{at:.3f}"}
            r = httpx.get(url + "/api/v1/query", params=params, timeout=10).json()
            for s in r.get("data", {}).get("result", []):
                value = float(s["value"][1])
                if value == value:  # NaN: no traffic in the window for that ratio
                    series.append((legend(fmt, s["metric"]), value))
        rows.append({"row": row, "panel": title, "series": series})
    return rows


def evaluate_from_metrics(texts: list[str], doc: dict[str, Any]) -> list[dict[str, Any]]:
    """No Prometheus: the samples behind each panel, summed over the processes."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                samples[s.name] = samples.get(s.name, 0.0) + s.value
    rows = []
    for row, title, exprs in panels(doc):
        names = sorted({n for e, _ in exprs for n in re.findall(r"\b(sluice_[a-z0-9_]+)", e)})
        series = [(n.removesuffix("_bucket") + "_count" if n.endswith("_bucket") else n,
                   samples.get(n.removesuffix("_bucket") + "_count" if n.endswith("_bucket") else n, float("nan")))
                  for n in names]  # fmt: skip
        rows.append({"row": row, "panel": title, "series": [(k, v) for k, v in series if v == v]})
    return rows


def show_panels(rows: list[dict[str, Any]], how: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"deploy/grafana/sluice.json panels ({how})", show_lines=False)
    for col in ("row", "panel", "series = value"):
        table.add_column(col, overflow="fold")
    for r in rows:
        shown = "; ".join(f"{k} = {v:.4g}" for k, v in r["series"][:6]) or "(no data)"
        table.add_row(r["row"], r["panel"], shown)
    Console(width=160).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("walkthrough"))
    ap.add_argument("--seconds", type=float, default=30.0, help="load duration")
    ap.add_argument("--profile-seconds", type=float, default=5.0)
    ap.add_argument("--port", type=int, default=8001, help="replica 1's port (replica 2: +1, gateway: +999)")
    ap.add_argument("--kv-cache-memory", default="64MiB")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    procs = Procs(out)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    ports = [args.port, args.port + 1]
    gw_port = args.port + 999
    result: dict[str, Any] = {"out": str(out)}
    try:
        # 1. two replicas and a gateway
        urls = []
        for i, port in enumerate(ports):
            pin = ["--cpu-affinity", str(cores[i % len(cores)])] if len(cores) >= 2 else []
            argv = [*SLUICE, "serve", "--model", "smollm2", "--port", str(port), "--kv-cache-memory",
                    args.kv_cache_memory, "--profile-dir", str(out / f"profiles-{port}"), *pin]  # fmt: skip
            log(" ".join(["sluice", *argv[3:]]))
            procs.start(f"replica-{port}", argv)
            urls.append(f"http://127.0.0.1:{port}")
        for url, p in zip(urls, procs.procs):
            wait_healthy(url, p)
        gw_cfg = yaml.safe_load((ROOT / "examples/operations/two_replicas.yaml").read_text())
        gw_cfg["port"] = gw_port
        gw_cfg["models"]["smollm2"]["versions"][0]["replicas"] = urls
        (out / "gateway.yaml").write_text(yaml.safe_dump(gw_cfg))
        gateway_url = f"http://127.0.0.1:{gw_port}"
        log(f"sluice gateway --config {out / 'gateway.yaml'}")
        gw = procs.start("gateway", [*SLUICE, "gateway", "--config", str(out / "gateway.yaml")])
        wait_healthy(gateway_url, gw)
        prom = start_prometheus(procs, out, {"sluice-serve": [u.removeprefix("http://") for u in urls],
                                             "sluice-gateway": [gateway_url.removeprefix("http://")]})  # fmt: skip
        log(f"prometheus: {prom or 'not installed (panels from /metrics instead)'}")

        # 2. load through the gateway
        bench = [*SLUICE, "bench", "run", "--url", gateway_url, "--concurrency", "4", "--duration",
                 f"{args.seconds:g}s", "--input-len", "64", "--output-len", "32", "--priority-mix",
                 "p0=0.2,p1=0.5,p2=0.3", "--no-progress", "--out", str(out / "bench")]  # fmt: skip
        log(" ".join(["sluice", *bench[3:]]))
        load = subprocess.Popen(bench, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
        t_load = time.time()

        # 3. a flame graph while the load runs
        time.sleep(min(5.0, args.seconds / 4))
        prof = [*SLUICE, "profile", urls[0], "--seconds", f"{args.profile_seconds:g}", "--out", str(out / "profile")]
        log(" ".join(["sluice", *prof[3:]]))
        r = subprocess.run(prof, capture_output=True, text=True, cwd=ROOT)
        print(r.stdout, r.stderr, sep="", end="")
        result["profile_files"] = sorted(p.name for p in (out / "profile").glob("*")) if r.returncode == 0 else []
        bench_out = load.communicate(timeout=args.seconds + 120)[0].decode()
        print("\n".join(bench_out.splitlines()[-12:-1]))

        # 4. the dashboard's panels
        doc = json.loads((ROOT / "deploy/grafana/sluice.json").read_text())
        if prom:
            at = min(time.time(), t_load + args.seconds * 0.8)  # while the load ran
            rows = evaluate_with_prometheus(prom, doc, at)
            how = f"PromQL on a local Prometheus {time.time() - at:.0f} s ago, during the load, rate window {RATE_WINDOW}"
        else:
            texts = [httpx.get(u + "/metrics", timeout=5).text for u in [*urls, gateway_url]]
            rows, how = evaluate_from_metrics(texts, doc), "raw /metrics samples"
        show_panels(rows, how)
        result["panels"] = len(rows)
        result["panels_with_data"] = sum(1 for r in rows if r["series"])

        # 5. sluice doctor's advice
        d = subprocess.run([*SLUICE, "doctor"], capture_output=True, text=True, cwd=ROOT)
        print(d.stdout, end="")
        result["doctor_warnings"] = sum(1 for ln in d.stdout.splitlines() if ln.startswith("warning"))
    finally:
        log("stopping (SIGTERM: the replicas drain)")
        procs.stop()
    print(json.dumps(result))
    return 0 if result.get("profile_files") and result.get("panels_with_data") else 1


if __name__ == "__main__":
    sys.exit(main())
