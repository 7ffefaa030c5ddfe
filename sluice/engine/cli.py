"""``sluice generate``: offline generation streamed to the terminal."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)


def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: str = typer.Option("smollm2", "--model", "-m", envvar="SLUICE_MODEL", help="HF dir, .gguf file, or 'smollm2'."),
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n"),
    temperature: float = typer.Option(0.0, "--temperature", "-t"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: int | None = typer.Option(None, "--seed"),
    dtype: str | None = typer.Option(None, "--dtype", envvar="SLUICE_DTYPE"),
) -> None:
    """Generate a completion and stream it to the terminal."""
    import sys

    from sluice.engine.llm import LLM
    from sluice.engine.protocol import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
    )
    llm = LLM(model, dtype=dtype)
    for piece in llm.stream(prompt, params, chat=chat):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
