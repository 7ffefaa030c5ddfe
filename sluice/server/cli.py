"""``sluice serve``: the OpenAI-compatible server (registered by ``sluice.cli``).

The flags are derived from the settings' fields (``ServerSettings`` and the
``EngineConfig`` it composes): each also reads ``SLUICE_<NAME>`` and the key
``<name>`` of ``--config FILE.yaml``; flag > environment > file > default.
"""

from __future__ import annotations

from typing import Any

import typer

from sluice.server.config import CONFIG_OPTION, serve_options
from sluice.settings import multi_value_command_class, typer_command

__all__ = ["register", "serve"]


def serve(given: dict[str, Any]) -> None:
    """Serve a model over the OpenAI API (completions, chat, streaming, metrics)."""
    from sluice.server.config import load_settings
    from sluice.server.runner import run_server

    settings = load_settings(**given)
    _check_model(settings.engine.model)
    run_server(settings)


def register(app: typer.Typer) -> None:
    options = [CONFIG_OPTION, *serve_options()]
    # NOTE(multi-value): --lora-modules a=/x b=/y, as vLLM accepts (sluice.settings.expand_multi_value_flags)
    app.command("serve", cls=multi_value_command_class(options))(typer_command(serve, options, doc=serve.__doc__ or ""))


def _check_model(spec: str) -> None:
    """Fail fast, in one line, on a model that does not exist (before spawning)."""
    try:
        from sluice.models.loader import resolve_model
    except ImportError:  # the loader is not there yet: the engine will report it
        return
    resolve_model(spec)
