"""``sluice gateway``: one front door for many replicas (registered by sluice.cli).

    sluice gateway --config examples/gateway/gateway.yaml
    sluice gateway --model smollm2 --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002

Every flag also reads ``SLUICE_<NAME>`` from the environment (``SLUICE_POLICY``,
``SLUICE_SCRAPE_INTERVAL``, ...); flags override the YAML file.
"""

from __future__ import annotations

from typing import Any

import typer

from sluice.errors import InvalidRequestError


def _build_config(
    config: str | None,
    host: str | None,
    port: int | None,
    policy: str | None,
    scrape_interval: float | None,
    api_key: list[str] | None,
    keys_file: str | None,
    model: str | None,
    replica: list[str] | None,
    otlp_endpoint: str | None = None,
) -> Any:
    from sluice.gateway.config import PolicyName, load_config

    if policy is not None and policy not in {p.value for p in PolicyName}:
        known = ", ".join(p.value for p in PolicyName)
        raise InvalidRequestError(f"unknown --policy {policy!r}: expected one of {known}")
    overrides: dict[str, Any] = {
        "host": host,
        "port": port,
        "policy": policy,
        "scrape_interval": scrape_interval,
        "keys_file": keys_file,
        "api_keys": list(api_key) if api_key else None,
        "otlp_endpoint": otlp_endpoint,
    }
    if replica:
        overrides["models"] = {model or "default": {"versions": [{"name": "v1", "replicas": list(replica)}]}}
    elif model and not config:
        # NOTE(env-model): with a config file, a stray SLUICE_MODEL (meant for
        # `sluice serve`) is ignored; without one it is a mistake worth naming.
        raise InvalidRequestError("--model needs at least one --replica URL (or use --config)")
    return load_config(config, **overrides)


def register(app: typer.Typer) -> None:
    @app.command("gateway")
    def gateway(
        config: str = typer.Option(None, "--config", "-c", envvar="SLUICE_CONFIG", help="Gateway YAML config."),
        host: str = typer.Option(None, envvar="SLUICE_HOST", help="Bind address [default 127.0.0.1]."),
        port: int = typer.Option(None, envvar="SLUICE_PORT", help="Bind port [default 9000]."),
        policy: str = typer.Option(
            None, envvar="SLUICE_POLICY", help="round_robin | least_load | weighted | prefix_affinity [default]."
        ),
        scrape_interval: float = typer.Option(
            None, envvar="SLUICE_SCRAPE_INTERVAL", help="Seconds between replica /metrics scrapes [default 1]."
        ),
        api_key: list[str] = typer.Option(None, "--api-key", envvar="SLUICE_API_KEY", help="Accepted API key (repeatable)."),
        keys_file: str = typer.Option(None, envvar="SLUICE_KEYS_FILE", help="Keys file (tiers, rate limits, admin keys)."),
        model: str = typer.Option(None, envvar="SLUICE_MODEL", help="Model name for --replica URLs [default 'default']."),
        replica: list[str] = typer.Option(None, "--replica", envvar="SLUICE_REPLICA", help="Replica base URL (repeatable)."),
        otlp_endpoint: str = typer.Option(
            None, envvar="SLUICE_OTLP_ENDPOINT", help="OTLP/HTTP collector URL for traces (default: off)."
        ),
        log_level: str = typer.Option("info", envvar="SLUICE_LOG_LEVEL", help="uvicorn log level."),
    ) -> None:
        """Route OpenAI requests across replicas: load/prefix-aware, health-checked, with breakers."""
        import uvicorn

        from sluice.gateway.app import build_app

        cfg = _build_config(
            config, host, port, policy, scrape_interval, api_key, keys_file, model, replica, otlp_endpoint
        )
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
