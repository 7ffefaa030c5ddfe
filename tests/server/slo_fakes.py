"""A fake clock and engine stats for the SLO admission tests: an engine "measured" at a = 10 ms per
step plus b = 1 ms per batched token, a 512-token budget and 64 slots."""

from __future__ import annotations

import random

from sluice.engine.protocol import EngineStats
from sluice.server.admission import AdmissionController
from sluice.server.slo import SloTargets

__all__ = ["FakeClock", "REQUEST_TOKENS", "controller", "ran", "stats"]

_tokens_run = [0]  # the engine's cumulative batched tokens in every stats() (``ran`` adds a step's)


class FakeClock:
    def __init__(self, now: float = 10.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def stats(**kw: object) -> EngineStats:
    base: dict[str, object] = dict(step_time_base=0.01, step_time_per_token=0.001, max_num_batched_tokens=512, max_num_seqs=64,
                                   num_batched_tokens_total=_tokens_run[0])  # fmt: skip
    base.update(kw)
    return EngineStats(**base)  # type: ignore[arg-type]


REQUEST_TOKENS = 25  # a 10-token prompt and 16 generated (15 decodes): one request's work (NOTE(work-rate))


def ran(num_requests: float, **kw: object) -> EngineStats:
    """The stats after one more step, that ran ``num_requests`` requests' worth of tokens (the capacity)."""
    _tokens_run[0] += round(num_requests * REQUEST_TOKENS)
    return stats(**kw)


def controller(slo: str, clock: FakeClock, policy: str = "wfq", seed: int = 0) -> AdmissionController:
    return AdmissionController(1000, 10**9, slo=SloTargets.parse(slo), policy=policy, clock=clock, rng=random.Random(seed))
