"""Gateway configuration: models -> versions -> replicas, plus policy knobs.

This is the gateway's one settings object (pydantic, validated at the edge),
read from YAML, then ``SLUICE_*`` variables, then ``sluice gateway`` flags
(``sluice.settings``; the fields with a description are flags)::

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

The config types of every gateway module live here (autoscale, degradation,
rollout, launchers): policy modules import this module, never the reverse.
Everything below the edge reads these objects; nothing mutates them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sluice.settings import Option, options_from_model, read_yaml, resolve

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
    "LauncherName",
    "LauncherConfig",
    "AutoscaleConfig",
    "DegradationPolicyName",
    "DegradationConfig",
    "RolloutConfig",
    "gateway_options",
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


class LauncherName(str, enum.Enum):
    """Values match the config's ``autoscale.launcher.kind``."""

    LOCAL = "local"
    RAY = "ray"


class LauncherConfig(_Strict):
    kind: LauncherName = LauncherName.LOCAL
    host: str | None = None  # replicas' bind address; None: 127.0.0.1 (local), the Ray node's IP (ray)
    cpus_per_replica: float = Field(default=1, gt=0)  # cores pinned (local) / Ray num_cpus (ray)
    ready_timeout_s: float = Field(default=180.0, gt=0)  # launch -> /health 200
    stop_timeout_s: float = Field(default=30.0, gt=0)  # SIGTERM -> SIGKILL
    restart_backoff_s: float = Field(default=1.0, gt=0)  # first restart delay after a crash (local)
    max_restart_backoff_s: float = Field(default=30.0, gt=0)  # the delay doubles up to this
    stable_after_s: float = Field(default=60.0, gt=0)  # up this long: the backoff resets
    ray_address: str | None = None  # None: the running Ray, or a local one (ray.init())
    ray_namespace: str = "sluice"


class AutoscaleConfig(_Strict):
    """Per model (``models.<name>.autoscale``)."""

    version: str | None = None  # version the launched replicas serve (default: the first)
    model_path: str  # ``sluice serve --model`` for launched replicas
    served_model_name: str | None = None
    serve_args: list[str] = Field(default_factory=list)  # more ``sluice serve`` flags
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    high_water: float = Field(default=0.85, gt=0)  # load score above which to scale up
    low_water: float = Field(default=0.3, ge=0)  # load score below which to scale down
    max_step: int = Field(default=1, ge=1)  # replicas added per decision at most
    up_cooldown_s: float = Field(default=180.0, ge=0)  # after a scale-up, before the next one
    down_cooldown_s: float = Field(default=600.0, ge=0)  # low load this long (and since any change)
    interval_s: float = Field(default=5.0, gt=0)  # decision period
    drain_timeout_s: float = Field(default=120.0, gt=0)  # in-flight requests get this long to finish
    replica_capacity: int = Field(default=64, gt=0)  # ``capacity`` of launched replicas in the pool
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)

    @model_validator(mode="after")
    def _check(self) -> AutoscaleConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscale min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if self.low_water >= self.high_water:
            raise ValueError(f"autoscale low_water ({self.low_water}) must be below high_water ({self.high_water})")
        return self


class DegradationPolicyName(str, enum.Enum):
    """Values match the config's ``degradation.policy``."""

    GRADED = "graded"
    OFF = "off"


class DegradationConfig(_Strict):
    policy: DegradationPolicyName = DegradationPolicyName.GRADED
    ttft_target_s: float = Field(default=2.0, gt=0)  # the contract's p95 time to first token
    ttft_window_s: float = Field(default=10.0, gt=0)  # p95 TTFT over this recent window
    ttft_min_samples: int = Field(default=5, ge=1)  # fewer TTFTs in the window: no TTFT signal (p95 = max)
    queue_per_replica: float = Field(default=8.0, gt=0)  # waiting requests a replica holds at "full"
    tokens_per_replica: float = Field(default=16384, gt=0)  # in-flight tokens a replica holds at "full"
    enter: tuple[float, float, float] = (0.8, 1.0, 1.2)  # score to rise into level 1, 2, 3
    exit: tuple[float, float, float] = (0.6, 0.8, 1.0)  # score below which level 1, 2, 3 is left
    rise_s: tuple[float, float, float] = (1.0, 15.0, 15.0)  # how long above enter[k] before rising
    fall_s: float = Field(default=10.0, ge=0)  # how long below exit[k] before falling one level
    # with the replicas' predicted-wait signal (score = predicted TTFT / target): rise into level 1, 2, 3 at
    # these ratios (level 3 at 1.0: the replicas would refuse the request anyway), leave below slo_exit
    slo_enter: tuple[float, float, float] = (0.5, 0.8, 1.0)
    slo_exit: tuple[float, float, float] = (0.3, 0.6, 0.8)
    shed_p1_score: float = Field(default=1.5, gt=0)  # at level 3, p1 is shed from this score up
    shed_p0_score: float = Field(default=2.0, gt=0)  # ... and p0 from this one, if no p1/p2 is left
    min_max_tokens: int = Field(default=16, ge=1)  # level 1 never caps below this
    max_cut: float = Field(default=0.8, ge=0, lt=1)  # level 1 cuts at most this share of max_tokens
    retry_after_s: float = Field(default=2.0, gt=0)  # Retry-After on a shed request
    eval_interval_s: float = Field(default=0.25, gt=0)  # re-read the load at most this often

    @model_validator(mode="after")
    def _check(self) -> DegradationConfig:
        for name in ("", "slo_"):
            enter, exit_ = getattr(self, name + "enter"), getattr(self, name + "exit")
            if list(enter) != sorted(enter):
                raise ValueError(f"degradation.{name}enter must rise with the level, got {list(enter)}")
            for k, (lo, hi) in enumerate(zip(exit_, enter, strict=True)):
                if lo >= hi:
                    raise ValueError(f"degradation.{name}exit[{k}] ({lo}) must be below {name}enter[{k}] ({hi}) (hysteresis)")
        if self.shed_p0_score < self.shed_p1_score:
            raise ValueError("degradation.shed_p0_score must be >= shed_p1_score (p0 is shed last)")
        if any(s < 0 for s in self.rise_s):
            raise ValueError("degradation.rise_s must be >= 0")
        return self


class RolloutConfig(_Strict):
    auto_rollback: bool = True
    window_s: float = Field(default=60.0, gt=0)  # sliding window of attempts compared
    min_requests: int = Field(default=10, ge=1)  # canary attempts in the window before judging
    max_5xx_rate: float = Field(default=0.05, ge=0, le=1)
    max_p99_s: float = Field(default=2.0, gt=0)  # p99 time to first byte
    max_success_drop: float = Field(default=0.10, ge=0, le=1)  # success rate vs the stable one
    judge_interval_s: float = Field(default=0.2, ge=0)  # judge a canary at most this often
    max_events: int = Field(default=100, ge=1)  # events kept for /admin/rollout


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
    # NOTE(flags): a field with a description is also a flag and a SLUICE_* variable
    # (``sluice.settings``); the rest are set in the YAML file only.
    host: str = Field(default="127.0.0.1", description="Bind address.")
    port: int = Field(default=9000, ge=0, le=65535, description="Bind port.")
    policy: PolicyName = Field(default=PolicyName.PREFIX_AFFINITY, description="Routing policy.")
    scrape_interval: float = Field(default=1.0, gt=0, description="Seconds between replica /metrics scrapes.")
    api_keys: list[str] = Field(default_factory=list, description="Accepted API key (repeatable).",
                                json_schema_extra={"flags": ["--api-key"], "envvars": ["SLUICE_API_KEY"]})  # fmt: skip
    keys_file: str | None = Field(default=None, description="Keys file (tiers, rate limits, admin keys).")
    # NOTE(admin-access) in sluice.auth: the rule of `sluice serve`
    admin_keys: list[str] = Field(default_factory=list, description=(
        "Accept this key on /admin/* only (repeatable). Without an admin key /admin/* answers to loopback "
        "clients of a loopback-bound gateway with no keys."),
        json_schema_extra={"flags": ["--admin-key"], "envvars": ["SLUICE_ADMIN_KEY"]})  # fmt: skip
    allow_admin_without_key: bool = Field(default=False, description=(
        "Serve /admin/* to every client the gateway accepts, with no admin key (behind a proxy of yours)."))
    seed: int | None = None  # rng seed for policies and version picks (tests)
    max_request_bytes: int = Field(default=16 * 1024 * 1024, gt=0)  # larger bodies get 413
    otlp_endpoint: str | None = Field(default=None, description="OTLP/HTTP collector URL for traces (default: off).")
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


def gateway_options() -> list[Option]:
    """The settings that are also ``sluice gateway`` flags and ``SLUICE_*`` variables."""
    return options_from_model(GatewayConfig)


_NO_ENV: Mapping[str, str] = MappingProxyType({})


def load_config(
    path: str | Path | None = None, *, environ: Mapping[str, str] = _NO_ENV, **overrides: Any
) -> GatewayConfig:
    """Read a YAML config (optional), then ``environ``'s ``SLUICE_*`` variables
    (none unless given: pass ``os.environ``), then ``overrides`` (``None`` values
    are not given) -- ``sluice.settings``' precedence.

    Raises ``ConfigError`` with one readable line for any problem.
    """
    data: dict[str, Any] = {}
    if path:
        data = read_yaml(path, "gateway config")
        if data.get("keys_file") and not Path(data["keys_file"]).is_absolute():
            data["keys_file"] = str(Path(path).parent / data["keys_file"])
    r = resolve(gateway_options(), overrides, environ=environ, file_values=data, file_name=str(path or ""))
    return r.build(GatewayConfig.model_validate)
