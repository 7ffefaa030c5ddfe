"""The ``sluice`` command: serve, generate, gateway, bench, doctor.

Each layer registers its own sub-commands (``register(app)`` in
``sluice/<layer>/cli.py``) so that this module imports nothing heavy: the
gateway and bench commands never import torch.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

app = typer.Typer(
    name="sluice",
    help="sluice: production LLM serving (engine, OpenAI server, gateway, SLA bench).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """sluice: production LLM serving."""


def _register_all() -> None:
    from sluice.bench import cli as bench_cli
    from sluice.engine import cli as engine_cli
    from sluice.engine import doctor as engine_doctor
    from sluice.gateway import cli as gateway_cli
    from sluice.models import cli as models_cli
    from sluice.obs import cli as obs_cli
    from sluice.server import cli as server_cli

    for mod in (engine_cli, server_cli, gateway_cli, bench_cli, models_cli):
        mod.register(app)
    # obs knows no engine or server: the probes are handed in
    obs_cli.register(app, probes=[engine_doctor.report, _serve_probe])


def _serve_probe() -> dict[str, Any]:
    # imported when `sluice doctor` runs, not at start-up
    from sluice.server.admin import doctor_report

    return doctor_report()


_register_all()


def main() -> None:
    from sluice.errors import ConfigError, SluiceError

    try:
        app()
    except SluiceError as e:  # one readable line, no traceback
        print(f"sluice: error: {e.message}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ConfigError) or e.status_code < 500 else 1)


if __name__ == "__main__":
    main()
