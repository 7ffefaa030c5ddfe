"""``sluice gateway``: one front door for many replicas (registered by sluice.cli).

    sluice gateway --config examples/gateway/gateway.yaml
    sluice gateway --model smollm2 --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002

The flags are the ``GatewayConfig`` fields with a description, plus the few
below that only the command line has; each also reads ``SLUICE_<NAME>``
(``SLUICE_POLICY``, ``SLUICE_SCRAPE_INTERVAL``, ...).  Precedence, as for
``sluice serve`` (``sluice.settings``): flag > environment > YAML file > default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import typer

from sluice.gateway.config import GatewayConfig, gateway_options, load_config
from sluice.settings import Option, make_option, resolve, typer_command

__all__ = ["register", "build_config"]

# Settings of the command itself (not of GatewayConfig).
CLI_OPTIONS: list[Option] = [
    make_option("config", "Gateway YAML config.", str, flags=["-c"]),
    make_option("model", "Model name for --replica URLs.", str, "default"),
    make_option("replica", "Replica base URL (repeatable).", list[str]),
    make_option("log_level", "uvicorn log level.", str, "info"),
]


def build_config(given: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> tuple[GatewayConfig, str]:
    """(config, log level) from command-line values, the environment and the file."""
    cli = resolve(CLI_OPTIONS, {k: v for k, v in given.items() if k in {o.name for o in CLI_OPTIONS}},
                  environ=environ).values  # fmt: skip
    path, model, replica = cli.get("config"), cli.get("model"), cli.get("replica")
    overrides = {k: v for k, v in given.items() if k not in {o.name for o in CLI_OPTIONS}}
    if replica:
        overrides["models"] = {model or "default": {"versions": [{"name": "v1", "replicas": list(replica)}]}}
    elif model and not path:
        # NOTE(env-model): with a config file, a stray SLUICE_MODEL (meant for
        # `sluice serve`) is ignored; without one it is a mistake worth naming.
        from sluice.errors import ConfigError

        raise ConfigError("--model needs at least one --replica URL (or use --config)", setting="model")
    import os

    cfg = load_config(path, environ=os.environ if environ is None else environ, **overrides)
    return cfg, str(cli.get("log_level") or "info")


def gateway(given: dict[str, Any]) -> None:
    """Route OpenAI requests across replicas: load/prefix-aware, health-checked, with breakers."""
    import uvicorn

    from sluice.gateway.app import build_app
    from sluice.obs.heap import freeze_startup_heap

    cfg, log_level = build_config(given)
    provider = None
    if cfg.otlp_endpoint:
        from sluice.obs.tracing import build_tracer_provider

        provider = build_tracer_provider(cfg.otlp_endpoint, service_name="sluice-gateway")
    app_ = build_app(cfg, tracer_provider=provider)
    n = sum(1 for _ in app_.state.gateway.pool.replicas())
    typer.echo(
        f"sluice gateway: {len(cfg.models)} model(s), {n} replica(s), policy {cfg.policy.value}, "
        f"listening on http://{cfg.host}:{cfg.port}",
        err=True,
    )
    freeze_startup_heap("gateway")  # NOTE(gc-freeze)
    uvicorn.run(
        app_,
        host=cfg.host,
        port=cfg.port,
        log_level=log_level,
        access_log=False,
        loop="auto",
        http="auto",
        timeout_graceful_shutdown=5,
    )
    if provider is not None:
        provider.shutdown()  # flush the last spans


def register(app: typer.Typer) -> None:
    options = [*CLI_OPTIONS[:1], *gateway_options(), *CLI_OPTIONS[1:]]
    app.command("gateway")(typer_command(gateway, options, doc=gateway.__doc__ or ""))
