"""``sluice serve`` settings: one pydantic object for the API process.

``ServerSettings`` composes the engine's ``EngineConfig`` (``settings.engine``,
handed to the engine core process as it is) with the API process's own fields
below.  Both kinds are settings in the sense of ``sluice.settings``: each field
is a flag (``--max-queued-requests``), an environment variable
(``SLUICE_MAX_QUEUED_REQUESTS``) and a key of ``--config FILE.yaml``, all flat::

    # serve.yaml
    model: smollm2
    port: 8001
    max_num_seqs: 32
    kv_cache_memory: 256MiB

Precedence: flag > environment > file > default.  A server option is one field
here with a ``description`` (its help); an engine option is one field of
``EngineConfig``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.engine.config import EngineConfig
from sluice.errors import ConfigError
from sluice.server.slo import SloTargets
from sluice.settings import (
    Option,
    make_option,
    options_from_dataclass,
    options_from_model,
    read_yaml,
    resolve,
)

__all__ = ["ServerSettings", "load_settings", "serve_options", "CONFIG_OPTION"]

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

# ``--config FILE.yaml`` (or SLUICE_CONFIG): the file layer itself.
CONFIG_OPTION = make_option("config", "YAML file of settings (keys as the flags, with underscores).", str,
                            flags=["-c"])  # fmt: skip


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(default_factory=EngineConfig)  # the engine's options
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8000, ge=0, le=65535, description="Port (0: any free port).",
                      json_schema_extra={"flags": ["-p"]})  # fmt: skip
    api_key: list[str] = Field(default_factory=list, description=(
        "Accept this API key (tier p0, no limit); repeatable, comma-separated in the environment."))
    keys_file: str | None = Field(None, description="YAML/JSON keys file: key -> tier, rpm, tpm.")
    # admin endpoints and runtime LoRA loading (NOTE(admin-access) in sluice.auth, docs/server.md)
    admin_key: list[str] = Field(default_factory=list, description=(
        "Accept this key on the admin endpoints (/admin/*, LoRA load/unload) only; repeatable, comma-separated "
        "in the environment. Without an admin key they answer to loopback clients of a loopback-bound server."))
    allow_admin_without_key: bool = Field(False, description=(
        "Serve the admin endpoints to every client the API accepts, with no admin key (only behind a proxy "
        "of yours that guards /admin/*)."))
    enable_runtime_lora: bool = Field(False, description=(
        "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admin endpoints); adapters load from "
        "--lora-dir only."))
    lora_dir: list[str] = Field(default_factory=list, description=(
        "A directory runtime LoRA loads may read adapters from (repeatable; comma-separated in the environment)."))
    max_queued_requests: int = Field(256, ge=0, description="Admitted, not started requests before 429.")
    max_queued_tokens: int = Field(262_144, ge=0, description="Their prompt + max_tokens before 429.")
    slo: str = Field("auto", description=(
        "Per-class TTFT targets for admission by predicted wait, e.g. p0=0.5s,p1=2s,p2=5s; a class left out, "
        "or 'auto', gets max(0.1/2/5 s, 4/10/25 x its unloaded TTFT), held to only while another class is "
        "active beside it (a class alone is queued and served); 'off': no predicted-wait admission."))
    max_queue_wait: float = Field(90.0, gt=0, description=(
        "Seconds: a request whose predicted time to first token is longer gets 429 wait_too_long, whatever "
        "--slo says (a client waits no longer); not with --slo off."))
    max_request_bytes: int = Field(2 * 1024 * 1024, ge=1, description="Largest request body (413 above).")
    shutdown_timeout: float = Field(30.0, ge=0, description="Seconds to drain in-flight requests on SIGTERM.")
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP collector URL for traces (default: off).")
    served_model_name: str | None = Field(None, description="Model name in the API (default: the model's).")
    log_level: str = Field("info", description=" | ".join(LOG_LEVELS) + ".")
    data_parallel_size: str = Field("1", description=(
        "Engine core processes behind this API process, each with its own copy of the model, KV cache and "
        "slots (CPU only; threads each: --num-threads, default the cores / N, idle ones lent). Requests go to "
        "the one with the shortest predicted wait; P0s are spread first. auto: 2 on a CPU of 2-3 cores with "
        "quantized weights, unpinned and --num-threads not given, else 1: for many short requests, not long "
        "multi-turn prompts (docs/server.md)."))
    # operations (docs/operations.md)
    cpu_affinity: str | None = Field(None, description=(
        "Cores of the engine core process: auto (the NUMA node of --device, or the cores this process was "
        "given) or a cpu list such as 0-7; its memory comes from their node, and the API process moves to "
        "the other cores when there are any. Default: off."))
    profile_dir: str | None = Field(None, description=(
        "Where POST /admin/profile keeps its archives (default: <tmp>/sluice-profiles)."))
    profile_max_seconds: float = Field(60.0, ge=0, description=(
        "Longest profile POST /admin/profile takes (0: the endpoint is off)."))
    profile_keep: int = Field(10, ge=1, description="Profiles kept in --profile-dir (oldest removed first).")
    profile_max_mib: int = Field(512, ge=1, description="Size cap of --profile-dir in MiB (oldest removed first).")
    pyroscope_server: str | None = Field(None, description=(
        "Send continuous profiles to this Pyroscope server (pip install 'sluice-llm[pyroscope]'); "
        "default: off. An unreachable server never affects serving."))

    @field_validator("api_key", "admin_key", "lora_dir", mode="before")
    @classmethod
    def _keys(cls, v: object) -> object:
        # NOTE(env-keys): one key or a comma-separated list, as in SLUICE_API_KEY.
        if isinstance(v, str):
            return [k.strip() for k in v.split(",") if k.strip()]
        return v

    @field_validator("cpu_affinity")
    @classmethod
    def _affinity(cls, v: str | None) -> str | None:
        if v is not None:
            from sluice.obs.placement import parse_affinity

            parse_affinity(v)  # ConfigError (a ValueError) names the problem
        return v

    @field_validator("data_parallel_size", mode="before")
    @classmethod
    def _lanes(cls, v: object) -> str:
        text = str(v).strip().lower()
        if text == "auto":
            return text
        try:
            n = int(text)
        except ValueError:
            n = 0
        if isinstance(v, bool) or not 1 <= n <= 64:
            raise ValueError(f"must be auto or a number of engine cores from 1 to 64, not {v!r}")
        return str(n)

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.lower()
        if v not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
        return v

    @field_validator("slo")
    @classmethod
    def _slo(cls, v: str) -> str:
        if v.strip().lower() != "off":
            SloTargets.parse(v)  # ValueError names the bad entry
        return v

    @property
    def slo_targets(self) -> SloTargets | None:
        """The TTFT targets; None when predicted-wait admission is off."""
        return None if self.slo.strip().lower() == "off" else SloTargets.parse(self.slo)

    @property
    def model_name(self) -> str:
        """The name the API serves before the model is loaded (``--served-model-name`` or ``--model``)."""
        return self.served_model_name or self.engine.model


def serve_options() -> list[Option]:
    """Every ``sluice serve`` setting: the engine's, then the API process's."""
    return options_from_dataclass(EngineConfig) + options_from_model(ServerSettings, exclude={"engine"})


def load_settings(
    config: str | None = None, *, environ: Mapping[str, str] | None = None, **flags: Any
) -> ServerSettings:
    """Settings from ``flags`` (field name -> value; ``None``: not given), the
    ``SLUICE_*`` environment and the ``config`` YAML file, in that precedence.

    Raises ``ConfigError`` with one readable line naming the flag.
    """
    options = serve_options()
    path = flags.pop("config", None) or config
    if path is None:
        path = resolve([CONFIG_OPTION], {}, environ=environ).values.get("config")
    file_values = read_yaml(path, "serve config") if path else {}
    r = resolve(options, flags, environ=environ, file_values=file_values, file_name=str(path or ""))
    engine_names = {f.name for f in fields(EngineConfig)}

    def make(values: dict[str, Any]) -> ServerSettings:
        nested: dict[str, Any] = {"engine": {k: v for k, v in values.items() if k in engine_names}}
        nested.update({k: v for k, v in values.items() if k not in engine_names})
        settings = ServerSettings.model_validate(nested)
        settings.engine.validate()
        if settings.enable_runtime_lora and not settings.lora_dir:
            raise ConfigError("--enable-runtime-lora needs at least one --lora-dir to load adapters from",
                              setting="lora_dir")  # fmt: skip
        if settings.data_parallel_size not in ("auto", "1") and settings.engine.device != "cpu":
            raise ConfigError(f"{settings.data_parallel_size} engine cores run on the CPU only, not on "
                              f"--device {settings.engine.device}", setting="data_parallel_size")  # fmt: skip
        return settings

    return r.build(make)
