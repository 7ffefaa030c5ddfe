"""PNG plots of a run (matplotlib, Agg backend; imported only when ``--out`` is given).

    latency_cdf.png  CDFs of TTFT and end-to-end latency, one line per priority class
    timeline.png     completed requests/s and p95 TTFT per second of the run (finer bins if short)
    sweep.png        (sweeps) p95 TTFT / E2E and req/s against the load, contract lines drawn
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from sluice.bench.record import RequestRecord  # noqa: E402

__all__ = ["write_plots"]


def _cdf(ax: Any, values_ms: Sequence[float], label: str) -> None:
    if not values_ms:
        return
    x = np.sort(np.asarray(values_ms))
    ax.plot(x, np.arange(1, x.size + 1) / x.size, label=f"{label} (n={x.size})")


def _latency_cdf(path: Path, records: Sequence[RequestRecord]) -> None:
    ok = [r for r in records if r.is_ok]
    classes = sorted({r.priority for r in ok})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name, get in (
        (axes[0], "TTFT", lambda r: r.ttft_s),
        (axes[1], "end-to-end latency", lambda r: r.e2e_s),
    ):
        groups = [("all", ok)] + ([(c, [r for r in ok if r.priority == c]) for c in classes] if len(classes) > 1 else [])  # fmt: skip
        for label, rs in groups:
            _cdf(ax, [v * 1000 for r in rs if (v := get(r)) is not None], label)
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.01))
        ax.grid(alpha=0.3)
        if ok:
            ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _timeline(path: Path, records: Sequence[RequestRecord]) -> None:
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    if records:
        end = max(r.end_s for r in records)
        # NOTE(bins): 1 s bins, finer for short runs so that they still show a shape
        width = 1.0 if end >= 30 else max(0.05, end / 30)
        nbins = max(1, int(np.ceil(end / width)))

        def bin_of(r: RequestRecord) -> int:
            return min(nbins - 1, int(r.end_s / width))

        ok = [r for r in records if r.is_ok]
        counts = np.bincount([bin_of(r) for r in ok], minlength=nbins) / width
        errs = np.bincount([bin_of(r) for r in records if not r.is_ok], minlength=nbins) / width
        t = (np.arange(nbins) + 0.5) * width
        ax1.plot(t, counts, marker=".", label="completed req/s")
        if errs.any():
            ax1.plot(t, errs, marker="x", color="tab:red", label="errors/s")
        ax1.legend(loc="upper left")
        by_bin: dict[int, list[float]] = {}
        for r in ok:
            if r.ttft_s is not None:
                by_bin.setdefault(bin_of(r), []).append(r.ttft_s * 1000)
        xs = sorted(by_bin)
        ax2.plot([(x + 0.5) * width for x in xs], [np.percentile(by_bin[x], 95) for x in xs], marker=".", color="tab:orange")  # fmt: skip
    ax1.set(title="Throughput over time", ylabel="requests / s")
    ax2.set(title="p95 TTFT over time", ylabel="ms", xlabel="seconds since start")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _sweep(path: Path, doc: dict[str, Any]) -> None:
    phases = doc["phases"]
    levels = [p["load"]["level"] for p in phases]
    mode = phases[0]["load"]["mode"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("ttft_ms", "TTFT p95"), ("e2e_ms", "E2E p95"), ("tpot_ms", "TPOT p95")):
        ys = [p["summary"][key]["p95"] if p["summary"].get(key) else np.nan for p in phases]
        line = ax1.plot(levels, ys, marker="o", label=label)[0]
        for t in phases[0]["targets"]:
            if t["target"] == key.replace("_ms", "_p95_ms"):
                ax1.axhline(t["threshold"], ls="--", color=line.get_color(), label=f"contract {label}")
    ax2.plot(levels, [p["summary"]["rps"] for p in phases], marker="o", label="achieved req/s")
    ax2.plot(levels, [p["summary"]["goodput_rps"] for p in phases], marker=".", label="goodput req/s")
    for t in phases[0]["targets"]:
        if t["target"] == "min_rps":
            ax2.axhline(t["threshold"], ls="--", color="tab:red", label="contract min req/s")
    best = doc.get("sustainable")
    for ax in (ax1, ax2):
        if best:
            ax.axvline(best["level"], ls=":", color="tab:green", label="sustainable")
        ax.set(xlabel=f"{mode} load ({'concurrency' if mode == 'closed' else 'req/s' if mode == 'poisson' else 'level'})")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    ax1.set(title="Latency vs load", ylabel="ms")
    ax2.set(title="Throughput vs load", ylabel="requests / s")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_plots(out_dir: Path, doc: dict[str, Any], records: Sequence[RequestRecord]) -> list[Path]:
    paths = [out_dir / "latency_cdf.png", out_dir / "timeline.png"]
    _latency_cdf(paths[0], records)
    _timeline(paths[1], records)
    if doc.get("phases"):
        paths.append(out_dir / "sweep.png")
        _sweep(paths[2], doc)
    return paths
