"""Gateway configuration: models -> versions -> replicas, plus policy knobs.

This is the gateway's one settings object (pydantic, validated at the edge),
read from YAML and overridden by ``sluice gateway`` flags / ``SLUICE_*`` env::

    policy: prefix_affinity          # round_robin | least_load | weighted | prefix_affinity
    scrape_interval: 1.0             # seconds between /metrics scrapes
    models:
      smollm2:
        versions:
          - name: v1
            share: 90                # traffic share (relative), for canary rollouts
            replicas:
              - http://127.0.0.1:8001
              - {url: http://127.0.0.1:8002, weight: 2}
          - name: v2
            share: 10
            replicas: [http://127.0.0.1:8003]

Everything below the edge reads these objects; nothing mutates them.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sluice.errors import InvalidRequestError
from sluice.gateway.autoscale import AutoscaleConfig
from sluice.gateway.degradation import DegradationConfig
from sluice.gateway.rollout import RolloutConfig

__all__ = [
    "PolicyName",
    "ReplicaConfig",
    "VersionConfig",
    "ModelConfig",
    "BreakerConfig",
    "RetryConfig",
    "HealthConfig",
    "TimeoutConfig",
    "WeightedConfig",
    "PrefixAffinityConfig",
    "GatewayConfig",
    "DegradationConfig",
    "RolloutConfig",
    "AutoscaleConfig",
    "load_config",
]


class PolicyName(str, enum.Enum):
    """Routing policies; values match ``--policy``."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    WEIGHTED = "weighted"
    PREFIX_AFFINITY = "prefix_affinity"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplicaConfig(_Strict):
    url: str  # base URL, e.g. http://127.0.0.1:8001 (no trailing /v1)
    weight: float = Field(default=1.0, gt=0)  # static share for round_robin / weighted
    capacity: int = Field(default=64, gt=0)  # concurrent requests it sustains ("pending/capacity")
    sustainable_qps: float | None = Field(default=None, gt=0)  # breaker: None = learned from traffic
    api_key: str | None = None  # sent upstream as Bearer; client keys are never forwarded

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"replica url must start with http:// or https://, got {v!r}")
        return v.removesuffix("/v1")


class VersionConfig(_Strict):
    name: str = "v1"
    share: float = Field(default=100.0, ge=0)  # relative traffic share among the model's versions
    served_model: str | None = None  # model name the replicas expect; None: same as requested
    replicas: list[ReplicaConfig] = Field(default_factory=list)  # empty only when autoscale launches them

    @field_validator("replicas", mode="before")
    @classmethod
    def _short_replicas(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"url": r} if isinstance(r, str) else r for r in v]
        return v


class ModelConfig(_Strict):
    versions: list[VersionConfig] = Field(min_length=1)
    fallback: str | None = None  # version that takes p1/p2 traffic at degradation level 2
    autoscale: AutoscaleConfig | None = None  # launch / stop replicas of one version by load

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        names = [v.name for v in self.versions]
        if len(set(names)) != len(names):
            raise ValueError(f"version names must be unique, got {names}")
        if sum(v.share for v in self.versions) <= 0:
            raise ValueError("at least one version needs a share > 0")
        scaled = (self.autoscale.version or names[0]) if self.autoscale else None
        if scaled is not None and scaled not in names:
            raise ValueError(f"autoscale.version {scaled!r} is not one of the versions {names}")
        for v in self.versions:
            if not v.replicas and v.name != scaled:
                raise ValueError(f"version {v.name!r} needs at least one replica (or autoscale to launch them)")
        if self.fallback is not None and self.fallback not in names:
            raise ValueError(f"fallback {self.fallback!r} is not one of the versions {names}")
        return self


class BreakerConfig(_Strict):
    window_s: float = Field(default=10.0, gt=0)  # sliding window length
    num_buckets: int = Field(default=10, ge=2)  # window split for the p99 slope fit
    min_requests: int = Field(default=10, ge=1)  # below this many calls in the window: never trip
    max_threshold: float = Field(default=0.5, gt=0, le=1)  # failure rate to trip an idle, healthy replica
    min_threshold: float = Field(default=0.1, gt=0, le=1)  # failure rate to trip a fully stressed one
    w_qps: float = Field(default=0.3, ge=0)  # score weights: load vs sustainable rate,
    w_latency_slope: float = Field(default=0.4, ge=0)  # p99 latency trend,
    w_memory: float = Field(default=0.3, ge=0)  # KV-cache pressure
    slow_call_s: float | None = Field(default=None, gt=0)  # a success slower than this counts as a failure
    open_s: float = Field(default=5.0, gt=0)  # time open before half-open probing
    max_open_s: float = Field(default=60.0, gt=0)  # open time doubles on each failed probe, up to this
    half_open_probes: int = Field(default=3, ge=1)  # successes needed to close

    @model_validator(mode="after")
    def _check(self) -> BreakerConfig:
        if self.min_threshold > self.max_threshold:
            raise ValueError("breaker min_threshold must be <= max_threshold")
        if self.w_qps + self.w_latency_slope + self.w_memory <= 0:
            raise ValueError("breaker score weights must not all be 0")
        return self


class RetryConfig(_Strict):
    max_attempts: int = Field(default=3, ge=1)  # first try included
    budget_ratio: float = Field(default=0.2, ge=0)  # retries may add at most this share of load
    min_retries_per_s: float = Field(default=1.0, ge=0)  # floor so a quiet gateway can still retry
    budget_window_s: float = Field(default=10.0, gt=0)


class HealthConfig(_Strict):
    interval_s: float = Field(default=1.0, gt=0)  # /health probe period
    timeout_s: float = Field(default=2.0, gt=0)
    unhealthy_after: int = Field(default=2, ge=1)  # consecutive failures (probes or connect errors)
    healthy_after: int = Field(default=2, ge=1)  # consecutive successful probes to come back


class TimeoutConfig(_Strict):
    connect_s: float = Field(default=2.0, gt=0)
    first_byte_s: float = Field(default=120.0, gt=0)  # request sent -> first body byte
    idle_s: float = Field(default=60.0, gt=0)  # max gap between streamed chunks


class WeightedConfig(_Strict):
    w_cpu: float = Field(default=0.4, ge=0)
    w_memory: float = Field(default=0.3, ge=0)
    w_pending: float = Field(default=0.3, ge=0)
    period_s: float = Field(default=5.0, gt=0)  # weights are recomputed this often


class PrefixAffinityConfig(_Strict):
    chunk_chars: int = Field(default=128, ge=8)  # prompt prefix granularity (characters)
    max_chunks: int = Field(default=32, ge=1)  # look at most this many chunks of a prompt
    max_entries: int = Field(default=100_000, ge=16)  # LRU size of the prefix -> replica index
    balance_abs: int = Field(default=4, ge=0)  # leave affinity if pending > min + balance_abs ...
    balance_rel: float = Field(default=1.5, ge=1)  # ... and pending > balance_rel * min


class GatewayConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=9000, ge=0, le=65535)
    policy: PolicyName = PolicyName.PREFIX_AFFINITY
    scrape_interval: float = Field(default=1.0, gt=0)
    api_keys: list[str] = Field(default_factory=list)
    keys_file: str | None = None
    seed: int | None = None  # rng seed for policies and version picks (tests)
    max_request_bytes: int = Field(default=16 * 1024 * 1024, gt=0)  # larger bodies get 413
    otlp_endpoint: str | None = None  # OTLP/HTTP collector for the gateway's spans; None: off
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    weighted: WeightedConfig = Field(default_factory=WeightedConfig)
    prefix_affinity: PrefixAffinityConfig = Field(default_factory=PrefixAffinityConfig)
    degradation: DegradationConfig = Field(default_factory=DegradationConfig)  # docs/operations.md
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)  # canary judgement and rollback

    @model_validator(mode="after")
    def _check(self) -> GatewayConfig:
        if not self.models:
            raise ValueError("no models configured: add 'models:' to the config or pass --replica")
        return self


def load_config(path: str | Path | None = None, **overrides: Any) -> GatewayConfig:
    """Read a YAML config (optional) and apply overrides (``None`` values are ignored).

    Raises ``InvalidRequestError`` with one readable line for any problem.
    """
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except OSError as e:
            raise InvalidRequestError(f"cannot read gateway config {p}: {e.strerror or e}") from e
        except yaml.YAMLError as e:
            raise InvalidRequestError(f"gateway config {p} is not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise InvalidRequestError(f"gateway config {p}: expected a mapping at the top level")
        data.update(raw)
        if data.get("keys_file") and not Path(data["keys_file"]).is_absolute():
            data["keys_file"] = str(p.parent / data["keys_file"])
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "config"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise InvalidRequestError(f"invalid gateway config: {where}: {first['msg']}{more}") from e
