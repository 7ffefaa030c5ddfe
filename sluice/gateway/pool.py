"""The replica pool: models -> versions -> replicas, and per-model load figures.

This is the one owner of every ``Replica`` and the one place that answers
"how loaded is model M?" (``model_load``): queue length, in-flight tokens and
p95 time to first token.  Degradation, canary analysis and the autoscaler
(follow-up issue) read those figures here, and change traffic shares with
``set_share`` / membership with ``add_replica`` / ``remove_replica``.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from sluice.errors import ModelNotFoundError
from sluice.gateway.config import GatewayConfig, ReplicaConfig
from sluice.gateway.prom import ReplicaLoad
from sluice.gateway.replica import Replica

__all__ = ["Version", "ModelLoad", "ReplicaPool"]

_TTFT_WINDOW_S = 60.0
_TTFT_MAX_SAMPLES = 2048


@dataclass
class Version:
    name: str
    share: float  # relative traffic share, mutable at run time (canary rollouts)
    served_model: str | None  # model name to send upstream; None: keep the client's
    replicas: list[Replica] = field(default_factory=list)

    def routable(self) -> list[Replica]:
        return [r for r in self.replicas if r.is_routable()]


@dataclass(frozen=True)
class ModelLoad:
    num_replicas: int
    num_routable: int  # healthy and breaker not open
    num_waiting: float  # scraped from the replicas' /metrics
    num_running: float  # scraped
    num_inflight: int  # counted by the gateway
    inflight_tokens: int  # counted by the gateway
    p95_ttft_s: float | None  # gateway-measured time to first byte, last minute
    # per class p0..p2, from the routable replica with the lowest ratio (where a new request would go):
    # (predicted TTFT, target) seconds; None when no routable replica exports the predicted-wait signal
    slo_by_priority: tuple[tuple[float, float], ...] | None = None


class ReplicaPool:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ):
        self.config = config
        self._clock = clock
        self._rng = rng or random.Random(config.seed)
        self.versions_by_model: dict[str, list[Version]] = {}
        self._ttft_by_model: dict[str, deque[tuple[float, float]]] = {}  # (time, seconds)
        for model, mcfg in config.models.items():
            self.versions_by_model[model] = []
            self._ttft_by_model[model] = deque(maxlen=_TTFT_MAX_SAMPLES)
            for vcfg in mcfg.versions:
                version = Version(vcfg.name, vcfg.share, vcfg.served_model)
                self.versions_by_model[model].append(version)
                for rcfg in vcfg.replicas:
                    self.add_replica(model, vcfg.name, rcfg)

    # ---- membership --------------------------------------------------------------

    def version(self, model: str, name: str) -> Version:
        for v in self.versions(model):
            if v.name == name:
                return v
        raise ModelNotFoundError(f"model {model!r} has no version {name!r}")

    def versions(self, model: str) -> list[Version]:
        try:
            return self.versions_by_model[model]
        except KeyError:
            known = ", ".join(sorted(self.versions_by_model)) or "none"
            raise ModelNotFoundError(f"model {model!r} is not served here (models: {known})") from None

    def add_replica(self, model: str, version: str, config: ReplicaConfig) -> Replica:
        replica = Replica.build(
            config,
            model=model,
            version=version,
            health=self.config.health,
            breaker=self.config.breaker,
            clock=self._clock,
        )
        self.version(model, version).replicas.append(replica)
        return replica

    def remove_replica(self, replica: Replica) -> None:
        self.version(replica.model, replica.version).replicas.remove(replica)

    def set_share(self, model: str, version: str, share: float) -> None:
        if share < 0:
            raise ValueError(f"a traffic share must be >= 0, got {share}")
        self.version(model, version).share = share

    def replicas(self) -> Iterator[Replica]:
        for versions in self.versions_by_model.values():
            for v in versions:
                yield from v.replicas

    @property
    def models(self) -> list[str]:
        return list(self.versions_by_model)

    # ---- routing helpers -------------------------------------------------------------

    def pick_version(self, model: str) -> Version | None:
        """A version by traffic share among those with a routable replica; None if none has."""
        live = [v for v in self.versions(model) if v.share > 0 and v.routable()]
        if not live:
            # NOTE(version-fallback): a version with share 0 still serves when
            # every shared version is down (better a canary than a 503).
            live = [v for v in self.versions(model) if v.routable()]
            if not live:
                return None
            return live[0]
        if len(live) == 1:
            return live[0]
        return self._rng.choices(live, weights=[v.share or 1e-9 for v in live])[0]

    def retry_after(self, model: str) -> float:
        """Seconds until some replica of ``model`` may be routable again (>= 1)."""
        waits = [r.retry_after() for v in self.versions(model) for r in v.replicas]
        return max(1.0, min(waits, default=1.0))

    # ---- load figures ------------------------------------------------------------------

    def record_ttft(self, model: str, seconds: float) -> None:
        self._ttft_by_model[model].append((self._clock(), seconds))

    def p95_ttft(self, model: str, window_s: float = _TTFT_WINDOW_S, min_samples: int = 1) -> float | None:
        """p95 time to first byte over the last ``window_s``; None with fewer than ``min_samples``."""
        horizon = self._clock() - window_s
        samples = sorted(s for t, s in self._ttft_by_model.get(model, ()) if t >= horizon)
        if len(samples) < max(1, min_samples):
            return None
        return samples[min(len(samples) - 1, int(0.95 * len(samples)))]

    def model_load(self, model: str) -> ModelLoad:
        reps = [r for v in self.versions(model) for r in v.replicas]
        return ModelLoad(
            num_replicas=len(reps),
            num_routable=sum(r.is_routable() for r in reps),
            num_waiting=sum(r.load.num_waiting or 0.0 for r in reps),
            num_running=sum(r.load.num_running or 0.0 for r in reps),
            num_inflight=sum(r.num_inflight for r in reps),
            inflight_tokens=sum(r.inflight_tokens for r in reps),
            p95_ttft_s=self.p95_ttft(model),
            slo_by_priority=_best_slo([r.load for r in reps if r.is_routable()]),
        )


def _best_slo(loads: list[ReplicaLoad]) -> tuple[tuple[float, float], ...] | None:
    """Per class, the (predicted TTFT, target) of the replica with the lowest predicted / target ratio."""
    signals = [(ld.predicted_ttft, ld.ttft_target) for ld in loads if ld.predicted_ttft and ld.ttft_target]
    if not signals:
        return None
    out = []
    for c in range(3):
        pairs = [(pred[c], tgt[c]) for pred, tgt in signals if tgt[c] > 0]
        out.append(min(pairs, key=lambda pt: pt[0] / pt[1]) if pairs else (0.0, 0.0))
    return tuple(out)
