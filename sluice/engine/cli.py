"""``sluice generate``: offline generation streamed to the terminal.

The engine flags (``--model``, ``--dtype``, ``--kv-cache-memory``, ...) are
derived from ``EngineConfig``, as for ``sluice serve``, and read ``SLUICE_*``
from the environment the same way (``sluice.settings``).
"""

from __future__ import annotations

import inspect
from typing import Any

import typer

from sluice.engine.config import EngineConfig
from sluice.settings import options_from_dataclass, resolve, typer_command

__all__ = ["register", "generate", "load_engine_config"]

_KW = inspect.Parameter.KEYWORD_ONLY
_SAMPLING = [
    inspect.Parameter("prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str,
                      default=typer.Argument(..., help="The prompt text.")),
    inspect.Parameter("chat", _KW, annotation=bool, default=typer.Option(False, "--chat", help="Apply the model's chat template.")),
    inspect.Parameter("max_tokens", _KW, annotation=int, default=typer.Option(128, "--max-tokens", "-n")),
    inspect.Parameter("temperature", _KW, annotation=float, default=typer.Option(0.0, "--temperature", "-t")),
    inspect.Parameter("top_p", _KW, annotation=float, default=typer.Option(1.0, "--top-p")),
    inspect.Parameter("top_k", _KW, annotation=int, default=typer.Option(0, "--top-k")),
    inspect.Parameter("seed", _KW, annotation=int | None, default=typer.Option(None, "--seed")),
]  # fmt: skip


def load_engine_config(flags: dict[str, Any], environ: dict[str, str] | None = None) -> EngineConfig:
    """An ``EngineConfig`` from flags (``None``: not given) over ``SLUICE_*``; ``ConfigError`` names the flag."""
    from pydantic import TypeAdapter

    def make(values: dict[str, Any]) -> EngineConfig:
        cfg = TypeAdapter(EngineConfig).validate_python(values)
        cfg.validate()
        return cfg

    return resolve(options_from_dataclass(EngineConfig), flags, environ=environ).build(make)


def generate(given: dict[str, Any]) -> None:
    """Generate a completion and stream it to the terminal."""
    import dataclasses
    import sys

    from sluice.engine.llm import LLM
    from sluice.engine.protocol import SamplingParams

    sampling = {p.name: given.pop(p.name) for p in _SAMPLING}
    cfg = load_engine_config(given)
    params = SamplingParams(
        max_tokens=sampling["max_tokens"], temperature=sampling["temperature"],
        top_p=sampling["top_p"], top_k=sampling["top_k"], seed=sampling["seed"],
    )  # fmt: skip
    llm = LLM(**dataclasses.asdict(cfg))
    for piece in llm.stream(sampling["prompt"], params, chat=sampling["chat"]):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


def register(app: typer.Typer) -> None:
    command = typer_command(generate, options_from_dataclass(EngineConfig), doc=generate.__doc__ or "",
                            params=_SAMPLING)  # fmt: skip
    app.command("generate")(command)
