"""``sluice serve`` settings: one pydantic-settings object for the API process.

Every field is a CLI flag (``--max-queued-requests``) and also reads
``SLUICE_<NAME>`` from the environment (``SLUICE_MAX_QUEUED_REQUESTS``).
Flags given on the command line win over the environment.  The engine's part
is handed to the engine core process as a plain ``EngineConfig`` dataclass.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from sluice.engine.config import EngineConfig, parse_bytes
from sluice.errors import InvalidRequestError

__all__ = ["ServerSettings", "load_settings"]


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="forbid", frozen=True)

    model: str = "smollm2"  # HF dir, .gguf file, or 'smollm2'
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    dtype: str | None = None
    kv_cache_memory: int | None = None  # bytes; accepts '2GiB'
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    scheduling_policy: str = "wfq"
    num_threads: int | None = Field(None, ge=1)  # engine torch threads; None: torch's default
    api_key: Annotated[list[str], NoDecode] = Field(default_factory=list)
    keys_file: str | None = None
    max_queued_requests: int = Field(256, ge=0)  # requests admitted but not started
    max_queued_tokens: int = Field(262_144, ge=0)  # their prompt + max_tokens
    max_request_bytes: int = Field(2 * 1024 * 1024, ge=1)
    shutdown_timeout: float = Field(30.0, ge=0)  # seconds to drain on SIGTERM
    otlp_endpoint: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _bytes(cls, v: object) -> object:
        if v is None or v == "":
            return None
        return parse_bytes(v)  # type: ignore[arg-type]

    @field_validator("api_key", mode="before")
    @classmethod
    def _keys(cls, v: object) -> object:
        # NOTE(env-keys): SLUICE_API_KEY holds one key or a comma-separated list.
        if isinstance(v, str):
            return [k.strip() for k in v.split(",") if k.strip()]
        return v

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.lower()
        if v not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError("must be one of critical, error, warning, info, debug")
        return v

    @field_validator("scheduling_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in ("fcfs", "priority", "wfq"):
            raise ValueError("must be fcfs, priority or wfq")
        return v

    def engine_config(self) -> EngineConfig:
        cfg = EngineConfig(
            model=self.model,
            dtype=self.dtype,
            kv_cache_memory=self.kv_cache_memory,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            scheduling_policy=self.scheduling_policy,
            num_threads=self.num_threads,
        )
        cfg.validate()
        return cfg


def load_settings(**overrides: object) -> ServerSettings:
    """Build settings from env + explicit overrides (``None`` values are ignored).

    Raises ``InvalidRequestError`` with one readable line naming the bad flag.
    """
    given = {k: v for k, v in overrides.items() if v is not None and v != [] and v != ()}
    try:
        return ServerSettings(**given)  # type: ignore[arg-type]
    except ValidationError as e:
        first = e.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "settings"
        flag = "--" + name.replace("_", "-")
        raise InvalidRequestError(f"{flag} (or SLUICE_{name.upper()}): {first['msg']}") from None
