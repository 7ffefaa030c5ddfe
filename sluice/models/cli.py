"""``sluice quantize report MODEL``: per-layer quantization table, optionally writing the checkpoint.

    sluice quantize report smollm2                                   # what the GGUF holds
    sluice quantize report /models/llama --quantization int4 --group-size 32 --quant-fallback auto
    sluice quantize report smollm2 --quantization int4 --out ./smollm2-int4   # then: --model ./smollm2-int4

For each linear layer: its shape, the precision chosen (a GGUF block type,
``awq``, ``gptq-int4``, ``rtn-int4-asym-g32`` ... or float32), its relative
output error on the calibration text (int8/int4 only: for GGUF/AWQ/GPTQ the
checkpoint's own values are the reference), its bytes, and why it is float
when it is.  ``--out DIR`` writes sluice's quantized checkpoint (safetensors
of the canonical tensors + ``sluice_quant.json``), atomically.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import typer

__all__ = ["register", "quantize_report", "render_report"]


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def render_report(report: dict[str, Any], console: Any = None) -> None:
    """Print the per-layer table and the totals with rich."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"{report['model']}: {report['format']} -> --quantization {report['quantization']} --quant-fallback {report['fallback']}")
    table.add_column("layer", no_wrap=True)
    for col, justify in (("shape", "right"), ("precision", "left"), ("error", "right"), ("bytes", "right"), ("why float", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, e in report["layers"].items():
        err = e.get("error_if_quantized", e["error"])
        err_s = "—" if err is None else f"{err:.4f}" + (" (if quantized)" if "error_if_quantized" in e else "")
        why = "" if e["reason"] == "quantized" else e["reason"]
        table.add_row(name, "x".join(str(s) for s in e["shape"]), e["precision"], err_s, f"{e['bytes']:,}", why)
    console.print(table)
    t = report["totals"]
    console.print(
        f"weights: {_mb(t['bytes'])} (float32: {_mb(t['float32_bytes'])}, "
        f"{t['float32_bytes'] / max(1, t['bytes']):.2f}x smaller); "
        f"{t['num_quantized']} quantized matrices, {t['num_float_matrices']} float32"
    )
    me = report.get("model_error")
    if me:
        console.print(
            f"model error: KL {me['value']:.4g} nats/token on {me['tokens']} calibration tokens "
            f"(bound {me['bound']:g}; every candidate quantized: {me['all_quantized']:.4g})"
        )


def quantize_report(
    model: str,
    quantization: str = "auto",
    group_size: int | None = None,
    quant_fallback: str = "auto",
    kl_bound: float | None = None,
    quantize_head: bool | None = None,
    out: Path | None = None,
    as_json: bool = False,
) -> dict[str, Any]:
    from sluice.models.loader import load_model_config, resolve_model
    from sluice.models.quant import load_quantized_weights
    from sluice.models.quant.checkpoint import save_quantized
    from sluice.models.quant.fallback import DEFAULT_KL_BOUND

    source = resolve_model(model)
    sd, report = load_quantized_weights(
        source,
        quantization,
        quant_fallback,
        group_size=group_size,
        quantize_head=quantize_head,
        kl_bound=DEFAULT_KL_BOUND if kl_bound is None else kl_bound,
        measure_errors=quantization.lower() in ("int8", "int4"),
    )
    if as_json:
        print(json.dumps(report, default=str))
    else:
        render_report(report)
    if out is not None:
        written = save_quantized(out, sd, load_model_config(source), report, tokenizer_source=source)
        if not as_json:
            print(f"wrote {written} (serve it with --model {written})")
    return report


def register(app: typer.Typer) -> None:
    quantize = typer.Typer(help="Quantized weights: per-layer reports and quantized checkpoints.", no_args_is_help=True)

    @quantize.command("report")
    def report_cmd(
        model: str = typer.Argument(..., help="HF directory, .gguf file, or 'smollm2'."),
        quantization: str = typer.Option("auto", "--quantization", "-q", help="auto | none | int8 | int4 | gguf | awq | gptq | sluice"),
        group_size: int | None = typer.Option(None, "--group-size", help="int8/int4: inputs per scale (32, 64, 128; -1: per channel). Default 32."),
        quant_fallback: str = typer.Option("auto", "--quant-fallback", help="auto | none | PATTERN,... (fnmatch globs on HF names kept float32)"),
        kl_bound: float | None = typer.Option(None, "--kl-bound", help="auto fallback: model error bound, KL nats/token (default 0.05)."),
        quantize_head: bool | None = typer.Option(None, "--quantize-head/--float-head", help="Quantize the LM head (and a tied embedding) too; default: int8 yes, int4 no."),
        out: Path | None = typer.Option(None, "--out", help="Write the quantized checkpoint to this directory."),
        as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON document instead of a table."),
    ) -> None:
        """Per-layer table: error, precision chosen, bytes; totals; optionally write the checkpoint."""
        from sluice.errors import SluiceError

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        try:
            quantize_report(model, quantization, group_size, quant_fallback, kl_bound, quantize_head, out, as_json)
        except SluiceError:
            raise
        except ValueError as e:  # bad flag combinations: one line, exit 2
            typer.echo(f"sluice: error: {e}", err=True)
            raise typer.Exit(2) from e

    app.add_typer(quantize, name="quantize")
