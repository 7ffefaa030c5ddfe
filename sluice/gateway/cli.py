"""CLI for sluice.gateway (registered by sluice.cli)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this layer's commands to the top-level app (not built yet)."""
