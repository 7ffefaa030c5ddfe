"""``sluice serve``: the OpenAI-compatible server (registered by ``sluice.cli``).

Every flag also reads ``SLUICE_<NAME>`` from the environment (one
pydantic-settings object, ``sluice.server.config.ServerSettings``).
"""

from __future__ import annotations

import typer

__all__ = ["register", "serve"]


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    model: str = typer.Option(None, "--model", "-m", help="HF directory, .gguf file, or 'smollm2'. [env SLUICE_MODEL; default smollm2]"),
    host: str = typer.Option(None, "--host", help="Bind address. [default 127.0.0.1]"),
    port: int = typer.Option(None, "--port", "-p", help="Port (0: any free port). [default 8000]"),
    dtype: str = typer.Option(None, "--dtype", help="float32 | bfloat16 (default: the device's)."),
    kv_cache_memory: str = typer.Option(None, "--kv-cache-memory", help="KV cache budget, e.g. 2GiB (default: a fraction of free memory)."),
    max_model_len: int = typer.Option(None, "--max-model-len", help="Context window (default: the model's)."),
    max_num_seqs: int = typer.Option(None, "--max-num-seqs", help="Running sequences cap. [default 64]"),
    max_num_batched_tokens: int = typer.Option(None, "--max-num-batched-tokens", help="Tokens per engine step. [default 512]"),
    scheduling_policy: str = typer.Option(None, "--scheduling-policy", help="fcfs | priority | wfq. [default wfq]"),
    num_threads: int = typer.Option(None, "--num-threads", help="Engine torch threads (default: torch's, one per core)."),
    api_key: list[str] = typer.Option(None, "--api-key", help="Accept this API key (tier p0, no limit); repeatable."),
    keys_file: str = typer.Option(None, "--keys-file", help="YAML/JSON keys file: key -> tier, rpm, tpm."),
    max_queued_requests: int = typer.Option(None, "--max-queued-requests", help="Admitted, not started requests before 429. [default 256]"),
    max_queued_tokens: int = typer.Option(None, "--max-queued-tokens", help="Their prompt + max_tokens before 429. [default 262144]"),
    max_request_bytes: int = typer.Option(None, "--max-request-bytes", help="Largest request body (413 above). [default 2 MiB]"),
    shutdown_timeout: float = typer.Option(None, "--shutdown-timeout", help="Seconds to drain in-flight requests on SIGTERM. [default 30]"),
    otlp_endpoint: str = typer.Option(None, "--otlp-endpoint", help="OTLP/HTTP collector URL for traces (default: off)."),
    served_model_name: str = typer.Option(None, "--served-model-name", help="Model name in the API (default: the model's)."),
    log_level: str = typer.Option(None, "--log-level", help="critical | error | warning | info | debug. [default info]"),
) -> None:
    """Serve a model over the OpenAI API (completions, chat, streaming, metrics)."""
    from sluice.server.config import load_settings
    from sluice.server.runner import run_server

    settings = load_settings(
        model=model,
        host=host,
        port=port,
        dtype=dtype,
        kv_cache_memory=kv_cache_memory,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        scheduling_policy=scheduling_policy,
        num_threads=num_threads,
        api_key=api_key or None,
        keys_file=keys_file,
        max_queued_requests=max_queued_requests,
        max_queued_tokens=max_queued_tokens,
        max_request_bytes=max_request_bytes,
        shutdown_timeout=shutdown_timeout,
        otlp_endpoint=otlp_endpoint,
        served_model_name=served_model_name,
        log_level=log_level,
    )
    _check_model(settings.model)
    run_server(settings)


def _check_model(spec: str) -> None:
    """Fail fast, in one line, on a model that does not exist (before spawning)."""
    try:
        from sluice.models.loader import resolve_model
    except ImportError:  # the loader is not there yet: the engine will report it
        return
    resolve_model(spec)
