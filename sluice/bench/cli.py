"""``sluice bench``: load-test any OpenAI-compatible endpoint against an SLA contract.

    sluice bench run     --url URL [workload flags] [--concurrency N | --rate R | --users U --spawn-rate S]
                         [--contract latency|throughput|cost|FILE.yaml] [--out DIR]
    sluice bench sweep   --url URL (--concurrencies 8,16,32 | --rates 50,100,150) --contract ...
    sluice bench compare A/summary.json B/summary.json [--max-regression 0.1]
    sluice bench presets

Exit codes: 0 every target holds (or no contract), 1 a target fails (or a
compare regression), 2 usage errors (one line on stderr).  The last stdout line
is one JSON document.  See docs/bench.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import yaml
from rich.console import Console

if TYPE_CHECKING:  # the CLI imports its layer lazily: `sluice --help` stays fast
    from sluice.bench.arrivals import LoadSpec
    from sluice.bench.contract import Contract
    from sluice.bench.record import RequestRecord
    from sluice.bench.session import BenchConfig
    from sluice.bench.workload import WorkloadSpec

__all__ = ["register", "bench_app", "parse_duration"]

bench_app = typer.Typer(
    name="bench",
    help="Load generator with SLA contracts, reports and plots, for any OpenAI-compatible endpoint.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Options shared by `run` and `sweep` (None: not given, so a preset or the workload file decides).
Url = Annotated[str, typer.Option("--url", envvar="SLUICE_BENCH_URL", help="Base URL of the OpenAI-compatible server.")]  # fmt: skip
Model = Annotated[str | None, typer.Option(help="Model name to send (default: the first of GET /v1/models).")]  # fmt: skip
ApiKey = Annotated[str | None, typer.Option(envvar="SLUICE_API_KEY", help="Bearer token, if the server wants one.")]  # fmt: skip
ApiOpt = Annotated[str | None, typer.Option("--api", help="chat (default) or completions.")]
ContractOpt = Annotated[str | None, typer.Option("--contract", "-c", help="Preset name (latency, throughput, cost) or a contract YAML file.")]  # fmt: skip
WorkloadFile = Annotated[Path | None, typer.Option("--workload", help="Workload YAML (keys as the flags, see docs/bench.md).")]  # fmt: skip
InputLen = Annotated[str | None, typer.Option(help="Prompt tokens: N, uniform:LO,HI, normal:MEAN,STD, lognormal:MEAN,SIGMA.")]  # fmt: skip
OutputLen = Annotated[str | None, typer.Option(help="max_tokens, same forms as --input-len.")]
PrefixGroups = Annotated[int | None, typer.Option(help="Shared-prefix workload: number of system prompts.")]  # fmt: skip
PrefixLen = Annotated[int | None, typer.Option(help="Tokens of each shared system prompt.")]
PriorityMix = Annotated[str | None, typer.Option(help="Fractions sent with x-priority, e.g. p0=0.1,p1=0.6,p2=0.3.")]  # fmt: skip
Trace = Annotated[Path | None, typer.Option(help="Replay a JSONL trace (timestamp, prompt or prompt_len, max_tokens).")]  # fmt: skip
TraceSpeed = Annotated[float, typer.Option(help="Replay the trace this many times faster.")]
MaxRequests = Annotated[int, typer.Option("--max-requests", "-n", help="Request cap (per step for a sweep).")]  # fmt: skip
Duration = Annotated[str, typer.Option("--duration", "-d", help="Duration cap: 90, 30s, 5m (per step for a sweep).")]  # fmt: skip
Timeout = Annotated[float, typer.Option(help="Per-request timeout, seconds.")]
Seed = Annotated[int, typer.Option(help="Seed of the workload and the arrivals.")]
Out = Annotated[Path | None, typer.Option("--out", "-o", help="Write requests.csv, summary.json and PNG plots here.")]  # fmt: skip
Progress = Annotated[bool | None, typer.Option("--progress/--no-progress", help="Live progress on stderr (default: when stderr is a terminal).")]  # fmt: skip
ExtraBody = Annotated[str | None, typer.Option(help='JSON merged into every request body, e.g. \'{"temperature": 0}\'.')]  # fmt: skip
IgnoreEos = Annotated[bool | None, typer.Option("--ignore-eos/--no-ignore-eos", help="Ask for exactly max_tokens (vLLM/sluice extension; default on).")]  # fmt: skip
ConstraintOpt = Annotated[str | None, typer.Option("--constraint", help="Constrained outputs: none, json_schema (response_format) or tools (tool_choice required).")]  # fmt: skip
ConstrainedFraction = Annotated[float | None, typer.Option(help="Fraction of the requests that carry --constraint (default 1).")]  # fmt: skip


def _usage_error(message: str) -> NoReturn:
    print(f"sluice bench: error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def parse_duration(text: str) -> float:
    """``90`` / ``90s`` / ``5m`` / ``1h`` / ``250ms`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(ms|s|m|h)?\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"invalid duration {text!r}: expected e.g. 90, 30s, 5m, 1h")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


def _workload(contract: Contract | None, workload_file: Path | None, flags: dict[str, Any]) -> WorkloadSpec:
    """Preset workload < --workload file < flags."""
    from sluice.bench.workload import (  # fmt: skip
        Api,
        WorkloadSpec,
        load_trace,
        parse_constraint,
        parse_length,
        parse_priority_mix,
        workload_from_dict,
    )

    kw: dict[str, Any] = {}
    if contract is not None and contract.workload:
        kw.update(workload_from_dict(contract.workload))
    if workload_file is not None:
        try:
            data = yaml.safe_load(workload_file.read_text())
        except FileNotFoundError:
            raise ValueError(f"workload file {str(workload_file)!r} does not exist") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{workload_file}: not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{workload_file}: a workload is a YAML mapping")
        kw.update(workload_from_dict(data, workload_file.parent))
    if flags["api"] is not None:
        try:
            kw["api"] = Api(flags["api"])
        except ValueError:
            raise ValueError(f"invalid --api {flags['api']!r}: expected chat or completions") from None
    for k in ("input_len", "output_len"):
        if flags[k] is not None:
            kw[k] = parse_length(flags[k])
    for k in ("prefix_groups", "prefix_len"):
        if flags[k] is not None:
            kw[k] = flags[k]
    if flags["priority_mix"] is not None:
        kw["priority_mix"] = parse_priority_mix(flags["priority_mix"])
    if flags["trace"] is not None:
        kw["trace"] = load_trace(flags["trace"])
    if flags["ignore_eos"] is not None:
        kw["ignore_eos"] = flags["ignore_eos"]
    if flags.get("constraint") is not None:
        kw["constraint"] = parse_constraint(flags["constraint"])
    if flags.get("constrained_fraction") is not None:
        kw["constrained_fraction"] = flags["constrained_fraction"]
    return WorkloadSpec(**kw)


def _config(
    *, url: str, model: str | None, api_key: str | None, contract: Contract | None,
    workload_file: Path | None, flags: dict[str, Any], loads: Callable[[WorkloadSpec], list[LoadSpec]], is_sweep: bool,
    max_requests: int, duration: str, timeout: float, seed: int, progress: bool | None,
    extra_body: str | None,
) -> BenchConfig:  # fmt: skip
    from sluice.bench.session import BenchConfig

    workload = _workload(contract, workload_file, flags)
    if max_requests < 1:
        raise ValueError("--max-requests must be >= 1")
    if not timeout > 0:
        raise ValueError("--timeout must be > 0")
    extra: dict[str, Any] = {}
    if extra_body:
        try:
            extra = json.loads(extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    if not re.match(r"^https?://", url):
        raise ValueError(f"invalid --url {url!r}: expected http://host:port")
    return BenchConfig(
        url=url, workload=workload, loads=tuple(loads(workload)), max_requests=max_requests,
        duration_s=parse_duration(duration), model=model, api_key=api_key, is_sweep=is_sweep,
        timeout_s=timeout, seed=seed, contract=contract, extra_body=extra,
        show_progress=sys.stderr.isatty() if progress is None else progress,
    )  # fmt: skip


async def _execute_with_sigint(cfg: BenchConfig) -> tuple[dict[str, Any], list[RequestRecord]]:
    """First Ctrl-C: stop sending, drain briefly, still report.  Second: abort."""
    from sluice.bench.session import execute

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        print("\nsluice bench: stopping (Ctrl-C again to abort)", file=sys.stderr)
        stop.set()

    installed = False
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        installed = True
    try:
        return await execute(cfg, stop)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


def _finish(cfg: BenchConfig, out: Path | None) -> None:
    """Run, print the tables and the JSON line, write files, exit with the contract's verdict."""
    from sluice.bench.aio import run_event_loop
    from sluice.bench.report import print_report, write_outputs

    try:
        doc, records = run_event_loop(_execute_with_sigint(cfg))
    except ValueError as e:
        _usage_error(str(e))
    except KeyboardInterrupt:  # the second Ctrl-C: no report
        print("sluice bench: aborted", file=sys.stderr)
        raise typer.Exit(130) from None
    console = Console(soft_wrap=True)
    print_report(doc, console)
    if out is not None:
        for p in write_outputs(out, doc, records):
            console.print(f"wrote {p}")
    print(json.dumps(doc, sort_keys=True, allow_nan=False), flush=True)
    raise typer.Exit(1 if doc.get("passed") is False else 0)


def _load_contract(name_or_path: str | None) -> Contract | None:
    from sluice.bench.contract import load_contract

    return load_contract(name_or_path) if name_or_path else None


@bench_app.command("run")
def run_cmd(
    url: Url = "http://127.0.0.1:8000",
    model: Model = None,
    api_key: ApiKey = None,
    api: ApiOpt = None,
    contract: ContractOpt = None,
    workload: WorkloadFile = None,
    input_len: InputLen = None,
    output_len: OutputLen = None,
    prefix_groups: PrefixGroups = None,
    prefix_len: PrefixLen = None,
    priority_mix: PriorityMix = None,
    trace: Trace = None,
    trace_speed: TraceSpeed = 1.0,
    concurrency: Annotated[int | None, typer.Option(help="Closed loop: requests in flight.")] = None,
    rate: Annotated[float | None, typer.Option(help="Open loop: Poisson arrivals, requests/s.")] = None,
    users: Annotated[int | None, typer.Option(help="Ramp: users (closed-loop each), like locust.")] = None,
    spawn_rate: Annotated[float, typer.Option(help="Ramp: users started per second.")] = 10.0,
    max_requests: MaxRequests = 1000,
    duration: Duration = "60s",
    timeout: Timeout = 60.0,
    seed: Seed = 0,
    out: Out = None,
    progress: Progress = None,
    extra_body: ExtraBody = None,
    ignore_eos: IgnoreEos = None,
    constraint: ConstraintOpt = None,
    constrained_fraction: ConstrainedFraction = None,
) -> None:
    """One load phase; reports every figure and checks the contract."""
    from sluice.bench.arrivals import LoadMode, LoadSpec

    try:
        c = _load_contract(contract)
        given = [x for x in (concurrency, rate, users) if x is not None]
        if len(given) > 1:
            raise ValueError("give only one of --concurrency, --rate, --users")
        flags = dict(api=api, input_len=input_len, output_len=output_len, prefix_groups=prefix_groups, prefix_len=prefix_len, priority_mix=priority_mix, trace=trace, ignore_eos=ignore_eos, constraint=constraint, constrained_fraction=constrained_fraction)  # fmt: skip
        if not given:
            preset = c.load if c is not None else {}
            concurrency, rate, users = (preset.get(k) for k in ("concurrency", "rate", "users"))
            spawn_rate = float(preset.get("spawn_rate", spawn_rate))
            if concurrency is None and rate is None and users is None:
                concurrency = 8

        def load_for(w: WorkloadSpec) -> list[LoadSpec]:
            """A trace replays at its own times unless a load flag is given."""
            if w.trace and not given:
                return [LoadSpec(LoadMode.TRACE, trace_speed=trace_speed)]
            if concurrency is not None:
                return [LoadSpec(LoadMode.CLOSED, concurrency=int(concurrency))]
            if rate is not None:
                return [LoadSpec(LoadMode.POISSON, rate=float(rate))]
            return [LoadSpec(LoadMode.RAMP, users=int(users or 0), spawn_rate=spawn_rate)]

        cfg = _config(
            url=url, model=model, api_key=api_key, contract=c, workload_file=workload,
            flags=flags, loads=load_for, is_sweep=False, max_requests=max_requests,
            duration=duration, timeout=timeout, seed=seed, progress=progress, extra_body=extra_body,
        )  # fmt: skip
    except ValueError as e:
        _usage_error(str(e))
    _finish(cfg, out)


@bench_app.command("sweep")
def sweep_cmd(
    url: Url = "http://127.0.0.1:8000",
    concurrencies: Annotated[str | None, typer.Option(help="Closed-loop steps, e.g. 8,16,32,64.")] = None,
    rates: Annotated[str | None, typer.Option(help="Open-loop Poisson steps (req/s), e.g. 50,100,150.")] = None,
    model: Model = None,
    api_key: ApiKey = None,
    api: ApiOpt = None,
    contract: ContractOpt = None,
    workload: WorkloadFile = None,
    input_len: InputLen = None,
    output_len: OutputLen = None,
    prefix_groups: PrefixGroups = None,
    prefix_len: PrefixLen = None,
    priority_mix: PriorityMix = None,
    max_requests: MaxRequests = 500,
    duration: Duration = "30s",
    timeout: Timeout = 60.0,
    seed: Seed = 0,
    out: Out = None,
    progress: Progress = None,
    extra_body: ExtraBody = None,
    ignore_eos: IgnoreEos = None,
    constraint: ConstraintOpt = None,
    constrained_fraction: ConstrainedFraction = None,
) -> None:
    """One phase per load level; finds the highest load at which the contract holds."""
    from sluice.bench.arrivals import LoadMode, LoadSpec
    from sluice.bench.sweep import parse_levels

    try:
        if (concurrencies is None) == (rates is None):
            raise ValueError("give exactly one of --concurrencies or --rates")
        if concurrencies is not None:
            levels = parse_levels(concurrencies, "--concurrencies")
            if any(x != int(x) for x in levels):
                raise ValueError(f"invalid --concurrencies {concurrencies!r}: whole numbers only")
            loads = [LoadSpec(LoadMode.CLOSED, concurrency=int(x)) for x in levels]
        else:
            loads = [LoadSpec(LoadMode.POISSON, rate=x) for x in parse_levels(str(rates), "--rates")]
        flags = dict(api=api, input_len=input_len, output_len=output_len, prefix_groups=prefix_groups, prefix_len=prefix_len, priority_mix=priority_mix, trace=None, ignore_eos=ignore_eos, constraint=constraint, constrained_fraction=constrained_fraction)  # fmt: skip
        cfg = _config(
            url=url, model=model, api_key=api_key, contract=_load_contract(contract),
            workload_file=workload, flags=flags, loads=lambda _: loads, is_sweep=True, max_requests=max_requests,
            duration=duration, timeout=timeout, seed=seed, progress=progress, extra_body=extra_body,
        )  # fmt: skip
    except ValueError as e:
        _usage_error(str(e))
    _finish(cfg, out)


@bench_app.command("compare")
def compare_cmd(
    a: Annotated[Path, typer.Argument(help="Baseline summary.json (A).")],
    b: Annotated[Path, typer.Argument(help="Candidate summary.json (B).")],
    max_regression: Annotated[float | None, typer.Option(help="Exit 1 when B is worse than A by more than this fraction on any figure.")] = None,  # fmt: skip
) -> None:
    """Two runs side by side, with ratios B/A (release gates, peer comparisons)."""
    from rich.table import Table

    from sluice.bench.compare import compare_docs, load_doc
    from sluice.bench.report import fmt

    try:
        if max_regression is not None and max_regression < 0:
            raise ValueError("--max-regression must be >= 0")
        da, db = load_doc(a), load_doc(b)
    except ValueError as e:
        _usage_error(str(e))
    rows = compare_docs(da, db, max_regression)
    t = Table(title=f"A = {a}   B = {b}", title_justify="left")
    for col in ("metric", "A", "B", "B/A"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        t.add_row(r.label, fmt(r.a, 3), fmt(r.b, 3), f"[red]{ratio}[/]" if r.is_regression else ratio)
    Console(soft_wrap=True).print(t)
    regressions = [r.label for r in rows if r.is_regression]
    if regressions:
        print(f"regressions beyond {max_regression:.0%}: {', '.join(regressions)}")
    print(json.dumps({"a": str(a), "b": str(b), "rows": [r.to_dict() for r in rows], "regressions": regressions}, allow_nan=False), flush=True)  # fmt: skip
    raise typer.Exit(1 if regressions else 0)


@bench_app.command("presets")
def presets_cmd() -> None:
    """List the built-in contract presets."""
    from sluice.bench.contract import list_presets, load_contract

    for name in list_presets():
        c = load_contract(name)
        targets = ", ".join(f"{t.label} {'>=' if not t.is_upper_bound else '<='} {t.threshold:g}" for t in c.targets)  # fmt: skip
        load = ", ".join(f"{k}={v}" for k, v in c.load.items())
        print(f"{name}: {c.description}\n    targets: {targets}\n    load: {load or '-'}")


def register(app: typer.Typer) -> None:
    """Add ``sluice bench ...`` to the top-level app."""
    app.add_typer(bench_app, name="bench")

