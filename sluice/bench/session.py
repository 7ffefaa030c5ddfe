"""One ``sluice bench`` invocation: a run (one phase) or a sweep (one phase per level).

``execute(cfg, stop=...)`` owns the client (one connection pool for the whole
session), the live display and the phases, and returns the run document plus
every record.  The CLI turns flags into ``BenchConfig`` and the document into
tables, files and an exit code.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sluice.bench.arrivals import LoadSpec
from sluice.bench.client import OpenAIStreamClient
from sluice.bench.contract import Contract
from sluice.bench.live import LiveDisplay
from sluice.bench.record import RequestRecord
from sluice.bench.report import phase_document
from sluice.bench.runner import LiveStats, run_phase
from sluice.bench.server_metrics import scrape, speculation_report
from sluice.bench.sweep import should_continue, sustainable
from sluice.bench.workload import WorkloadSpec, generate_requests

__all__ = ["BenchConfig", "execute", "resolve_model", "workload_dict"]


@dataclass(frozen=True)
class BenchConfig:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    workload: WorkloadSpec
    loads: tuple[LoadSpec, ...]  # one for a run; the levels of a sweep
    max_requests: int  # per phase
    duration_s: float  # per phase
    model: str | None = None  # None: the first of GET /v1/models
    api_key: str | None = None
    is_sweep: bool = False
    timeout_s: float = 60.0  # per request
    seed: int = 0
    contract: Contract | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    show_progress: bool = False


async def resolve_model(url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    """The first model the server lists; a readable ``ValueError`` when it cannot."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:  # noqa: SIM117
            async with s.get(url.rstrip("/") + "/v1/models", headers=headers) as resp:
                body = await resp.json(content_type=None)
                return str(body["data"][0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"cannot list models at {url}/v1/models ({type(e).__name__}); pass --model") from None  # fmt: skip


def workload_dict(w: WorkloadSpec) -> dict[str, Any]:
    d: dict[str, Any] = {"api": w.api.value, "ignore_eos": w.ignore_eos}
    if w.trace:
        d["trace_requests"] = len(w.trace)
    else:
        d.update(input_len=str(w.input_len), output_len=str(w.output_len))
    if w.prefix_groups:
        d.update(prefix_groups=w.prefix_groups, prefix_len=w.prefix_len)
    d["priority_mix"] = {p.label: f for p, f in w.priority_mix.items()}
    return d


async def execute(cfg: BenchConfig, stop: asyncio.Event | None = None) -> tuple[dict[str, Any], list[RequestRecord]]:
    stop = stop or asyncio.Event()
    model = cfg.model or await resolve_model(cfg.url, cfg.api_key)
    stats = LiveStats()
    records: list[RequestRecord] = []
    phases: list[dict[str, Any]] = []
    run_t0 = time.perf_counter()
    client = OpenAIStreamClient(
        cfg.url, model=model, api=cfg.workload.api, api_key=cfg.api_key, timeout_s=cfg.timeout_s,
        ignore_eos=cfg.workload.ignore_eos, extra_body=cfg.extra_body,
    )  # fmt: skip
    metrics_session = aiohttp.ClientSession()  # the server's own counters, read around each phase
    async with metrics_session, client, LiveDisplay(stats, enabled=cfg.show_progress) as display:
        before = await scrape(metrics_session, cfg.url, cfg.api_key)
        for i, load in enumerate(cfg.loads):
            if cfg.is_sweep:
                display.label = f"step {i + 1}/{len(cfg.loads)} {load.mode.value} {load.level:g}: "
            # NOTE(seeds): every phase replays the same request sequence, so the
            # steps of a sweep differ only by the load.
            result = await run_phase(
                client, generate_requests(cfg.workload, cfg.seed), load,
                max_requests=cfg.max_requests, duration_s=cfg.duration_s,
                drain_s=cfg.timeout_s, stop=stop, phase=i, seed=cfg.seed, live=stats,
                run_t0=run_t0,
            )  # fmt: skip
            records += result.records
            phases.append(phase_document(result, cfg.contract))
            after = await scrape(metrics_session, cfg.url, cfg.api_key)
            spec = speculation_report(before, after)
            if spec is not None:  # NOTE(server-counters) in server_metrics
                phases[-1]["speculation"] = spec
            before = after  # the next phase starts where this one ended: one read between two phases
            if stop.is_set() or (cfg.contract and not should_continue([p["passed"] for p in phases])):  # fmt: skip
                break
    doc: dict[str, Any] = {
        "kind": "sweep" if cfg.is_sweep else "run",
        "url": cfg.url,
        "model": model,
        "seed": cfg.seed,
        "workload": workload_dict(cfg.workload),
        "caps": {"max_requests": cfg.max_requests, "duration_s": cfg.duration_s, "timeout_s": cfg.timeout_s},  # fmt: skip
        "contract": cfg.contract.name if cfg.contract else None,
        "is_interrupted": stop.is_set(),
    }
    if cfg.contract and cfg.contract.settings:
        doc["settings"] = cfg.contract.settings
    if not cfg.is_sweep:
        doc.update(phases[0])
        return doc, records
    best = sustainable(phases) if cfg.contract else None
    doc["phases"] = phases
    doc["sustainable"] = best
    doc["passed"] = (best is not None) if cfg.contract else None
    # compare() reads "summary": the sustainable step, else the last one.
    doc["summary"] = phases[best["phase"] if best else -1]["summary"]
    doc["load"] = phases[best["phase"] if best else -1]["load"]
    return doc, records
